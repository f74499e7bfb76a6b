"""The Triton kernels against independent references: ``nn.EmbeddingBag`` for the lookup,
torch's dense optimizers (and the torch path) for the fused backward.

On CUDA (``RECSCALE_TEST_DEVICE=cuda``) they run as compiled kernels; elsewhere through
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by conftest), which is
how CI tests them without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_jagged

from recscale.embedding import kernels
from recscale.embedding.optimizers import SparseAdam, SparseRowwiseAdagrad, SparseSGD

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")


@pytest.fixture
def tk(device):
    if device.type == "cpu" and not kernels.triton_interpreting():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    from recscale.embedding import triton_kernels

    return triton_kernels


def _bags(num_bags: int, rows: int, device, max_len: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_bags,), generator=g)
    offsets = torch.zeros(num_bags + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids = torch.randint(0, rows, (int(offsets[-1]),), generator=g)
    psw = torch.rand(ids.shape[0], generator=g)
    bag_of_id = torch.repeat_interleave(torch.arange(num_bags), lengths)
    return [t.to(device) for t in (ids, offsets, psw, bag_of_id)]


@pytest.mark.parametrize("dim", [4, 16, 24, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_matches_embedding_bag(tk, device, dim, weighted):
    rows = 97
    ids, offsets, psw, _ = _bags(70, rows, device)
    bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True).to(device)
    w = psw if weighted else None
    out = tk.pooled_lookup(bag.weight.detach().contiguous(), ids, offsets, w)
    ref = bag(ids, offsets, per_sample_weights=w)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert bool((out[offsets[1:] == offsets[:-1]] == 0).all())  # empty bags are zeros


@pytest.mark.parametrize("bad", [97, 1 << 40, -1, -(1 << 40)])
def test_lookup_never_reads_past_the_table(tk, device, bad):
    """A row outside the table adds zeros to its bag (never memory past the table) and,
    asked to check, the lookup raises before it launches. The reference: the same bags
    with that id's weight zero."""
    rows, dim = 97, 16
    ids, offsets, psw, _ = _bags(70, rows, device, seed=3)
    weight = torch.randn(rows, dim, device=device)
    ids[[0, 5, -1]] = bad
    unchecked = tk.pooled_lookup(weight, ids, offsets, psw, check_rows=False)
    kept = torch.where(ids == bad, 0.0, psw)
    ref = F.embedding_bag(ids.clamp(0, rows - 1), weight, offsets, mode="sum",
                          per_sample_weights=kept, include_last_offset=True)  # fmt: skip
    torch.testing.assert_close(unchecked, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError, match=rf"row {bad} is outside the table's 97 rows"):
        tk.pooled_lookup(weight, ids, offsets, psw)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_fused_update_writes_nothing_when_a_row_is_outside_the_table(tk, device, optimizer):
    """An update that meets a row outside the table raises having written no row, no
    optimizer state and no dirty flag."""
    from recscale.config import load_config
    from recscale.embedding.optimizers import build_sparse_optimizer

    opt = build_sparse_optimizer(
        load_config("debug", [f"--embedding.optimizer={optimizer}"]).embedding
    )
    rows, dim = 50, 8
    ids, offsets, psw, bag_of_id = _bags(40, rows, device, seed=4)
    ids[7] = rows  # one past the last row
    weight = torch.randn(rows, dim, device=device)
    state = {
        name: torch.rand(rows, *shape, device=device)
        for name, shape in opt.state_shapes(dim).items()
    }
    before = [weight.clone(), *(t.clone() for t in state.values())]
    dirty = torch.zeros(rows, dtype=torch.bool, device=device)
    grad = torch.randn(offsets.shape[0] - 1, dim, device=device)
    with pytest.raises(IndexError, match=r"row 50 is outside the table's 50 rows"):
        tk.fused_update(opt, weight, state, ids, bag_of_id, psw, grad, 1, dirty)
    assert all(torch.equal(a, b) for a, b in zip(before, [weight, *state.values()]))
    assert not bool(dirty.any())


def _dense_reference(optimizer: str, weight, ids, offsets, psw, grads, lr):
    """K steps of nn.EmbeddingBag + a torch optimizer (dense gradient of the whole table)."""
    bag = torch.nn.EmbeddingBag.from_pretrained(
        weight.clone(),
        freeze=False,
        mode="sum",
        include_last_offset=True,
        sparse=optimizer == "adam",
    )
    opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=lr),
        "adam": lambda p: torch.optim.SparseAdam(p, lr=lr),
    }[optimizer](bag.parameters())
    for g in grads:
        opt.zero_grad()
        (bag(ids, offsets, per_sample_weights=psw) * g).sum().backward()
        opt.step()
    return bag.weight.detach()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fused_update_matches_dense_torch_optimizers(tk, device, optimizer):
    rows, dim, lr, steps = 60, 16, 0.05, 3
    ids, offsets, psw, bag_of_id = _bags(40, rows, device, max_len=5, seed=1)
    weight0 = torch.randn(rows, dim, generator=torch.Generator().manual_seed(2)).to(device)
    grads = [
        torch.randn(40, dim, generator=torch.Generator().manual_seed(10 + k)).to(device)
        for k in range(steps)
    ]
    opt = SparseSGD(lr) if optimizer == "sgd" else SparseAdam(lr)
    weight = weight0.clone()
    state = {k: torch.zeros(rows, *s, device=device) for k, s in opt.state_shapes(dim).items()}
    dirty = torch.zeros(rows, dtype=torch.bool, device=device)
    for k, g in enumerate(grads):
        tk.fused_update(opt, weight, state, ids, bag_of_id, psw, g, k + 1, dirty)
    ref = _dense_reference(
        optimizer, weight0.cpu(), ids.cpu(), offsets.cpu(), psw.cpu(), [g.cpu() for g in grads], lr
    )
    torch.testing.assert_close(weight.cpu(), ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(dirty.cpu(), torch.isin(torch.arange(rows), ids.cpu()))


def test_fused_rowwise_adagrad_matches_the_reference_update(tk, device):
    rows, dim = 50, 24
    ids, _offsets, psw, bag_of_id = _bags(30, rows, device, max_len=6, seed=3)
    opt = SparseRowwiseAdagrad(0.1, eps=1e-8, initial_accumulator=0.1)
    weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(4)).to(device)
    state = {"sum": torch.full((rows,), 0.1, device=device)}
    ref_w, ref_s = weight.clone(), {"sum": state["sum"].clone()}
    for k in range(3):
        g = torch.randn(30, dim, generator=torch.Generator().manual_seed(20 + k)).to(device)
        tk.fused_update(opt, weight, state, ids, bag_of_id, psw, g, k + 1)
        per_id = g[bag_of_id] * psw[:, None]
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(unique.shape[0], dim, device=device).index_add_(0, inverse, per_id)
        opt.update_(ref_w, ref_s, unique, summed, k + 1)
    torch.testing.assert_close(weight, ref_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state["sum"], ref_s["sum"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(  # D 24: masked columns, SUB 128; D 128: SUB 32 (one optimizer)
    "dim, optimizer", [(24, "sgd"), (24, "rowwise_adagrad"), (24, "adam"), (128, "sgd")]
)
def test_fused_update_sums_hot_rows_in_pieces_like_the_reference(tk, device, optimizer, dim):
    """Rows with more ids than ``LIGHT`` are summed in pieces (module doc): counts on both
    sides of the threshold; heavy rows starting on a window's edge and off it, one whose
    head is all of it, one ending inside a window; weighted, against a float64
    ``index_add`` reference, and the same bits on a second run (a fixed order)."""
    light, w = tk.LIGHT, tk.W
    # sorted starts: 0, 1, 33, 66, w (on an edge), 2w + 1, 4w + 91, 4w + 94, 4w + 95
    counts = [1, light, light + 1, w - 66, w + 1, 2 * w + 90, 3, 1, light + 5]
    g = torch.Generator().manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(len(counts)) * 7, torch.tensor(counts))
    ids = ids[torch.randperm(ids.shape[0], generator=g)].to(device)
    n, rows = ids.shape[0], 7 * len(counts)
    bag_of_id = torch.randint(0, 50, (n,), generator=g).to(device)
    psw = torch.rand(n, generator=g).to(device)
    opt = {"sgd": SparseSGD(0.05), "adam": SparseAdam(0.05)}.get(optimizer) or (
        SparseRowwiseAdagrad(0.1, eps=1e-8, initial_accumulator=0.1)
    )
    weight0 = torch.randn(rows, dim, generator=g).to(device)
    state0 = {
        k: torch.full((rows, *s), 0.1, device=device) for k, s in opt.state_shapes(dim).items()
    }
    grads = [torch.randn(50, dim, generator=g).to(device) for _ in range(2)]
    runs = []
    for _ in range(2):
        weight, state = weight0.clone(), {k: v.clone() for k, v in state0.items()}
        for k, gp in enumerate(grads):
            tk.fused_update(opt, weight, state, ids, bag_of_id, psw, gp, k + 1)
        runs.append((weight, state))
    ref_w, ref_s = weight0.clone(), {k: v.clone() for k, v in state0.items()}
    unique, inverse = torch.unique(ids, return_inverse=True)
    for k, gp in enumerate(grads):
        per_id = (gp[bag_of_id] * psw[:, None]).double()
        summed = torch.zeros(unique.shape[0], dim, device=device, dtype=torch.float64)
        opt.update_(ref_w, ref_s, unique, summed.index_add_(0, inverse, per_id).float(), k + 1)
    torch.testing.assert_close(runs[0][0], ref_w, atol=1e-5, rtol=1e-5)
    for name in ref_s:  # Adam's squares of ~600-id float32 sums: rtol 1e-4
        torch.testing.assert_close(runs[0][1][name], ref_s[name], atol=1e-5, rtol=1e-4)
    assert torch.equal(runs[0][0], runs[1][0])


def test_fused_update_on_random_mixes_of_light_and_heavy_rows(tk, device):
    """Random layouts (most rows a few ids, some around ``LIGHT``, some several windows
    long, in random sorted positions): SGD's step equals the summed gradient exactly
    enough to catch any id counted twice or missed."""
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        kinds = torch.randint(0, 10, (60,), generator=g)
        counts = torch.where(
            kinds < 6,
            torch.randint(1, 4, (60,), generator=g),
            torch.where(
                kinds < 8,
                torch.randint(tk.LIGHT - 2, tk.LIGHT + 6, (60,), generator=g),
                torch.randint(tk.W - 20, 2 * tk.W, (60,), generator=g),
            ),
        )
        rows = 3 * 60
        ids = torch.repeat_interleave(torch.randperm(rows, generator=g)[:60], counts)
        ids = ids[torch.randperm(ids.shape[0], generator=g)]
        n = ids.shape[0]
        bag_of_id = torch.randint(0, 40, (n,), generator=g)
        grad = torch.randn(40, 8, generator=g)
        weight = torch.zeros(rows, 8, device=device)
        tk.fused_update(
            SparseSGD(1.0), weight, {}, ids.to(device), bag_of_id.to(device), None,
            grad.to(device), 1,
        )  # fmt: skip
        ref = torch.zeros(rows, 8, dtype=torch.float64).index_add_(0, ids, grad[bag_of_id].double())
        torch.testing.assert_close(weight.cpu().double(), -ref, atol=1e-4, rtol=1e-5)


def test_fused_update_does_not_depend_on_row_numbering(tk, device):
    """A row's update is a function of its own ids alone: renumbered rows (cache slots for
    table rows, a shard's local rows) and other rows' ids around them (which move its
    sorted positions, so heavy rows start on other window offsets) give the same bits."""
    g = torch.Generator().manual_seed(7)
    counts = torch.tensor([tk.W + 40, 2 * tk.W + 3, tk.LIGHT + 1, 3, 700, 1, tk.LIGHT])
    ids = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    ids = ids[torch.randperm(ids.shape[0], generator=g)]
    n, dim = ids.shape[0], 24
    bag_of_id = torch.randint(0, 30, (n,), generator=g)
    psw = torch.rand(n, generator=g)
    grad = torch.randn(30, dim, generator=g)
    weight0 = torch.randn(counts.shape[0], dim, generator=g)
    opt = SparseRowwiseAdagrad(0.1, eps=1e-8, initial_accumulator=0.1)

    def run(slot_of_row, rows, filler):
        """``ids`` renumbered by ``slot_of_row`` (all >= 7), with ``filler`` ids of rows
        0..6 inserted at random places."""
        at = torch.randperm(n + filler, generator=g)[:n].sort().values
        full = torch.randint(0, counts.shape[0], (n + filler,), generator=g)
        full[at] = slot_of_row[ids]
        bags, weights = torch.zeros(n + filler, dtype=torch.int64), torch.zeros(n + filler)
        bags[at], weights[at] = bag_of_id, psw
        weight = torch.zeros(rows, dim)
        weight[slot_of_row] = weight0
        state = {"sum": torch.full((rows,), 0.1, device=device)}
        weight = weight.to(device)
        tk.fused_update(
            opt, weight, state, full.to(device), bags.to(device), weights.to(device),
            grad.to(device), 1,
        )  # fmt: skip
        return weight[slot_of_row.to(device)].cpu(), state["sum"][slot_of_row.to(device)].cpu()

    first = run(torch.arange(counts.shape[0]), counts.shape[0], 0)
    for filler in (5, 100, 517):
        slots = torch.randperm(2000, generator=g)[: counts.shape[0]] + counts.shape[0]
        other = run(slots, 2000 + counts.shape[0], filler)
        assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]), filler


def _collection(device, kernel: str, pooling: str, optimizer: str, **kwargs):
    """Three small tables of dim 8 (30, 5 and 80 rows) on ``kernel``."""
    from recscale.config import load_config
    from recscale.embedding.optimizers import build_sparse_optimizer
    from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec

    cfg = load_config("debug", [f"--embedding.optimizer={optimizer}"])
    return EmbeddingBagCollection(
        [TableSpec(f"C{i}", n, 8) for i, n in enumerate([30, 5, 80])],
        pooling,
        lambda: build_sparse_optimizer(cfg.embedding),
        device=device,
        seed=1,
        kernel=kernel,
        **kwargs,
    )


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_training_with_triton_kernels_equals_the_torch_path(tk, device, optimizer):
    """A collection with kernels=triton (lookup + fused backward) trains like kernels=torch."""
    out = {}
    for kernel in ("torch", "triton"):
        ebc = _collection(device, kernel, "mean", optimizer)
        tables = ebc.tables
        for step in range(4):
            batch = random_jagged([t.num_rows for t in tables], 16, seed=step).to(device)
            pooled = ebc(batch.values, batch.offsets, batch.batch_size)
            target = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(step))
            F.mse_loss(pooled, target.to(device)).backward()
        assert all(g.storage.backward_kernel() == kernel for g in ebc.groups)
        out[kernel] = [g.storage.weight.detach().cpu().clone() for g in ebc.groups]
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unchecked_ids_past_the_tables_are_named_in_training_and_evaluation(tk, device):
    """With ``validate_ids=False`` the Triton path still stops at an id past every row,
    named as the check would: evaluation's lookup checks its rows; a training step's
    lookup reads zeros for it and its update raises, having changed no row."""
    from recscale.modules.id_checks import IdOutOfRangeError

    ebc = _collection(device, "triton", "sum", "sgd", validate_ids=False)
    batch = random_jagged([t.num_rows for t in ebc.tables], 16, seed=2).to(device)
    batch.values[-1] = 1 << 40  # the last feature's last id
    named = r"id 1099511627776 of feature C2 \(sample \d+ of the batch\) is outside its table"
    with torch.no_grad(), pytest.raises(IdOutOfRangeError, match=named):
        ebc(batch.values, batch.offsets, batch.batch_size)
    before = ebc.groups[0].storage.weight.detach().clone()
    pooled = ebc(batch.values, batch.offsets, batch.batch_size)
    with pytest.raises(IdOutOfRangeError, match=named + ".*embedding.validate_ids is off"):
        pooled.sum().backward()
    assert torch.equal(ebc.groups[0].storage.weight.detach(), before)


def test_auto_never_picks_triton_on_the_cpu():
    t = torch.zeros(4, 8)
    assert kernels.choose("auto", "lookup", t, 8) != "triton"
    assert kernels.choose("auto", "backward", t, 8) != "triton"
