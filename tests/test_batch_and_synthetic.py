import numpy as np
import pytest
import torch

from recscale.data.batch import Batch
from recscale.data.prefetch import Prefetcher
from recscale.data.synthetic import SyntheticCriteo, zipf_ranks


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
