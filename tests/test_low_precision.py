"""Low-precision rows (embedding.row_precision): rounding, lookups and updates against
fp32 references, training quality, checkpoints, planner bytes, config errors."""

import pytest
import torch
from helpers import assert_resume_identical

from recscale import native
from recscale.config import ConfigError, load_config
from recscale.embedding.low_precision import (
    LowPrecisionStorage,
    quantize_rows,
    round_to_grid,
    uniform_noise,
)
from recscale.embedding.optimizers import SparseAdam, SparseRowwiseAdagrad, SparseSGD
from recscale.embedding.storage import DeviceStorage
from recscale.planner.from_config import table_infos
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)


def test_noise_is_uniform_and_a_function_of_step_row_column():
    rows = torch.arange(4000)
    a, b = uniform_noise(rows, 16, 7), uniform_noise(rows, 16, 7)
    assert torch.equal(a, b) and not torch.equal(a, uniform_noise(rows, 16, 8))
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.01 and abs(float(a.var()) - 1 / 12) < 0.005
    # a row's noise does not depend on which other rows are in the batch
    assert torch.equal(uniform_noise(rows[7:9], 16, 7), a[7:9])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(precision):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(round_to_grid(x, precision, None), x.to(dtype))  # nearest
    # the two grid neighbours of x, from the bit patterns next to the nearest value
    h = x.to(dtype)
    bits = h.view(torch.int16)
    cands = torch.stack([h, (bits + 1).view(dtype), (bits - 1).view(dtype)]).float()
    below = torch.where(cands <= x, cands, -torch.inf).amax(0)
    above = torch.where(cands >= x, cands, torch.inf).amin(0)
    n = 4000
    r = round_to_grid(x.repeat(n, 1), precision, uniform_noise(torch.arange(n), 64, 1)).float()
    assert ((r == below) | (r == above)).all()
    # unbiased: the mean of many roundings is x to well within a grid step
    assert ((r.mean(0) - x).abs() < 0.05 * (above - below)).all()


def test_int8_rows_within_a_grid_step_and_unbiased():
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    q, qp = quantize_rows(x, None)
    back = q.float() * qp[:, :1] + qp[:, 1:]
    assert ((back - x).abs() <= 0.5 * qp[:, :1] + 1e-6).all()
    n = 2000
    xs = x.repeat(n, 1)
    q, qp = quantize_rows(xs, uniform_noise(torch.arange(xs.shape[0]), 16, 3))
    back = (q.float() * qp[:, :1] + qp[:, 1:]).view(n, 32, 16)
    assert ((back - x).abs() <= qp[:32, :1] * 1.001).all()
    assert ((back.mean(0) - x).abs() < 0.05 * qp[:32, :1]).all()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_lookup_equals_embedding_bag_of_the_stored_rows(precision):
    s = LowPrecisionStorage(50, 8, SparseSGD(0.1), precision)
    s.write_rows(torch.arange(50), torch.randn(50, 8))
    ref = torch.nn.EmbeddingBag(50, 8, mode="sum")
    ref.weight.data = s.read_rows(torch.arange(50))  # the rows as stored, decoded
    rows = torch.tensor([3, 7, 7, 49, 0, 12])
    offsets = torch.tensor([0, 2, 2, 5, 6])
    psw = torch.rand(6)
    got = s.lookup(rows, offsets, psw)
    want = ref(rows, offsets[:-1], per_sample_weights=psw)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize(
    "make_opt",
    [lambda: SparseSGD(0.5), lambda: SparseRowwiseAdagrad(0.1), lambda: SparseAdam(0.01)],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
def test_update_matches_the_fp32_optimizer_within_a_grid_step(precision, make_opt):
    """The low-precision step = the fp32 step on the decoded rows, stored within one grid
    step; the optimizer state (fp32) equals the reference exactly; other rows unchanged."""
    g = torch.Generator().manual_seed(2)
    lp = LowPrecisionStorage(40, 16, make_opt(), precision)
    lp.write_rows(torch.arange(40), torch.randn(40, 16, generator=g) * 0.1)
    ref = DeviceStorage(40, 16, make_opt(), kernel="torch")
    ref.write_rows(torch.arange(40), lp.read_rows(torch.arange(40)))
    before = lp.read_rows(torch.arange(40))
    for step in range(3):
        rows = torch.tensor([1, 5, 9, 30])
        grad = torch.randn(4, 16, generator=g)
        lp.apply_gradients(rows, grad)
        ref.apply_gradients(rows, grad)
        exact = ref.read_rows(rows)
        got = lp.read_rows(rows)
        if precision == "int8":
            tol = (exact.amax(1) - exact.amin(1)).unsqueeze(1) / 255 * 1.01 + 1e-7
        else:
            tol = exact.abs() * (2.0 ** -(10 if precision == "fp16" else 7)) * 1.01 + 1e-7
        assert ((got - exact).abs() <= tol).all(), step
        ref.write_rows(rows, got)  # the reference continues from the stored rows
        for name, t in lp.read_state(rows).items():
            if name in ref.optimizer_state():
                torch.testing.assert_close(t, ref.read_state(rows)[name], rtol=0, atol=0)
    untouched = torch.tensor([0, 2, 39])
    assert torch.equal(lp.read_rows(untouched), before[untouched])


def test_fp16_rows_half_the_bytes_and_the_planner_counts_them():
    cfg = load_config("debug")
    lp = LowPrecisionStorage(1000, 16, SparseRowwiseAdagrad(0.1), "fp16")
    assert lp.weight.element_size() * lp.weight.numel() == 1000 * 16 * 2
    for p, ratio in (("fp16", 0.5), ("bf16", 0.5), ("int8", 0.25)):
        low = load_config("debug", [f"--embedding.row_precision={p}"])
        a, b = table_infos(cfg), table_infos(low)
        # the rows alone: bytes minus the fp32 optimizer state (4 bytes a row)
        rows_fp32 = sum(t.bytes - 4 * t.rows for t in a)
        rows_low = sum(t.bytes - 4 * t.rows - (8 * t.rows if p == "int8" else 0) for t in b)
        assert rows_low == pytest.approx(ratio * rows_fp32)


def test_config_refuses_bad_values_naming_the_key():
    with pytest.raises(ConfigError, match="embedding.row_precision"):
        load_config("debug", ["--embedding.row_precision=int4"])
    with pytest.raises(ConfigError, match="embedding.row_precision"):
        load_config("debug", ["--embedding.row_precision=fp16", "--embedding.placement=ssd"])


@pytest.fixture(scope="module")
def fp32_auc():
    cfg = load_config("debug", ["--train.progress=false"])
    return train(cfg, None, **QUIET)["auc"]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_debug_run_trains_within_001_auc_of_fp32(precision, fp32_auc):
    cfg = load_config("debug", ["--train.progress=false", f"--embedding.row_precision={precision}"])
    m = train(cfg, None, **QUIET)
    assert m["auc"] >= fp32_auc - 0.01, (m["auc"], fp32_auc)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_resume_is_bitwise_identical_with_low_precision_rows(tmp_path, precision):
    """Incremental checkpoints (fp32 on disk) restore the stored rows exactly, and the
    rounding noise is a function of the step: resumed == uninterrupted."""
    assert_resume_identical(tmp_path, [f"--embedding.row_precision={precision}"])


needs_native = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels: {native.status()}"
)


def _rows_with_every_magnitude(n: int, dim: int, seed: int) -> torch.Tensor:
    """Values from fp16's subnormals (< 6e-5) to past its largest finite (65504)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 18, (n, dim), generator=g).float())
    return torch.randn(n, dim, generator=g) * scale


@needs_native
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_native_update_rounds_as_the_reference_bit_for_bit(precision):
    """SGD with lr = 0.5 and one id per row: both paths compute the same fp32 row, so the
    stored 16-bit patterns must be identical - the native rounding rule and noise are
    the reference's. And the rounding is stochastic: some values end up away from the
    nearest neighbour."""
    n, dim = 64, 16
    paths = [
        LowPrecisionStorage(n, dim, SparseSGD(0.5), precision, kernel=k)
        for k in ("native", "torch")
    ]
    assert paths[0].backward_kernel() == "native" and paths[1].backward_kernel() == "torch"
    init = _rows_with_every_magnitude(n, dim, 0)
    for s in paths:
        s.write_rows(torch.arange(n), init)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:48]
    segments = torch.tensor([0, 20, 48])  # two features' ids
    bag_of_id = torch.arange(48)
    off_nearest = 0
    for step in range(3):
        grad = _rows_with_every_magnitude(48, dim, 10 + step)
        expected = paths[1].read_rows(rows) - 0.5 * grad
        for s in paths:
            s.apply_pooled_gradients(rows, segments, bag_of_id, None, grad)
        assert torch.equal(paths[0].weight.view(torch.int16), paths[1].weight.view(torch.int16))
        nearest = round_to_grid(expected, precision, None).float()
        off_nearest += int((paths[0].read_rows(rows) != nearest).sum())
    assert off_nearest > 0


@needs_native
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "make_opt",
    [lambda: SparseRowwiseAdagrad(0.1), lambda: SparseAdam(0.01)],
    ids=["rowwise_adagrad", "adam"],
)
def test_native_update_with_duplicates_matches_the_reference(precision, make_opt):
    """Repeated ids, weighted: merged sums and optimizer arithmetic may differ in the last
    fp32 bit between the paths, so the stored rows agree within one grid step, the
    fp32 optimizer state to float rounding."""
    n, dim = 30, 16
    paths = [
        LowPrecisionStorage(n, dim, make_opt(), precision, kernel=k) for k in ("native", "torch")
    ]
    init = torch.randn(n, dim, generator=torch.Generator().manual_seed(3)) * 0.1
    for s in paths:
        s.write_rows(torch.arange(n), init)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        rows = torch.cat(
            [torch.randint(0, 15, (40,), generator=g), torch.randint(15, 30, (40,), generator=g)]
        )
        segments = torch.tensor([0, 40, 80])
        bag_of_id = torch.randint(0, 10, (80,), generator=g)
        psw = torch.rand(80, generator=g)
        grad = torch.randn(10, dim, generator=g)
        for s in paths:
            s.apply_pooled_gradients(rows, segments, bag_of_id, psw, grad)
    got, want = (s.read_rows(torch.arange(n)) for s in paths)
    step = want.abs() * 2.0 ** -(10 if precision == "fp16" else 7)
    assert ((got - want).abs() <= 2 * step + 1e-6).all()
    for name, t in paths[1].read_state(torch.arange(n)).items():
        torch.testing.assert_close(paths[0].read_state(torch.arange(n))[name], t)


@needs_native
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_native_lookup_of_16_bit_rows_equals_embedding_bag(precision):
    from recscale.embedding.lookup import native_pooled_lookup

    s = LowPrecisionStorage(50, 16, SparseSGD(0.1), precision)
    s.write_rows(torch.arange(50), torch.randn(50, 16))
    table = s.native_lookup_table()
    assert table is not None and table.dtype == s.weight.dtype
    ref = torch.nn.EmbeddingBag(50, 16, mode="sum")
    ref.weight.data = s.read_rows(torch.arange(50))
    # 2 features (tables of 20 and 30 rows) x 3 samples, feature-major jagged
    values = torch.tensor([3, 7, 7, 19, 0, 12, 29, 1, 5])
    offsets = torch.tensor([0, 2, 2, 4, 5, 8, 9])
    psw = torch.rand(9)
    got = native_pooled_lookup(
        table, values, offsets, 3, torch.tensor([0, 20]), torch.tensor([20, 30]), psw
    )
    pooled, rows, _ = got
    assert torch.equal(rows, values + torch.tensor([0] * 4 + [20] * 5))
    want = ref(rows, offsets[:-1], per_sample_weights=psw)  # bag f*B + b, feature-major
    torch.testing.assert_close(pooled.view(3, 2, 16), want.view(2, 3, 16).transpose(0, 1))
