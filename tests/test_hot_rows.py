"""Hot rows of compressed tables (``embedding.hot_fraction``): exact rows for the most
frequent ids, the rest from the factors - lookups, updates, selection, bytes, training
quality and resume, against references that have no hot rows."""

import numpy as np
import pytest
import torch
from helpers import assert_resume_identical

from recscale.config import ConfigError, load_config
from recscale.embedding.compressed import MixedDimStorage, QRStorage, TTStorage
from recscale.embedding.compression_shapes import hot_count
from recscale.embedding.optimizers import SparseRowwiseAdagrad, SparseSGD
from recscale.embedding.sizing import compressed_table_bytes
from recscale.embedding.storage import DeviceStorage
from recscale.train.data_source import train_batches
from recscale.train.hot_rows import sample_id_counts, top_ids
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)
N, D = 1000, 16
MAKE = {
    "qr": lambda opt, k: QRStorage(N, D, 16, "mult", opt, hot_rows=k),
    "mixed_dim": lambda opt, k: MixedDimStorage(N, D, 2, opt, hot_rows=k),
    "tt": lambda opt, k: TTStorage(N, D, 3, opt, hot_rows=k),
}


@pytest.mark.parametrize("method", list(MAKE))
def test_hot_rows_start_from_their_rows_and_train_as_plain_rows(method):
    """After set_hot_ids every virtual row reads as before; an update moves a hot row
    as a plain row's (a DeviceStorage reference) and leaves the factors to the cold
    rows' gradients (a twin without hot rows given only those)."""
    hot_ids = torch.tensor([999, 5, 17])  # any order: kept sorted
    s, twin = MAKE[method](SparseSGD(0.5), 4), MAKE[method](SparseSGD(0.5), 0)
    s.init_factors(seed=2, feature=3)
    twin.init_factors(seed=2, feature=3)
    everything = torch.arange(N)
    before = s.read_rows(everything)
    s.set_hot_ids(hot_ids)
    # (equal up to the GEMM's blocking: a matmul of 3 rows rounds unlike one of 1000)
    torch.testing.assert_close(s.read_rows(everything), before, rtol=1e-6, atol=1e-9)
    assert s.hot_ids.tolist() == [5, 17, 999, N]  # the free slot holds an id no row has
    plain = DeviceStorage(3, D, SparseSGD(0.5), kernel="torch")
    plain.write_rows(torch.arange(3), s.read_rows(torch.tensor([5, 17, 999])))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        rows = torch.tensor([5, 6, 17, 400])
        grad = torch.randn(4, D, generator=g)
        s.apply_gradients(rows, grad)
        twin.apply_gradients(rows[[1, 3]], grad[[1, 3]])
        plain.apply_gradients(torch.tensor([0, 1]), grad[[0, 2]])
    torch.testing.assert_close(
        s.read_rows(torch.tensor([5, 17, 999])), plain.read_rows(torch.arange(3)), rtol=0, atol=0
    )
    cold = torch.tensor([i for i in range(N) if i not in (5, 17, 999)])
    torch.testing.assert_close(s.read_rows(cold), twin.read_rows(cold), rtol=0, atol=0)
    for name, f in s.factors.items():
        assert torch.equal(f.weight, twin.factors[name].weight), name


def test_bad_hot_ids_are_refused():
    s = MAKE["tt"](SparseSGD(0.1), 2)
    for ids in ([1, 2, 3], [N], [-1]):
        with pytest.raises(ValueError, match="hot ids"):
            s.set_hot_ids(torch.tensor(ids))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("method", list(MAKE))
def test_planner_counts_hot_rows_as_the_storage_holds_them(method, precision):
    from types import SimpleNamespace

    k = hot_count(N, 0.01)
    cfg = SimpleNamespace(
        qr_buckets=16,
        qr_op="mult",
        tt_rank=3,
        optimizer="rowwise_adagrad",
        row_precision=precision,
        hot_fraction=0.01,
    )
    make = {"qr": QRStorage, "mixed_dim": MixedDimStorage, "tt": TTStorage}[method]
    knob = {"qr": (16, "mult"), "mixed_dim": (2,), "tt": (3,)}[method]
    s = make(N, D, *knob, SparseRowwiseAdagrad(0.1), precision=precision, hot_rows=k)
    total, weights = compressed_table_bytes(method, N, D, 2, cfg)
    assert k == 10 and weights == s.stored_bytes()
    rows = sum(f.num_rows for f in s.factors.values()) + k
    assert total == weights + 4 * rows


def test_the_most_frequent_ids_of_the_first_samples_are_chosen():
    ids, counts = np.array([3, 4, 7, 9]), np.array([2, 5, 2, 1])
    assert top_ids(ids, counts, 3).tolist() == [4, 3, 7]  # ties: the smaller id
    cfg = load_config("debug", ["--data.max_ids_per_feature=3"])
    got = sample_id_counts(cfg, 3 * cfg.train.batch_size - 5, [0, 4])
    stream = train_batches(cfg, 0)
    batches = [next(stream) for _ in range(3)]  # whole batches: 3 x batch >= samples
    for f in (0, 4):
        brute: dict[int, int] = {}
        for b in batches:
            for i in b.feature_values(f).tolist():
                brute[i] = brute.get(i, 0) + 1
        assert dict(zip(got[f][0].tolist(), got[f][1].tolist())) == brute


def test_hot_fraction_needs_a_compressed_table_and_a_sane_value():
    for over, key in (
        (["--embedding.hot_fraction=0.1"], "embedding.hot_fraction"),
        (["--embedding.compression=tt", "--embedding.hot_fraction=1.0"], "embedding.hot_fraction"),
        (
            ["--embedding.compression=tt", "--embedding.hot_sample_rows=0"],
            "embedding.hot_sample_rows",
        ),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("debug", over)


def test_debug_run_with_hot_rows_trains_and_reports_them():
    lines = []
    over = [
        "--train.progress=false",
        # hot rows lead by 0.009-0.010 AUC at 100 steps over seeds 0-2 (0.004-0.009 at 150)
        "--train.steps=100",
        "--embedding.compression=tt",
        "--embedding.tt_rank=2",
        "--embedding.hot_fraction=0.02",
    ]
    hot = train(load_config("debug", over), None, echo=lines.append)
    cold = train(load_config("debug", over[:-1]), None, **QUIET)
    assert any("hot rows:" in ln and "kept exact" in ln for ln in lines), lines
    assert hot["auc"] > cold["auc"], (hot["auc"], cold["auc"])  # rank 2 alone loses


def test_resume_is_bitwise_identical_with_hot_rows(tmp_path):
    assert_resume_identical(
        tmp_path, ["--embedding.compression=tt", "--embedding.hot_fraction=0.02"]
    )
