"""What a restore costs: a model about to be restored draws no initial rows (its plain
tables are zeroed, every row then written by the checkpoint), and a chain verified by
``resolve_chain`` is not read and summed a second time by ``restore`` - config B's
evaluation spent 11 s drawing rows it overwrote and 15 s summing its 13 GB again. The
restored state must be exactly the state a drawn model restores to."""

import time
import types
from pathlib import Path

import pytest
import torch

from recscale.checkpoint import format as fmt
from recscale.checkpoint.format import CheckpointError, verify
from recscale.checkpoint.manager import checkpoint_dirs, resolve_chain
from recscale.checkpoint.state import restore
from recscale.config import load_config
from recscale.embedding.storage import DeviceStorage
from recscale.models.dlrm import build_model
from recscale.modules import embedding_bag_collection as ebc_mod
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.run import train

QUIET = {"echo": lambda _m: None}
RUN = [
    "--train.progress=false",
    "--data.eval_samples=2048",
    "--train.steps=20",
    "--checkpoint.every_steps=10",
    "--checkpoint.full_every=2",
    "--checkpoint.full_if_fraction=1.0",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("run")
    train(load_config("debug", RUN), d, **QUIET)
    return d


@pytest.fixture
def no_draws(monkeypatch):
    def drawn(*_a, **_k):
        raise AssertionError("initial rows were drawn")

    monkeypatch.setattr(ebc_mod, "init_table_rows", drawn)


@pytest.mark.parametrize("rows", ["fp32", "split_bf16", "int8"])
def test_a_model_to_be_restored_draws_nothing_and_restores_to_the_same_state(
    run_dir, monkeypatch, rows
):
    cfg = load_config(str(run_dir / "config.toml"), [f"--embedding.row_precision={rows}"])
    chain = resolve_chain(run_dir, **QUIET)
    assert [fmt.read_manifest(p)["kind"] for p in chain] == ["full", "incremental"]
    drawn = build_model(cfg.model, cfg.embedding, seed=7)
    restore(drawn, build_dense_optimizer(cfg.optimizer, drawn.dense_parameters()), chain)
    monkeypatch.setattr(ebc_mod, "init_table_rows", pytest.fail)
    bare = build_model(cfg.model, cfg.embedding, seed=7, init_rows=False)
    plain = [s for s in bare.embeddings.storages() if isinstance(s, DeviceStorage)]
    assert plain and all(not s.weight.view(torch.uint8).any() for s in plain)  # zeros
    restore(bare, build_dense_optimizer(cfg.optimizer, bare.dense_parameters()), chain)
    want = drawn.state_dict()
    for k, v in bare.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_resume_and_eval_draw_no_rows(run_dir, tmp_path, no_draws):
    from recscale.cli.main import main

    again = load_config(str(run_dir / "config.toml"), ["--train.steps=40"])
    metrics = train(again, run_dir, resume=run_dir, **QUIET)
    assert metrics["steps"] == 40
    assert main(["eval", "--model", str(run_dir)]) == 0
    with pytest.raises(AssertionError, match="drawn"):  # a fresh run still draws them
        train(load_config("debug", ["--train.steps=1"]), tmp_path / "fresh", **QUIET)


@pytest.fixture
def crc_reads(monkeypatch) -> list[int]:
    """The bytes each zlib.crc32 call of the checkpoint format summed."""
    seen: list[int] = []
    crc32 = fmt.zlib.crc32

    def counted(data, value=0):
        seen.append(len(data))
        return crc32(data, value)

    monkeypatch.setattr(fmt, "zlib", types.SimpleNamespace(crc32=counted))
    return seen


def _file_bytes(ckpt: Path) -> int:
    return sum(i["bytes"] for i in fmt.read_manifest(ckpt)["files"].values())


def test_a_settled_checkpoint_is_summed_once_and_again_when_it_changes(
    tmp_path, monkeypatch, crc_reads
):
    train(load_config("debug", ["--train.progress=false", "--train.steps=5"]), tmp_path, **QUIET)
    (ckpt,) = checkpoint_dirs(tmp_path / "checkpoints")
    fmt._SUMMED.clear()
    crc_reads.clear()  # the save's own sums
    later = time.time_ns() + 2_000_000_000  # the files settled 2 s ago
    monkeypatch.setattr(fmt, "time", types.SimpleNamespace(time_ns=lambda: later))
    verify(ckpt)
    first = sum(crc_reads)  # the files, and the manifest's own sum
    assert first >= _file_bytes(ckpt) > 0
    crc_reads.clear()
    verify(ckpt)
    assert sum(crc_reads) == first - _file_bytes(ckpt)  # no file read again
    victim = next((ckpt / "parts").rglob("C2.*.weight.f32"))
    data = bytearray(victim.read_bytes())
    data[3] ^= 0x10
    other = victim.with_name("replacement")
    other.write_bytes(bytes(data))
    other.replace(victim)  # another inode
    with pytest.raises(CheckpointError, match="C2.*checksum mismatch"):
        verify(ckpt)


def test_a_file_changed_within_the_second_is_never_taken_as_summed(tmp_path, crc_reads):
    """File times tick coarsely: an in-place change right after a verify can keep the
    file's times, so a file that recent is summed every time."""
    train(load_config("debug", ["--train.progress=false", "--train.steps=5"]), tmp_path, **QUIET)
    (ckpt,) = checkpoint_dirs(tmp_path / "checkpoints")
    fmt._SUMMED.clear()
    crc_reads.clear()
    verify(ckpt)
    assert fmt._SUMMED == {}  # written a moment ago: not remembered
    first = sum(crc_reads)
    crc_reads.clear()
    verify(ckpt)
    assert sum(crc_reads) == first  # read and summed again
    victim = next((ckpt / "parts").rglob("C2.*.weight.f32"))
    with open(victim, "r+b") as f:  # same size, same inode
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match="C2.*checksum mismatch"):
        verify(ckpt)


def test_finite_rows_pass_and_any_nan_or_inf_is_named(tmp_path):
    from recscale.checkpoint.stored_rows import check_finite

    big = torch.full((4, 8), 3e38)  # finite, but their sum overflows: the exact test
    check_finite(big, tmp_path, "rows")
    check_finite(torch.randn(1000, 16).to(torch.float64), tmp_path, "rows")
    check_finite(torch.zeros(0, 4), tmp_path, "rows")
    check_finite(torch.arange(5), tmp_path, "ids")  # integers are always finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.float16, torch.float64):
            x = torch.randn(257, 16).to(dtype)
            x[200, 3] = bad
            with pytest.raises(CheckpointError, match="rows holds NaN or infinite"):
                check_finite(x, tmp_path, "rows")
    both = torch.zeros(3, 3)
    both[0, 0], both[1, 1] = float("inf"), -float("inf")  # their sum is NaN: caught either way
    with pytest.raises(CheckpointError):
        check_finite(both, tmp_path, "rows")


def test_rows_read_into_memory_equal_the_mapped_rows_and_a_short_file_is_named(tmp_path):
    import numpy as np

    from recscale.checkpoint.format import read_array, read_rows

    data = np.random.default_rng(0).standard_normal((1000, 12)).astype(np.float32)
    (tmp_path / "a.f32").write_bytes(data.tobytes())
    mapped = read_array(tmp_path, "a.f32", np.float32, (1000, 12))
    for lo, hi in ((0, 1000), (0, 1), (999, 1000), (137, 601), (500, 500)):
        got = read_rows(tmp_path, "a.f32", np.float32, (1000, 12), lo, hi)
        assert got.shape == (hi - lo, 12) and np.array_equal(got, mapped[lo:hi])
    with pytest.raises(CheckpointError, match="bytes, its shape needs"):
        read_rows(tmp_path, "a.f32", np.float32, (1001, 12), 0, 10)


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 128, 1000])
def test_a_files_checksum_read_ahead_in_blocks_is_zlibs(tmp_path, monkeypatch, size):
    import os
    import zlib

    monkeypatch.setattr(fmt, "_CRC_BLOCK", 64)  # many blocks, read ahead on the thread
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert fmt._crc_of(tmp_path / "f", size) == zlib.crc32(data)
