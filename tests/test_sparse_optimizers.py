"""Each fused sparse optimizer vs an independent dense reference, step by step.

Every batch hits some rows several times (within a bag and across bags), so the
duplicate merge is exercised; rows not touched must stay exactly unchanged.
"""

import pytest
import torch
from torch import nn

from recscale.embedding.optimizers import SparseAdam, SparseRowwiseAdagrad, SparseSGD
from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec

ROWS, DIM, B, STEPS = 12, 5, 8, 6
# (kernel, dim): the native C kernels need a dim that is a multiple of 8
KERNELS = [("torch", DIM), ("numba", DIM), ("native", 16)]


def _batches(dim=DIM):
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (B,), generator=g)
        values = torch.randint(
            0, 5, (int(lengths.sum()),), generator=g
        )  # rows 0-4 only: heavy reuse
        offsets = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        upstream = torch.randn(B, dim, generator=g)
        yield values, offsets, upstream


def _run_fused(make_opt, kernel, dim):
    ebc = EmbeddingBagCollection([TableSpec("C1", ROWS, dim)], "sum", make_opt, kernel=kernel)
    w0 = ebc.groups[0].storage.weight.clone()
    history = []
    for values, offsets, upstream in _batches(dim):
        (ebc(values, offsets, B) * upstream).sum().backward()
        history.append(ebc.groups[0].storage.weight.clone())
    return w0, history


@pytest.mark.parametrize("kernel,dim", KERNELS)
def test_sgd_matches_torch_sgd(kernel, dim):
    w0, fused = _run_fused(lambda: SparseSGD(lr=0.3), kernel, dim)
    param = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([param], lr=0.3)
    for step, (values, offsets, upstream) in enumerate(_batches(dim)):
        opt.zero_grad()
        (
            nn.functional.embedding_bag(
                values, param, offsets, mode="sum", include_last_offset=True
            )
            * upstream
        ).sum().backward()
        opt.step()
        torch.testing.assert_close(fused[step], param.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel,dim", KERNELS)
def test_rowwise_adagrad_matches_dense_reference(kernel, dim):
    lr, eps = 0.5, 1e-8
    w0, fused = _run_fused(lambda: SparseRowwiseAdagrad(lr=lr, eps=eps), kernel, dim)
    w = w0.clone()
    acc = torch.zeros(ROWS)
    batches = list(_batches(dim))
    for step in range(STEPS):
        values, offsets, upstream = batches[step]
        bag = nn.EmbeddingBag.from_pretrained(
            w.clone(), freeze=False, mode="sum", include_last_offset=True
        )
        (bag(values, offsets) * upstream).sum().backward()
        grad = bag.weight.grad
        for r in torch.unique(values).tolist():  # straightforward per-row loop
            acc[r] += (grad[r] ** 2).mean()
            w[r] -= lr * grad[r] / (acc[r].sqrt() + eps)
        torch.testing.assert_close(fused[step], w, rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(ROWS)) - set(torch.cat([b[0] for b in batches]).tolist()))
    assert untouched and torch.equal(fused[-1][untouched], w0[untouched])


@pytest.mark.parametrize("kernel,dim", KERNELS)
def test_adam_matches_torch_sparse_adam(kernel, dim):
    lr, b1, b2, eps = 0.05, 0.8, 0.95, 1e-8
    w0, fused = _run_fused(lambda: SparseAdam(lr=lr, beta1=b1, beta2=b2, eps=eps), kernel, dim)
    bag = nn.EmbeddingBag.from_pretrained(
        w0.clone(), freeze=False, mode="sum", include_last_offset=True, sparse=True
    )
    opt = torch.optim.SparseAdam(bag.parameters(), lr=lr, betas=(b1, b2), eps=eps)
    for step, (values, offsets, upstream) in enumerate(_batches(dim)):
        opt.zero_grad()
        (bag(values, offsets) * upstream).sum().backward()
        opt.step()
        torch.testing.assert_close(fused[step], bag.weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_opt",
    [lambda: SparseSGD(0.1), lambda: SparseRowwiseAdagrad(0.1), lambda: SparseAdam(0.01)],
)
def test_state_shapes_are_per_row(make_opt):
    ebc = EmbeddingBagCollection([TableSpec("C1", ROWS, DIM)], "sum", make_opt)
    for t in ebc.groups[0].storage.optimizer_state().values():
        assert t.shape[0] == ROWS


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_dense_optimizer_steps_match_the_update_rule(name):
    """build_dense_optimizer (whichever torch implementation it picks: fused, foreach)
    against the update written out, three steps, weight decay on."""
    from recscale.config.schema import DenseOptimizerConfig
    from recscale.train.optimizers import build_dense_optimizer

    lr, wd, eps, (b1, b2) = 0.1, 0.01, 1e-8, (0.9, 0.999)
    g = torch.Generator().manual_seed(0)
    params = [
        nn.Parameter(torch.randn(7, 5, generator=g)),
        nn.Parameter(torch.randn(5, generator=g)),
    ]
    want = [p.detach().clone() for p in params]
    state = [[torch.zeros_like(w), torch.zeros_like(w)] for w in want]
    opt = build_dense_optimizer(
        DenseOptimizerConfig(name=name, lr=lr, weight_decay=wd, eps=eps), params
    )
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        for w, (m, v), grad in zip(want, state, grads):
            d = grad + wd * w
            if name == "sgd":
                w -= lr * d
            elif name == "adagrad":
                m += d * d
                w -= lr * d / (m.sqrt() + eps)
            else:
                m.mul_(b1).add_((1 - b1) * d)
                v.mul_(b2).add_((1 - b2) * d * d)
                m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
                w -= lr * m_hat / (v_hat.sqrt() + eps)
        for p, w in zip(params, want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)


def test_small_dense_optimizer_steps_on_one_thread_and_restores_the_count():
    """Below 4M parameters a CPU step takes one intra-op thread (waking the others per
    tensor costs more than they save); the caller's thread count is back afterwards."""
    from recscale.config.schema import DenseOptimizerConfig
    from recscale.train.optimizers import build_dense_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        param = nn.Parameter(torch.randn(8, 4))
        opt = build_dense_optimizer(DenseOptimizerConfig(name="adam"), [param])
        during: list[int] = []
        opt.register_step_pre_hook(lambda *_: during.append(torch.get_num_threads()))
        param.grad = torch.randn(8, 4)
        opt.step()
        assert during == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
