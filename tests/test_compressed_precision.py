"""Compressed tables whose gathered factors are stored at ``embedding.row_precision``
(fp16 | bf16 | int8): the lookup against a dense reference built from the decoded
factors, the update against the fp32 step within one grid step, the bytes the planner
counts against what the storage holds, training quality and bit-exact resume."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_resume_identical

from recscale.config import load_config
from recscale.embedding.compressed import MixedDimStorage, QRStorage, TTStorage
from recscale.embedding.compression_shapes import tt_shape
from recscale.embedding.low_precision import LowPrecisionStorage
from recscale.embedding.optimizers import SparseRowwiseAdagrad, SparseSGD
from recscale.embedding.sizing import compressed_table_bytes, table_memory
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)
N, D = 1000, 16
PRECISIONS = ["fp16", "bf16", "int8"]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8}


def _make(method, opt, precision):
    return {
        "qr": lambda: QRStorage(N, D, 16, "mult", opt, precision=precision),
        "mixed_dim": lambda: MixedDimStorage(N, D, 2, opt, precision=precision),
        "tt": lambda: TTStorage(N, D, 3, opt, precision=precision),
    }[method]()


def _decoded(s):
    """Every factor as fp32, decoded from what is stored."""
    return {k: f.read_rows(torch.arange(f.num_rows)) for k, f in s.factors.items()}


def _rows(method, f, rows):
    """Virtual rows from decoded factors with plain torch."""
    if method == "qr":
        return f["q"][rows // 16] * f["r"][rows % 16]
    if method == "mixed_dim":
        return f["w"][rows] @ f["proj"]
    (_, n2, n3), (d1, d2, d3) = tt_shape(N, D)
    out = []
    for x in rows.tolist():
        a = f["g1"][x // (n2 * n3)].view(d1, 3)
        b = f["g2"][(x // n3) % n2].view(3, d2 * 3)
        c = f["g3"][x % n3].view(3, d3)
        out.append(((a @ b).view(d1 * d2, 3) @ c).reshape(-1))
    return torch.stack(out)


def _grid_tol(exact, precision, stored):
    """One grid step of ``precision`` around ``exact`` (int8: the row's scale)."""
    if precision == "int8":
        return stored.qparams[:, :1] * 1.01 + 1e-7
    return exact.abs() * (2.0 ** -(10 if precision == "fp16" else 7)) * 1.01 + 1e-7


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("method", ["qr", "mixed_dim", "tt"])
def test_lookup_and_update_of_low_precision_factors(method, precision):
    s = _make(method, SparseSGD(1.0), precision)
    s.init_factors(seed=5, feature=1)
    for name, f in s.factors.items():
        want = torch.float32 if name == "proj" else _DTYPES[precision]
        assert f.weight.dtype == want, name
        assert isinstance(f, LowPrecisionStorage) == (name != "proj")
    params = {k: torch.nn.Parameter(v) for k, v in _decoded(s).items()}
    rows = torch.tensor([0, 17, 17, 999, 500, 3, 64, 640])
    offsets = torch.tensor([0, 3, 3, 6, 8])
    ref = F.embedding_bag(
        rows, _rows(method, params, torch.arange(N)), offsets, mode="sum", include_last_offset=True
    )
    torch.testing.assert_close(s.lookup(rows, offsets, None), ref)
    # one SGD step (lr 1): each factor = its decoded value - autograd's gradient, stored
    # within a grid step; factor rows no id of the batch uses keep their codes
    g = torch.randn(4, D, generator=torch.Generator().manual_seed(0))
    (ref * g).sum().backward()
    before = {k: f.weight.clone() for k, f in s.factors.items()}
    bag = torch.repeat_interleave(torch.arange(4), offsets[1:] - offsets[:-1])
    s.apply_pooled_gradients(rows, torch.tensor([0, 8]), bag, None, g)
    after = _decoded(s)
    for k, f in s.factors.items():
        exact = params[k].detach() - params[k].grad
        tol = exact.abs() * 1e-6 + 1e-7 if k == "proj" else _grid_tol(exact, precision, f)
        assert ((after[k] - exact).abs() <= tol).all(), k
        untouched = params[k].grad.abs().sum(1) == 0
        assert untouched.any() or k == "proj"
        assert torch.equal(f.weight[untouched], before[k][untouched]), k


@pytest.mark.parametrize("precision", ["fp32", *PRECISIONS])
@pytest.mark.parametrize("method", ["qr", "mixed_dim", "tt"])
def test_planner_counts_the_bytes_the_storage_holds(method, precision):
    cfg = SimpleNamespace(
        qr_buckets=16,
        qr_op="mult",
        tt_rank=3,
        optimizer="rowwise_adagrad",
        row_precision=precision,
        hot_fraction=0.0,
    )
    s = _make(method, SparseRowwiseAdagrad(0.1), "fp32" if precision == "fp32" else precision)
    total, weights = compressed_table_bytes(method, N, D, 2, cfg)
    assert weights == s.stored_bytes()
    state_rows = sum(f.num_rows for f in s.factors.values())  # one fp32 value a factor row
    assert total == weights + 4 * state_rows


def test_mixed_dim_with_16_bit_factors_is_32x_smaller_by_weights():
    """The default model, every table compressed by the power rule at alpha 2: dim-1
    rows; fp16 halves them again. Optimizer state (fp32, a value a row) is counted apart."""
    over = [
        "--embedding.compression=mixed_dim",
        "--embedding.md_alpha=2",
        "--embedding.compress_min_rows=0",
    ]
    fp32 = table_memory(load_config("default", over))
    fp16 = table_memory(load_config("default", [*over, "--embedding.row_precision=fp16"]))
    assert fp32["plain_weights"] / fp32["weights"] >= 15.9  # 2 small tables stay plain
    assert fp16["plain_weights"] / fp16["weights"] >= 31.9
    # with the state: rows (2 bytes) + state (4) against 16 * 4 + 4
    assert fp16["plain_total"] / fp16["total"] == pytest.approx(68 / 6, rel=0.01)
    assert math.isclose(fp16["plain_weights"], fp32["plain_weights"])


@pytest.fixture(scope="module")
def plain_auc():
    return train(load_config("debug", ["--train.progress=false"]), None, **QUIET)["auc"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_debug_run_with_low_precision_factors_within_001_auc_of_plain(precision, plain_auc):
    over = [
        "--train.progress=false",
        "--embedding.compression=mixed_dim",
        f"--embedding.row_precision={precision}",
    ]
    m = train(load_config("debug", over), None, **QUIET)
    assert m["auc"] >= plain_auc - 0.01, (m["auc"], plain_auc)


def test_resume_is_bitwise_identical_with_bf16_factors(tmp_path):
    assert_resume_identical(
        tmp_path,
        [
            "--embedding.compression=qr",
            "--embedding.row_precision=bf16",
            "--embedding.table_compression=C1=none,C5=tt,C3=mixed_dim",
        ],
    )
