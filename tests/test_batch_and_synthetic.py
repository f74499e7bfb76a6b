import numpy as np
import pytest
import torch

from recscale.data.batch import Batch
from recscale.data.prefetch import Prefetcher
from recscale.data.synthetic import SyntheticCriteo, _zipf_ranks_by_feature, zipf_ranks


def test_from_lists_layout_is_feature_major():
    # 2 samples, 2 features; sample 1 of feature 0 is empty, multi-hot elsewhere.
    b = Batch.from_lists(
        dense=[[1.0], [2.0]], sparse=[[[3, 4], []], [[5], [6, 7, 8]]], labels=[1, 0]
    )
    assert b.values.tolist() == [3, 4, 5, 6, 7, 8]
    assert b.offsets.tolist() == [0, 2, 2, 3, 6]
    assert b.lengths().tolist() == [2, 0, 1, 3]
    assert b.feature_values(1).tolist() == [5, 6, 7, 8]
    assert b.num_sparse_features == 2
    b.check(num_dense=1, num_sparse=2)


def test_check_reports_bad_shapes():
    b = Batch.from_lists(dense=[[1.0]], sparse=[[[1]]], labels=[0])
    with pytest.raises(ValueError, match="offsets has shape"):
        b.check(num_dense=1, num_sparse=2)
    bad = Batch(b.dense, b.values, torch.tensor([0, 5]), b.labels)
    with pytest.raises(ValueError, match="end at len"):
        bad.check(num_dense=1, num_sparse=1)


def test_zipf_ranks_are_skewed_and_in_range():
    u = np.random.default_rng(0).random(200_000)
    r = zipf_ranks(u, 1000, 1.1)
    assert r.min() >= 0 and r.max() < 1000
    counts = np.bincount(r, minlength=1000)
    assert counts[0] > counts[9] > counts[99] > 0  # popularity falls with rank
    assert counts[:10].sum() / len(r) > 0.4  # the head takes a large share, as in real logs
    uniform = zipf_ranks(u, 1000, 0.0)
    assert abs(np.bincount(uniform, minlength=1000)[:10].sum() / len(u) - 0.01) < 0.003


def test_synthetic_is_deterministic_and_well_formed():
    sizes = [50, 3, 1000, 7]
    gen = SyntheticCriteo(sizes, num_dense=13, seed=5, min_ids=0, max_ids=3)
    a, b = gen.batch(4, 64), gen.batch(4, 64)
    assert torch.equal(a.values, b.values) and torch.equal(a.labels, b.labels)
    assert not torch.equal(gen.batch(5, 64).values, a.values)
    a.check(num_dense=13, num_sparse=4)
    lens = a.lengths()
    assert lens.min() >= 0 and lens.max() <= 3 and bool((lens == 0).any())
    for f, n in enumerate(sizes):
        v = a.feature_values(f)
        assert v.numel() == 0 or (v.min() >= 0 and v.max() < n)
    assert a.dense.dtype == torch.float32 and bool((a.dense >= 0).all())


def test_synthetic_labels_carry_signal():
    gen = SyntheticCriteo([100] * 8, num_dense=13, seed=1)
    batch = gen.batch(0, 20_000)
    ctr = float(batch.labels.mean())
    assert 0.1 < ctr < 0.5
    # The hidden first-order weight of feature 0's id correlates with the label.
    w = gen.id_weight(0, batch.feature_values(0).numpy())
    corr = np.corrcoef(w, batch.labels.numpy())[0, 1]
    assert corr > 0.03


def test_huge_tables_cost_no_memory():
    gen = SyntheticCriteo([40_000_000, 10], num_dense=13, seed=2)
    batch = gen.batch(0, 128)
    assert int(batch.feature_values(0).max()) < 40_000_000


def test_prefetcher_keeps_order_and_reraises():
    assert list(Prefetcher(range(10), depth=3)) == list(range(10))
    assert list(Prefetcher(range(5), depth=0)) == list(range(5))

    def broken():
        yield 1
        raise RuntimeError("reader failed")

    it = iter(Prefetcher(broken(), depth=2))
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="reader failed"):
        next(it)


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            table_sizes=[1000, 50, 3_000_000, 7], zipf_alpha=1.1
        ),  # one id a bag; one hashed table
        dict(table_sizes=[1000, 3_000_000, 7], zipf_alpha=0.8, min_ids=0, max_ids=4),
        dict(table_sizes=[100, 2_500_000], num_dense=0, zipf_alpha=1.0, bag_sizes=[3, 2]),
    ],
    ids=["one-hot", "multi-hot", "fixed-bags"],
)
def test_synthetic_logits_match_the_hidden_model_written_in_numpy(kw):
    """The compiled per-feature accumulation against the click model's formula in plain
    numpy (first-order mean weights + FM pairwise term + dense part): equal to the bit,
    so a dataset is the same whichever formulation drew it."""
    d = SyntheticCriteo(seed=3, **kw)
    (_, dense, lengths, ids), raw = d._sample(2, 300, "train")
    b, num_f = 300, len(d.table_sizes)
    logit = np.zeros(b)
    if d.num_dense:
        z = (dense - dense.mean(axis=0)) / (dense.std(axis=0) + 1e-6)
        logit += z @ d._dense_w
    factor_sum, factor_sq = np.zeros((b, 4)), np.zeros(b)
    start = 0
    for f in range(num_f):
        lens = lengths[f]
        f_ids = ids[start : start + int(lens.sum())]
        start += len(f_ids)
        if len(f_ids) == 0:
            continue
        bag, denom = np.repeat(np.arange(b), lens), np.maximum(lens, 1)
        id_w, fac = d._effects(f, f_ids)
        logit += d._feature_scale[f] * (np.bincount(bag, weights=id_w, minlength=b) / denom)
        v = np.zeros((b, 4))
        np.add.at(v, bag, fac)
        v /= denom[:, None]
        factor_sum += v
        factor_sq += (v * v).sum(axis=1)
    logit += 0.5 * ((factor_sum * factor_sum).sum(axis=1) - factor_sq) / np.sqrt(num_f)
    assert start == len(ids)
    np.testing.assert_array_equal(raw, d.signal_scale * logit)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 1.1])
def test_batched_zipf_ranks_equal_zipf_ranks_feature_by_feature(alpha):
    """The generator draws every feature's ranks in one pass; each must be the rank
    zipf_ranks gives that feature's uniforms alone (to the bit: same data either way)."""
    sizes = [1, 7, 1000, 3_000_000]
    counts = np.array([5, 300, 0, 1000])
    u = np.random.default_rng(0).random(int(counts.sum()))
    got = _zipf_ranks_by_feature(u, sizes, counts, alpha)
    want = np.concatenate(
        [zipf_ranks(part, n, alpha) for part, n in zip(np.split(u, np.cumsum(counts)[:-1]), sizes)]
    )
    np.testing.assert_array_equal(got, want)


def test_slice_is_the_samples_built_again_from_lists():
    """``slice(lo, hi)`` against the same samples built from nested lists: empty bags,
    empty slices, whole batches and weights, over random shapes."""
    g = np.random.default_rng(0)
    for trial in range(200):
        b, f = int(g.integers(1, 12)), int(g.integers(1, 5))
        ids = [[list(g.integers(0, 99, g.integers(0, 4))) for _ in range(b)] for _ in range(f)]
        wts = [[list(g.random(len(bag))) for bag in per] for per in ids]
        dense, labels = g.random((b, 2)).tolist(), g.integers(0, 2, b).tolist()
        whole = Batch.from_lists(dense, ids, labels, wts)
        lo = int(g.integers(0, b + 1))
        hi = int(g.integers(lo, b + 1))
        got = whole.slice(lo, hi)
        if lo == hi:  # from_lists builds no empty batch
            assert got.dense.shape == (0, 2) and got.offsets.tolist() == [0]
            assert got.values.numel() == got.weights.numel() == got.labels.numel() == 0
            continue
        want = Batch.from_lists(
            dense[lo:hi], [per[lo:hi] for per in ids], labels[lo:hi], [w[lo:hi] for w in wts]
        )
        for name in ("dense", "values", "offsets", "labels", "weights"):
            a, e = getattr(got, name), getattr(want, name)
            assert a.dtype == e.dtype and torch.equal(a, e.view(a.shape)), (trial, name)


def test_cat_joins_slices_back_into_the_batch():
    """``Batch.cat`` of consecutive slices is the batch itself (feature-major ids kept
    per feature), weights included."""
    data = SyntheticCriteo([50, 7, 300], num_dense=3, min_ids=0, max_ids=4, seed=3)
    b = data.batch(0, 37)
    b.weights = torch.rand(b.values.shape[0])
    parts = [b.slice(0, 5), b.slice(5, 5), b.slice(5, 30), b.slice(30, 37)]
    got = Batch.cat(parts)
    for name in ("dense", "values", "offsets", "labels", "weights"):
        assert torch.equal(getattr(got, name), getattr(b, name)), name


def test_the_synthetic_held_out_set_is_the_same_at_any_eval_batch():
    """The held-out set was drawn in eval batches, and a draw standardises its dense
    features over its batch: the samples, and the AUC of one model, changed with
    ``train.eval_batch_size`` (0.7025 at 16,384, 0.7017 at 7). It is drawn in fixed
    blocks and cut into eval batches."""
    from recscale.config import load_config
    from recscale.train.data_source import EVAL_DRAW, eval_batches

    def samples(eval_batch: int) -> Batch:
        over = ["--data.eval_samples=20000", f"--train.eval_batch_size={eval_batch}"]
        batches = list(eval_batches(load_config("debug", over)))
        assert all(x.batch_size == eval_batch for x in batches[:-1])
        return Batch.cat(batches)

    want = samples(EVAL_DRAW)
    for eval_batch in (7, 5000, EVAL_DRAW + 1, 50000):
        got = samples(eval_batch)
        for name in ("dense", "values", "offsets", "labels"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (eval_batch, name)


def test_a_runs_synthetic_source_is_made_once_and_shared():
    """The training stream and the held-out set each made the source, and making it
    draws every id's hidden effects (5.5 s for config B): one config makes it once;
    another config its own."""
    from recscale.config import load_config
    from recscale.train.data_source import make_synthetic

    a = make_synthetic(load_config("debug", []))
    assert make_synthetic(load_config("debug", [])) is a
    other = make_synthetic(load_config("debug", ["--data.seed=5"]))
    assert other is not a and other.seed == 5
    assert not torch.equal(other.batch(0, 64).values, a.batch(0, 64).values)


def test_the_id_effects_hashed_in_pieces_on_threads_are_the_same(monkeypatch):
    """SyntheticCriteo hashes its cached tables' id effects in pieces on the cores at
    once; the source must be the same as one hashed in one piece on one thread."""
    import recscale.data.synthetic as synthetic

    sizes = [5000, 1, 777, 4096]
    monkeypatch.setattr(synthetic, "_EFFECT_PIECE", 1 << 30)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = synthetic.SyntheticCriteo(sizes, seed=5)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(synthetic, "_EFFECT_PIECE", 1000)
    monkeypatch.setattr(synthetic.torch, "get_num_threads", lambda: 3)
    pieces = synthetic.SyntheticCriteo(sizes, seed=5)
    assert np.array_equal(whole._cache_w, pieces._cache_w)
    assert np.array_equal(whole._cache_fac, pieces._cache_fac)
    for f, n in enumerate(sizes):  # against the effects hashed for the ids directly
        ids = np.arange(n, dtype=np.int64)
        assert np.array_equal(pieces._cached[f][0], whole.id_weight(f, ids).astype(np.float32))
    a, b = whole.batch(3, 64), pieces.batch(3, 64)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.values, b.values)


def test_a_huge_signal_scale_draws_labels_without_overflow_warnings():
    """Logits past -709 overflow exp to inf: the click probability's limit 0, exactly,
    with no RuntimeWarning on the console (it had printed two)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen = SyntheticCriteo([100] * 8, num_dense=13, seed=1, signal_scale=1e30)
        b = gen.batch(0, 512)
    labels = b.labels.numpy()
    assert set(np.unique(labels)) <= {0.0, 1.0} and 0 < labels.mean() < 1


def test_a_path_that_is_not_a_dataset_says_what_to_name_instead(tmp_path):
    """``data.path`` naming a split's folder or file, a raw file or nothing at all: each
    error says which, and what to name (the dataset, the command that makes one)."""
    from helpers import make_dataset

    from recscale.data.columns import read_metadata
    from recscale.data.dataset import DatasetError

    ds = make_dataset(tmp_path, 50, seed=1, hash_size=37)
    for inside in (ds / "train", ds / "train" / "labels.u8"):
        with pytest.raises(DatasetError, match=f"^{inside} is not a recscale dataset but "
                           f"part of one: name {ds}$"):  # fmt: skip
            read_metadata(inside)
    with pytest.raises(DatasetError, match=r"a file: `recscale data preprocess --input .*in\.tsv"):
        read_metadata(tmp_path / "in.tsv")
    with pytest.raises(DatasetError, match="there is no such file or directory"):
        read_metadata(tmp_path / "nowhere")
    with pytest.raises(DatasetError, match=r"not a recscale dataset \(no metadata.json\)$"):
        read_metadata(tmp_path)
