"""``embedding.row_precision=auto`` (the default): Split-SGD-BF16 rows where a bf16 run
on the CPU gains from them (plain tables in memory, the native kernels), fp32 rows
everywhere else; a run records what it chose in its config.toml."""

from __future__ import annotations

import pytest
import torch

from recscale import native
from recscale.config import load_config
from recscale.embedding.low_precision import LowPrecisionStorage, device_rows
from recscale.embedding.optimizers import SparseSGD
from recscale.embedding.sizing import bytes_per_value, compression_summary
from recscale.embedding.storage import DeviceStorage
from recscale.train.precision import resolve_row_precision
from recscale.train.run import train

CPU = torch.device("cpu")
QUIET = dict(echo=lambda *_: None)
needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels not built")


# debug's tables at dim 32: fp32 rows of two cache lines, bf16 halves of one
WIDE = ["--model.embedding_dim=32", "--model.bottom_mlp=[32,32]"]


def _resolved(*overrides: str, device: torch.device = CPU) -> str:
    cfg = load_config("debug", [*WIDE, *overrides])
    assert cfg.embedding.row_precision == "auto"
    got = resolve_row_precision(cfg, device)
    assert cfg.embedding.row_precision == got  # made concrete in the config itself
    return got


@needs_native
def test_bf16_on_the_cpu_takes_split_rows():
    assert _resolved("--train.precision=bf16") == "split_bf16"
    assert _resolved("--train.precision=bf16", "--model.kernels=native") == "split_bf16"
    assert (
        _resolved(
            "--train.precision=bf16", "--model.embedding_dim=24", "--model.bottom_mlp=[32,24]"
        )
        == "split_bf16"
    )
    # mixed widths: the wide tables hold most of the values a sample reads
    dims = ",".join(["32"] * 20 + ["8"] * 6)
    assert _resolved(
        "--train.precision=bf16", f"--model.table_dims=[{dims}]", "--model.interaction=cat"
    ) == ("split_bf16")


@pytest.mark.parametrize(
    "overrides",
    [
        ["--train.precision=fp32"],
        ["--train.precision=tf32"],
        ["--train.precision=bf16", "--embedding.placement=ssd"],
        ["--train.precision=bf16", "--embedding.compression=qr", "--embedding.compress_min_rows=1"],
        ["--train.precision=bf16", "--embedding.table_compression=C3=tt"],
        ["--train.precision=bf16", "--model.kernels=torch"],
        ["--train.precision=bf16", "--model.kernels=numba"],
        ["--train.precision=bf16", "--model.kernels=triton"],  # no error: fp32 rows
        # the native lookup needs a dim that is a multiple of 8: split rows would pool in torch
        ["--train.precision=bf16", "--model.embedding_dim=36", "--model.bottom_mlp=[16,36]"],
        # 64-byte fp32 rows (A's): one cache line either way, the split update dearer
        ["--train.precision=bf16", "--model.embedding_dim=16", "--model.bottom_mlp=[16,16]"],
        # mixed widths: the wide tables hold under half the values a sample reads
        [
            "--train.precision=bf16",
            f"--model.table_dims=[{','.join(['32'] * 4 + ['8'] * 22)}]",
            "--model.interaction=cat",
        ],
    ],
    ids=[
        *("fp32", "tf32", "ssd-tier", "qr", "one-table-tt", "torch", "numba", "triton"),
        *("dim-36", "dim-16", "mostly-narrow"),
    ],
)
def test_elsewhere_auto_is_fp32(overrides):
    assert _resolved(*overrides) == "fp32"


def test_a_gpu_keeps_fp32_rows_and_a_named_precision_stays():
    assert _resolved("--train.precision=bf16", device=torch.device("cuda")) == "fp32"
    for p in ("fp32", "fp16", "split_bf16"):
        cfg = load_config("debug", ["--train.precision=bf16", f"--embedding.row_precision={p}"])
        cfg.model.embedding_dim = 32
        assert resolve_row_precision(cfg, CPU) == p
    cfg = load_config("debug", ["--embedding.row_precision=split_bf16"])  # fp32 run
    assert resolve_row_precision(cfg, CPU) == "split_bf16"


def test_unresolved_auto_is_fp32_rows_outside_a_run():
    """A model built from a config no run resolved (the library, a test) keeps fp32 rows;
    sizing counts four bytes a value, what both of auto's choices store."""
    storage = device_rows(10, 8, SparseSGD(0.1), "auto")
    assert type(storage) is DeviceStorage and storage.weight.dtype == torch.float32
    assert bytes_per_value("auto") == bytes_per_value("fp32") == bytes_per_value("split_bf16")
    cfg = load_config("debug")
    assert compression_summary(cfg) == []  # nothing to say of fp32 (or auto) rows
    cfg.embedding.row_precision = "split_bf16"
    (line,) = compression_summary(cfg)
    assert "split_bf16" in line and "Split-SGD-BF16" in line


@needs_native
def test_a_bf16_run_trains_as_with_split_rows_named_and_records_them(tmp_path):
    base = ["--train.progress=false", "--train.precision=bf16", "--train.steps=60", *WIDE]
    auto = train(load_config("debug", base), tmp_path / "auto", **QUIET)
    split = train(
        load_config("debug", [*base, "--embedding.row_precision=split_bf16"]), None, **QUIET
    )
    fp32 = train(load_config("debug", [*base, "--embedding.row_precision=fp32"]), None, **QUIET)
    assert auto["logloss"] == split["logloss"] and auto["auc"] == split["auc"]
    assert auto["logloss"] != fp32["logloss"]  # the lookup reads truncated values
    assert 'row_precision = "split_bf16"' in (tmp_path / "auto/config.toml").read_text()
    # the run's config.toml rebuilds the same rows: eval's model, a resume
    cfg = load_config(str(tmp_path / "auto/config.toml"))
    assert resolve_row_precision(cfg, CPU) == "split_bf16"


def test_an_fp32_run_records_fp32_rows(tmp_path):
    train(load_config("debug", ["--train.progress=false", "--train.steps=5"]), tmp_path, **QUIET)
    assert 'row_precision = "fp32"' in (tmp_path / "config.toml").read_text()


@needs_native
def test_a_split_model_is_built_with_split_storages():
    from recscale.models.dlrm import build_model

    cfg = load_config("debug", ["--train.precision=bf16", *WIDE])
    resolve_row_precision(cfg, CPU)
    model = build_model(cfg.model, cfg.embedding)
    storages = [m for m in model.modules() if isinstance(m, DeviceStorage)]
    assert storages and all(
        isinstance(s, LowPrecisionStorage) and s.low_halves() is not None for s in storages
    )


@needs_native
def test_the_benchmark_runs_and_names_the_rows_a_run_would():
    """`recscale bench throughput` sets its process up as training does: auto resolved."""
    from recscale.bench.throughput import format_report, run_throughput

    cfg = load_config("debug", ["--train.precision=bf16", *WIDE])
    r = run_throughput(cfg, steps=2, warmup=1, echo=lambda _: None)
    assert r["row_precision"] == "split_bf16" and "split_bf16 rows" in format_report("d", r)
    r = run_throughput(load_config("debug", WIDE), steps=2, warmup=1, echo=lambda _: None)
    assert r["row_precision"] == "fp32" and " rows)" not in format_report("d", r)
