"""Table-batched lookup and its gradient vs a per-table torch.nn.EmbeddingBag reference."""

import pytest
import torch
from helpers import per_feature_inputs, random_jagged
from torch import nn

from recscale.embedding.optimizers import SparseSGD
from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec
from recscale.modules.id_checks import IdOutOfRangeError
from recscale.modules.table_init import INIT_CHUNK_ROWS, chunk_seed, init_table_rows


def _tables(sizes, dims):
    return [TableSpec(f"C{i + 1}", n, d) for i, (n, d) in enumerate(zip(sizes, dims))]


def _reference_bags(ebc: EmbeddingBagCollection, mode: str) -> list[nn.EmbeddingBag]:
    """One nn.EmbeddingBag per table holding a copy of that table's rows."""
    refs = []
    for f, t in enumerate(ebc.tables):
        group = ebc.groups[int(ebc.group_of_feature[f])]
        start = int(ebc.feature_row_offset[f])
        bag = nn.EmbeddingBag(t.num_rows, t.dim, mode=mode, include_last_offset=True)
        with torch.no_grad():
            bag.weight.copy_(group.storage.weight[start : start + t.num_rows])
        refs.append(bag)
    return refs


def _table_weight(ebc: EmbeddingBagCollection, f: int) -> torch.Tensor:
    group = ebc.groups[int(ebc.group_of_feature[f])]
    start = int(ebc.feature_row_offset[f])
    return group.storage.weight[start : start + ebc.tables[f].num_rows]


CASES = [
    # (sizes, dims, pooling, weighted)
    ([7, 3, 11], [4, 4, 4], "sum", False),
    ([7, 3, 11], [4, 4, 4], "mean", False),
    ([7, 3, 11], [4, 4, 4], "sum", True),
    ([5, 1, 9, 2], [4, 8, 4, 2], "sum", False),  # mixed dims: several storage groups
    ([5, 1, 9, 2], [4, 8, 4, 2], "mean", True),
    # dims that are multiples of 8: the native (C) lookup and update take these
    ([7, 3, 11], [16, 16, 16], "sum", False),
    ([7, 3, 11], [8, 8, 8], "sum", True),
    ([7, 3, 11], [16, 16, 16], "mean", True),
    ([5, 1, 9, 2], [8, 16, 8, 16], "sum", False),
]
KERNELS = ["torch", "numba", "native"]  # native: C where it applies (dim % 8 == 0), else numba


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sizes,dims,pooling,weighted", CASES)
def test_forward_and_gradient_match_embedding_bag(sizes, dims, pooling, weighted, kernel):
    torch.manual_seed(0)
    b = 6
    ebc = EmbeddingBagCollection(
        _tables(sizes, dims), pooling, lambda: SparseSGD(lr=1.0), kernel=kernel
    )
    batch = random_jagged(sizes, b, max_len=4, weighted=weighted, seed=1)
    assert bool((batch.lengths() == 0).any()), "the case must include empty bags"
    refs = _reference_bags(ebc, pooling)
    before = [_table_weight(ebc, f).clone() for f in range(len(sizes))]

    out = ebc(batch.values, batch.offsets, b, batch.weights)
    assert out.shape == (b, sum(dims))
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()

    col = 0
    for f, (ref, d) in enumerate(zip(refs, dims)):
        vals, offs, w = per_feature_inputs(batch, f)
        if pooling == "mean" and w is not None:
            # nn.EmbeddingBag has no weighted mean: weighted sum divided by bag length.
            lens = (offs[1:] - offs[:-1]).clamp(min=1).float()
            sum_bag = nn.EmbeddingBag.from_pretrained(
                ref.weight.detach().clone(), freeze=False, mode="sum", include_last_offset=True
            )
            expected = sum_bag(vals, offs, per_sample_weights=w) / lens[:, None]
            (expected * upstream[:, col : col + d]).sum().backward()
            ref_grad = sum_bag.weight.grad
        else:
            expected = ref(vals, offs, per_sample_weights=w)
            (expected * upstream[:, col : col + d]).sum().backward()
            ref_grad = ref.weight.grad
        torch.testing.assert_close(out[:, col : col + d], expected, rtol=1e-5, atol=1e-6)
        # SGD with lr=1 moved the rows by exactly minus the gradient.
        torch.testing.assert_close(
            before[f] - _table_weight(ebc, f), ref_grad, rtol=1e-5, atol=1e-6
        )
        col += d


@pytest.mark.parametrize("kernel,dim", [("torch", 2), ("numba", 2), ("native", 8)])
def test_repeated_ids_in_one_bag_accumulate(kernel, dim):
    ebc = EmbeddingBagCollection(
        _tables([4], [dim]), "sum", lambda: SparseSGD(lr=1.0), kernel=kernel
    )
    w0 = _table_weight(ebc, 0).clone()
    values = torch.tensor([1, 1, 1, 2])
    offsets = torch.tensor([0, 4])
    out = ebc(values, offsets, 1)
    torch.testing.assert_close(out[0], 3 * w0[1] + w0[2])
    out.sum().backward()
    delta = w0 - _table_weight(ebc, 0)
    torch.testing.assert_close(delta[1], torch.full((dim,), 3.0))
    torch.testing.assert_close(delta[2], torch.ones(dim))
    assert delta[0].abs().sum() == 0 and delta[3].abs().sum() == 0


def test_no_dense_gradient_is_ever_built():
    ebc = EmbeddingBagCollection(_tables([1000, 1000], [8, 8]), "sum", lambda: SparseSGD(lr=0.1))
    batch = random_jagged([1000, 1000], 4, seed=3)
    ebc(batch.values, batch.offsets, 4).sum().backward()
    for p in ebc.parameters():
        assert p.numel() == 0  # only the zero-size placeholder is a parameter
    assert all(g.storage.weight.grad is None for g in ebc.groups)


def test_eval_mode_lookup_does_not_update():
    ebc = EmbeddingBagCollection(_tables([10], [4]), "sum", lambda: SparseSGD(lr=1.0))
    w0 = _table_weight(ebc, 0).clone()
    with torch.no_grad():
        ebc(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), 2)
    torch.testing.assert_close(w0, _table_weight(ebc, 0))


@pytest.mark.parametrize("dim", [4, 16])  # 16: the native lookup finds it first
@pytest.mark.parametrize("bad", [10, -1])
def test_out_of_range_id_names_feature_and_value(bad, dim):
    ebc = EmbeddingBagCollection(_tables([5, 10], [dim, dim]), "sum", lambda: SparseSGD(lr=1.0))
    values = torch.tensor([0, 1, 3, bad])
    offsets = torch.tensor([0, 1, 2, 3, 4])  # F=2, B=2
    with pytest.raises(IdOutOfRangeError, match=rf"id {bad} of feature C2 \(sample 1.*10 rows"):
        ebc(values, offsets, 2)


@pytest.mark.parametrize("kernel,dim", [("torch", 4), ("numba", 4), ("native", 16)])
def test_dirty_flags_mark_exactly_the_touched_rows(kernel, dim):
    sizes = [7, 3, 11]
    ebc = EmbeddingBagCollection(
        _tables(sizes, [dim] * 3), "sum", lambda: SparseSGD(lr=1.0), kernel=kernel
    )
    storage = ebc.groups[0].storage
    storage.track_dirty(True)
    batch = random_jagged(sizes, 5, seed=4, hot_ids=False)
    ebc(batch.values, batch.offsets, 5).sum().backward()
    b = batch.batch_size
    touched = set()
    for f in range(3):
        start = int(ebc.feature_row_offset[f])
        vals = batch.values[int(batch.offsets[f * b]) : int(batch.offsets[(f + 1) * b])]
        touched |= {start + int(v) for v in vals}
    assert set(torch.nonzero(storage.dirty).squeeze(1).tolist()) == touched


def test_in_order_duplicate_merge_matches_index_add():
    """The GPU's merge (each row's ids summed in order in one bag) against index_add_."""
    from recscale.embedding.storage import merge_duplicate_rows

    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 50, (400,), generator=g)
    grad = torch.randn(400, 8, generator=g, dtype=torch.float64)
    u_ref, s_ref = merge_duplicate_rows(rows, grad, in_order=False)
    u, s = merge_duplicate_rows(rows, grad, in_order=True)
    assert torch.equal(u, u_ref)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 3])
def test_initial_rows_are_each_chunks_own_draw_in_any_rectangle(threads):
    """A table's initial rows, drawn in place and on several threads, against the
    contract drawn one chunk at a time into a fresh tensor: chunk ``c`` holds
    U(-1/sqrt(n), 1/sqrt(n)) from a generator seeded by (seed, feature, c). Any row
    block and column block of the table holds the whole table's values."""
    n, dim, seed, feature = 3 * INIT_CHUNK_ROWS + 77, 6, 11, 4
    bound = (1.0 / n) ** 0.5
    whole = torch.cat(
        [
            torch.empty(min(n, lo + INIT_CHUNK_ROWS) - lo, dim).uniform_(
                -bound,
                bound,
                generator=torch.Generator().manual_seed(chunk_seed(seed, feature, c)),
            )
            for c, lo in enumerate(range(0, n, INIT_CHUNK_ROWS))
        ]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, cols in [
            ((0, n), (0, dim)),
            ((5, n - 3), (0, dim)),
            ((INIT_CHUNK_ROWS, 2 * INIT_CHUNK_ROWS), (0, dim)),
            ((100, 2 * INIT_CHUNK_ROWS + 9), (2, 5)),
            ((7, 7), (0, dim)),
        ]:
            out = torch.full((rows[1] - rows[0], cols[1] - cols[0]), float("nan"))
            init_table_rows(out, seed, feature, n, dim, *rows, *cols)
            assert torch.equal(out, whole[rows[0] : rows[1], cols[0] : cols[1]]), (rows, cols)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", True)])
def test_several_groups_of_one_dim_pool_and_update_as_embedding_bag(pooling, weighted):
    """Compressed tables are groups of their own: the groups' [F, B, D] stack, put in
    feature order by one gather, equals each table's rows pooled by nn.EmbeddingBag, and
    its backward hands each table its own gradient (the plain tables' rows, SGD at lr 1,
    move by exactly minus nn.EmbeddingBag's; every group steps)."""
    from recscale.config.schema import EmbeddingConfig
    from recscale.embedding.placement import device_storage_factory

    torch.manual_seed(0)
    sizes, b = [7, 30, 11, 40, 5], 6
    qr = {1, 3}  # out of feature order once grouped: plain C1 C3 C5, then C2, then C4
    tables = [
        TableSpec(f"C{f + 1}", n, 8, compression="qr" if f in qr else "none")
        for f, n in enumerate(sizes)
    ]
    # each QR table its own storage (stacked, they would be one group: test_compression.py)
    make = device_storage_factory(EmbeddingConfig(qr_buckets=4), None, "auto", stack_qr=False)
    ebc = EmbeddingBagCollection(tables, pooling, lambda: SparseSGD(lr=1.0), make_storage=make)
    assert len(ebc.groups) == 3 and ebc.stack_index.tolist() == [0, 3, 1, 4, 2]
    batch = random_jagged(sizes, b, max_len=4, weighted=weighted, seed=3)
    out = ebc.pooled_by_feature(batch.values, batch.offsets, b, batch.weights)
    assert out.shape == (b, 5, 8)
    upstream = torch.randn(b, 5, 8)
    refs, before = [], []
    for f, (part, storage, first) in enumerate(ebc.local_parts()):
        assert part.feature == f
        rows = storage.read_rows(torch.arange(first, first + sizes[f]))
        before.append(rows)
        vals, offs, w = per_feature_inputs(batch, f)
        mode = "sum" if weighted else pooling
        ref = nn.EmbeddingBag.from_pretrained(rows, False, mode=mode, include_last_offset=True)
        expected = ref(vals, offs, per_sample_weights=w)
        if pooling == "mean" and weighted:
            expected = expected / (offs[1:] - offs[:-1]).clamp(min=1).float()[:, None]
        torch.testing.assert_close(out[:, f], expected, rtol=1e-5, atol=1e-6)
        (expected * upstream[:, f]).sum().backward()
        refs.append(ref.weight.grad)
    steps = [int(s.step) for s in ebc.storages()]
    (out * upstream).sum().backward()
    assert [int(s.step) for s in ebc.storages()] == [n + 1 for n in steps]
    for f, (_, storage, first) in enumerate(ebc.local_parts()):
        if f not in qr:
            rows = storage.read_rows(torch.arange(first, first + sizes[f]))
            torch.testing.assert_close(before[f] - rows, refs[f], rtol=1e-5, atol=1e-6)
