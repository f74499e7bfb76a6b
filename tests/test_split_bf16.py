"""Split-SGD-BF16 rows (``embedding.row_precision=split_bf16``, Kalamkar et al. SC20):
the lookup reads the bf16 high halves, the update is exactly fp32's (against a plain
fp32 DeviceStorage, bit for bit), checkpoints store the exact fp32 values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_resume_identical

from recscale import native
from recscale.config import load_config
from recscale.embedding.low_precision import LowPrecisionStorage, join_fp32, split_fp32
from recscale.embedding.optimizers import SparseAdam, SparseRowwiseAdagrad, SparseSGD
from recscale.embedding.sizing import row_bytes
from recscale.embedding.storage import DeviceStorage
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)


def test_split_and_join_are_exact_for_every_bit_pattern():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    high, low = split_fp32(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_fp32(high, low).view(torch.int32), x.view(torch.int32))
    # the high half is the value truncated toward zero to bf16
    assert torch.equal(high.float().abs() <= x.abs(), torch.ones_like(x, dtype=torch.bool))
    # rows of a table, and a transposed (strided) block: the halves of each value's bits
    for m in (x[:4000].view(250, 16), x[:4000].view(16, 250).t()):
        hi, lo = split_fp32(m)
        b = m.contiguous().view(torch.int32)
        assert hi.shape == lo.shape == m.shape
        assert torch.equal(hi.view(torch.int16).to(torch.int32), b >> 16)
        assert torch.equal(lo.to(torch.int32) & 0xFFFF, b & 0xFFFF)


@pytest.mark.parametrize(
    "make_opt",
    [lambda: SparseSGD(0.5), lambda: SparseRowwiseAdagrad(0.1), lambda: SparseAdam(0.01)],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
def test_the_update_is_exactly_the_fp32_optimizers(make_opt):
    g = torch.Generator().manual_seed(2)
    split = LowPrecisionStorage(40, 16, make_opt(), "split_bf16")
    ref = DeviceStorage(40, 16, make_opt(), kernel="torch")
    init = torch.randn(40, 16, generator=g) * 0.1
    split.write_rows(torch.arange(40), init)
    ref.write_rows(torch.arange(40), init)
    assert torch.equal(split.read_rows(torch.arange(40)), init)
    for _ in range(5):
        rows = torch.tensor([1, 5, 9, 30, 5])
        grad = torch.randn(5, 16, generator=g)
        for st in (split, ref):
            u, inv = torch.unique(rows, return_inverse=True)
            merged = torch.zeros(len(u), 16).index_add_(0, inv, grad)
            st.apply_gradients(u, merged)
    every = torch.arange(40)
    assert torch.equal(split.read_rows(every), ref.read_rows(every))
    for name, t in split.read_state(every).items():
        assert torch.equal(t, ref.read_state(every)[name]), name


def test_the_lookup_pools_the_high_halves():
    g = torch.Generator().manual_seed(3)
    st = LowPrecisionStorage(50, 16, SparseSGD(0.1), "split_bf16", kernel="torch")
    st.write_rows(torch.arange(50), torch.randn(50, 16, generator=g))
    rows = torch.randint(0, 50, (30,), generator=g)
    offsets = torch.tensor([0, 4, 4, 11, 30])
    truncated = st.weight.float()  # the bf16 high halves, as fp32
    want = F.embedding_bag(rows, truncated, offsets, mode="sum", include_last_offset=True)
    assert torch.equal(st.lookup(rows, offsets, None), want)
    assert st.weight.element_size() == 2  # what the lookup reads: half of fp32's bytes


@pytest.mark.skipif(native.library() is None, reason="native kernels not built")
def test_the_native_lookup_reads_the_same_high_halves():
    st = LowPrecisionStorage(50, 16, SparseSGD(0.1), "split_bf16", kernel="native")
    st.write_rows(torch.arange(50), torch.randn(50, 16))
    assert st.native_lookup_table() is st.weight  # bf16 rows: the native row format 2
    assert st.backward_kernel() == "native"  # RS_SPLIT: both halves, exact


def test_the_planner_counts_four_bytes_a_value():
    cfg = load_config("debug", ["--embedding.row_precision=split_bf16"])
    plain = load_config("debug")
    assert row_bytes(cfg.embedding, 16) == row_bytes(plain.embedding, 16)


def test_training_matches_fp32_closely_and_resumes_bitwise(tmp_path):
    fp32 = train(load_config("debug", ["--train.progress=false"]), None, **QUIET)
    split = train(
        load_config("debug", ["--train.progress=false", "--embedding.row_precision=split_bf16"]),
        None,
        **QUIET,
    )
    assert abs(split["auc"] - fp32["auc"]) <= 0.005, (split["auc"], fp32["auc"])
    assert_resume_identical(tmp_path, ["--embedding.row_precision=split_bf16"])


@pytest.mark.skipif(native.library() is None, reason="native kernels not built")
@pytest.mark.parametrize(
    "make_opt",
    [lambda: SparseSGD(0.5), lambda: SparseRowwiseAdagrad(0.1), lambda: SparseAdam(0.01)],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
# the kernel takes 16 values at a time and a last 8 alone: dims with and without that tail
@pytest.mark.parametrize("d", [8, 24, 32, 128])
def test_the_native_split_update_is_the_fp32_update_bit_for_bit(make_opt, d):
    """The fused native update on split rows (RS_SPLIT) against fp32 rows updated by the
    native fp32 kernel, from the same pooled gradients, duplicates included."""
    g = torch.Generator().manual_seed(5)
    n, bags = 64, 48
    split = LowPrecisionStorage(n, d, make_opt(), "split_bf16", kernel="native")
    ref = DeviceStorage(n, d, make_opt(), kernel="native")
    init = torch.randn(n, d, generator=g) * 0.1
    split.write_rows(torch.arange(n), init)
    ref.write_rows(torch.arange(n), init)
    assert split.backward_kernel() == "native"
    for _ in range(4):
        rows = torch.randint(0, 12, (bags,), generator=g)  # hot rows repeat
        bag_of_id = torch.arange(bags)
        segments = torch.tensor([0, bags])
        grad = torch.randn(bags, d, generator=g)
        for st in (split, ref):
            st.apply_pooled_gradients(rows, segments, bag_of_id, None, grad)
    every = torch.arange(n)
    assert torch.equal(split.read_rows(every), ref.read_rows(every))
    for name, t in split.read_state(every).items():
        assert torch.equal(t, ref.read_state(every)[name]), name


@pytest.mark.parametrize(
    "tier, extra, tier_extra",
    [
        # a cold cache: misses read from the file, rows evicted and written back
        ("ssd", [], ["--embedding.cache_prefetch=thread", "--embedding.warm_start=false"]),
        ("ssd", ["--data.max_ids_per_feature=3", "--embedding.optimizer=adam"], []),  # bags
        ("host", [], []),
    ],
)
def test_a_tier_trains_split_rows_as_memory_does(tmp_path, tier, extra, tier_extra):
    """On the host/ssd tiers a split_bf16 table is kept as its exact fp32 row (the two
    halves' bits) and pooled by its bf16 high halves: the run equals split_bf16 in
    memory - loss, AUC, every row and state - not fp32's (the forward differs)."""
    over = [
        "--train.steps=60",
        "--train.progress=false",
        "--embedding.row_precision=split_bf16",
        *extra,
    ]
    runs = {}
    for name, more in (
        ("memory", []),
        (
            tier,
            [
                f"--embedding.placement={tier}",
                "--embedding.cache_bytes=300000",  # a fraction of the 7,485 rows
                f"--embedding.ssd_dir={tmp_path / 'ssd'}",
                *tier_extra,
            ],
        ),
        ("fp32", ["--embedding.row_precision=fp32"]),
    ):
        run_dir = tmp_path / name
        runs[name] = train(load_config("debug", over + more), run_dir, **QUIET)
    mem, tiered, fp32 = runs["memory"], runs[tier], runs["fp32"]
    assert tiered["auc"] == mem["auc"] and tiered["logloss"] == mem["logloss"]
    assert fp32["logloss"] != mem["logloss"]  # the high halves are what the forward read
    if "--embedding.warm_start=false" in tier_extra:
        assert 0 < tiered["embedding_cache"]["hit_rate"] < 1
    # the final checkpoints hold the same exact fp32 rows and optimizer state
    parts = {}
    for n in ("memory", tier):
        last = sorted((tmp_path / n / "checkpoints").glob("step_*"))[-1]
        parts[n] = {f.name: f.read_bytes() for f in last.glob("parts/*/*.f32")}
    assert parts["memory"] and parts["memory"] == parts[tier]


def test_a_split_run_resumes_on_another_tier(tmp_path):
    """Checkpoints store the exact fp32 value at any placement: a split_bf16 run saved in
    memory resumes on the ssd tier and ends where the uninterrupted in-memory run does."""
    base = ["--train.progress=false", "--embedding.row_precision=split_bf16"]
    whole = train(load_config("debug", base + ["--train.steps=60"]), tmp_path / "whole", **QUIET)
    cut = load_config("debug", base + ["--train.steps=30"])
    train(cut, tmp_path / "cut", **QUIET)
    ssd = [
        "--train.steps=60",
        "--embedding.placement=ssd",
        "--embedding.cache_bytes=300000",
        f"--embedding.ssd_dir={tmp_path / 'ssd'}",
    ]
    resumed = train(
        load_config("debug", base + ssd), tmp_path / "cut", resume=tmp_path / "cut", **QUIET
    )
    assert resumed["auc"] == whole["auc"] and resumed["logloss"] == whole["logloss"]


@pytest.mark.skipif(native.library() is None, reason="native kernels not built")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "split_bf16"])
@pytest.mark.parametrize("d", [8, 16, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_lookups_bf16_sums_are_its_fp32_sums_rounded(precision, d, weighted):
    """``native_pooled_lookup(bf16_out=True)`` (a bf16 interaction's input): the fp32 sums
    of the same pass, rounded to nearest even as torch casts them - a NaN row's sum too -
    with the same rows and bags."""
    from recscale.embedding.lookup import native_pooled_lookup
    from recscale.embedding.low_precision import device_rows

    g = torch.Generator().manual_seed(d + weighted)
    num_f, b, n_rows = 3, 37, 50
    storage = device_rows(num_f * n_rows, d, SparseSGD(0.1), precision, kernel="native")
    storage.write_rows(torch.arange(num_f * n_rows), torch.randn(num_f * n_rows, d, generator=g))
    if precision == "fp32":
        storage.write_rows(torch.tensor([7]), torch.full((1, d), float("nan")))
    table = storage.native_lookup_table()
    lengths = torch.randint(0, 4, (num_f * b,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(0, n_rows, (int(offsets[-1]),), generator=g)
    values[0] = 7  # feature 0's row 7 (NaN in fp32)
    psw = torch.rand(values.shape[0], generator=g) if weighted else None
    row_offset, sizes = torch.arange(num_f) * n_rows, torch.full((num_f,), n_rows)
    args = (table, values, offsets, b, row_offset, sizes, psw)
    p32, rows32, bags32 = native_pooled_lookup(*args)
    p16, rows16, bags16 = native_pooled_lookup(*args, bf16_out=True)
    assert p16.dtype == torch.bfloat16 and p16.shape == p32.shape
    assert torch.equal(rows16, rows32) and torch.equal(bags16, bags32)
    want = p32.to(torch.bfloat16)
    nan = torch.isnan(want)
    assert nan.any() == (precision == "fp32")
    assert torch.equal(torch.isnan(p16), nan)
    assert torch.equal(p16[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.skipif(native.library() is None, reason="native kernels not built")
@pytest.mark.parametrize(
    "make_opt",
    [lambda: SparseSGD(0.5), lambda: SparseRowwiseAdagrad(0.1), lambda: SparseAdam(0.01)],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
@pytest.mark.parametrize("precision", ["fp32", "split_bf16", "bf16"])
@pytest.mark.parametrize("d", [8, 24, 128])
def test_a_bf16_pooled_gradient_updates_as_its_widened_fp32_does(make_opt, precision, d):
    """The fused update reads a bf16 pooled gradient (a bf16 interaction's) as it is: the
    rows and state equal those updated from the same gradient widened to fp32, bit for
    bit, duplicates included; a storage whose update runs elsewhere (numba, torch) gets
    it widened by the lookup's backward."""
    from recscale.embedding.low_precision import device_rows

    g = torch.Generator().manual_seed(d)
    n, bags = 64, 48
    stores = [device_rows(n, d, make_opt(), precision, kernel="native") for _ in range(2)]
    init = torch.randn(n, d, generator=g) * 0.1
    for st in stores:
        st.write_rows(torch.arange(n), init)
        assert st.takes_bf16_gradients()
    for _ in range(3):
        rows = torch.randint(0, 12, (bags,), generator=g)
        bag_of_id, segments = torch.arange(bags), torch.tensor([0, bags])
        grad = torch.randn(bags, d, generator=g).to(torch.bfloat16)
        stores[0].apply_pooled_gradients(rows, segments, bag_of_id, None, grad)
        stores[1].apply_pooled_gradients(rows, segments, bag_of_id, None, grad.float())
    every = torch.arange(n)
    assert torch.equal(stores[0].read_rows(every), stores[1].read_rows(every))
    for name, t in stores[0].read_state(every).items():
        assert torch.equal(t, stores[1].read_state(every)[name]), name
    assert not DeviceStorage(n, d, make_opt(), kernel="torch").takes_bf16_gradients()


def _torch_kernel_rows(n, d):
    return DeviceStorage(n, d, SparseRowwiseAdagrad(0.1), kernel="torch")


def _replicated_rows(n, d):  # a replicated table's storage (world size 1, no group)
    from recscale.distributed.sharded_embedding import all_reduced_storage

    return all_reduced_storage(n, d, SparseRowwiseAdagrad(0.1), "fp32", None, "native", None, 1)


@pytest.mark.parametrize("make", [_torch_kernel_rows, _replicated_rows], ids=["torch", "replica"])
def test_the_lookups_backward_widens_a_bf16_gradient_for_an_update_that_reads_fp32(make):
    """A bf16 pooled output's gradient reaches a storage whose update takes fp32 only
    (the torch kernel; a replica, whose merge before its all-reduce sums in the
    gradient's dtype) widened: the update equals one from the fp32 gradient."""
    from recscale.embedding.lookup import pooled_lookup

    g = torch.Generator().manual_seed(1)
    n, d, bags = 30, 16, 20
    stores = [make(n, d) for _ in range(2)]
    assert not stores[0].takes_bf16_gradients()
    init = torch.randn(n, d, generator=g)
    for st in stores:
        st.write_rows(torch.arange(n), init)
    rows = torch.randint(0, n, (bags,), generator=g)
    bag_of_id, segments = torch.arange(bags), torch.tensor([0, bags])
    offsets = torch.arange(bags + 1)
    grad = torch.randn(bags, d, generator=g).to(torch.bfloat16)
    placeholder = torch.zeros(0, requires_grad=True)
    pooled = init[rows].to(torch.bfloat16)  # as the native lookup hands it over
    out = pooled_lookup(stores[0], placeholder, rows, offsets, bag_of_id, segments, None, pooled)
    out.backward(grad)
    stores[1].apply_pooled_gradients(rows, segments, bag_of_id, None, grad.float())
    every = torch.arange(n)
    assert torch.equal(stores[0].read_rows(every), stores[1].read_rows(every))
