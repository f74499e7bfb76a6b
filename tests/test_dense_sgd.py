"""The dense SGD step as one native pass (train/dense_sgd.py, native/dense_sgd.c) against
torch.optim.SGD, and the bf16 weight copies it keeps for the next forward
(modules/bf16_weights.py) against torch's casts."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch

from recscale import native
from recscale.config import load_config
from recscale.config.schema import DenseOptimizerConfig
from recscale.distributed import DistContext
from recscale.modules import bf16_weights, gemm
from recscale.train import dense_sgd
from recscale.train.data_source import make_synthetic
from recscale.train.dense_sgd import SGDWithBF16Copies
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build
from recscale.train.step import backward_and_step, forward_loss

BF16 = torch.bfloat16
SHAPES = [(37, 13), (5,), (1000, 3), (1,), (129, 17), (16,)]


def _needs_native(wide: int) -> None:
    if not native.cpu_features() & native.CPU_AVX2:
        pytest.skip(native.status())
    if wide and not native.has_avx512():
        pytest.skip("no AVX-512 here: the AVX2 pass is what runs")


@pytest.fixture(params=[1, 0], ids=["avx512", "avx2"])
def width(request, monkeypatch):
    """Which pass runs (recscale_sgd_wide), restored after the test."""
    _needs_native(request.param)
    flag = ctypes.c_int.in_dll(native.library(), "recscale_sgd_wide")
    monkeypatch.setattr(dense_sgd, "BLOCK", 64)  # blocks end inside tensors and rows
    before = flag.value
    flag.value = request.param
    yield request.param
    flag.value = before


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        p.grad = None if (i == 3 and step % 2) else torch.randn(p.shape, generator=g) * 0.3


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("parallel", [False, True], ids=["one_thread", "split"])
def test_the_native_step_is_torchs_sgd_bit_for_bit(width, weight_decay, parallel, monkeypatch):
    """Two groups of odd-sized tensors (tails past the vector width, blocks cut inside
    tensors), a parameter without a gradient every other step, the learning rate changed
    between steps, on one thread and split over two: the weights equal torch's SGD's
    bit for bit, with their version counters bumped."""
    monkeypatch.setattr(dense_sgd, "_MIN_PARALLEL", 1 << 40 if not parallel else 0)
    ours, ref = _params(0), _params(0)

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.03}]

    opt = SGDWithBF16Copies(groups(ours), lr=0.1, weight_decay=weight_decay)
    want = torch.optim.SGD(groups(ref), lr=0.1, weight_decay=weight_decay)
    for step in range(6):
        _grads(ours, step)
        _grads(ref, step)
        versions = [p._version for p in ours]
        opt.step()
        want.step()
        for p, q, v in zip(ours, ref, versions):
            assert torch.equal(p, q), (step, p.shape)
            assert p._version > v or p.grad is None
        for o in (opt, want):
            o.param_groups[0]["lr"] *= 0.7
    assert opt.state_dict()["param_groups"] == want.state_dict()["param_groups"]


def test_the_kept_copies_are_torchs_casts(width):
    """A weight a forward read through bf16_copy gets its copy written by the step:
    ties, denormals, infinities and large values round as ``w.to(bf16)`` rounds (a NaN
    stays a NaN), and the next bf16_copy returns that copy, not a fresh cast."""
    w = torch.nn.Parameter(torch.randn(77, 9))
    b = torch.nn.Parameter(torch.randn(9))
    special = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1e-40, -1e-40, float("inf"),
         -float("inf"), float("nan"), 3.3895e38, -3.4e38, 0.0, -0.0],
    )  # fmt: skip
    opt = SGDWithBF16Copies([w, b], lr=0.5)
    first = bf16_weights.bf16_copy(w)  # the forward's read: a cast, and w is marked
    assert torch.equal(first, w.detach().to(BF16))
    assert bf16_weights.wanted(w) and not bf16_weights.wanted(b)
    w.grad = torch.randn_like(w)
    w.grad.view(-1)[: special.numel()] = 0.0
    with torch.no_grad():
        w.view(-1)[: special.numel()] = special
    b.grad = torch.randn_like(b)
    opt.step()
    kept = bf16_weights.bf16_copy(w)
    assert kept is bf16_weights.bf16_copy(w)  # the kept one, twice
    cast = w.detach().to(BF16)
    nan = torch.isnan(cast)
    assert torch.equal(torch.isnan(kept), nan) and nan.sum() == 1
    assert torch.equal(kept[~nan].view(torch.int16), cast[~nan].view(torch.int16))


def test_a_weight_changed_after_the_step_is_cast_afresh(width):
    """Any in-place change through torch after the step (load_state_dict, copy_, another
    optimizer's step) bumps the version, and the next read is the new value's cast."""
    w = torch.nn.Parameter(torch.randn(40, 24))
    opt = SGDWithBF16Copies([w], lr=0.1)
    bf16_weights.bf16_copy(w)
    w.grad = torch.randn_like(w)
    opt.step()
    kept = bf16_weights.bf16_copy(w)
    model = torch.nn.Linear(24, 40, bias=False)
    model.weight = w
    model.load_state_dict({"weight": torch.ones(40, 24)})
    assert torch.equal(bf16_weights.bf16_copy(w), torch.ones(40, 24, dtype=BF16))
    assert not torch.equal(kept, bf16_weights.bf16_copy(w))
    w.grad = torch.randn_like(w)
    opt.step()
    torch.optim.SGD([w], lr=0.1).step()
    assert torch.equal(bf16_weights.bf16_copy(w), w.detach().to(BF16))


def test_momentum_a_closure_or_a_strided_gradient_run_torchs_step(monkeypatch):
    """What the pass does not do falls back to torch's SGD, with its state; so does a
    step without the native library (``RECSCALE_NATIVE=0``, no C compiler)."""
    ours, ref = _params(1), _params(1)
    opt = SGDWithBF16Copies(ours, lr=0.1, momentum=0.9, nesterov=True)
    want = torch.optim.SGD(ref, lr=0.1, momentum=0.9, nesterov=True)
    for step in range(3):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        want.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))
    assert "momentum_buffer" in opt.state[ours[0]]
    plain = SGDWithBF16Copies(ours[:1], lr=0.1)
    ours[0].grad = torch.randn(13, 37).t()  # not contiguous
    ref[0].grad = ours[0].grad.clone()
    plain.step()
    torch.optim.SGD(ref[:1], lr=0.1).step()
    assert torch.equal(ours[0], ref[0])
    assert plain.step(lambda: torch.tensor(2.0)) == 2.0
    with torch.no_grad():
        ref[0].copy_(ours[0])  # the closure's step moved ours
    monkeypatch.setattr(native, "cpu_features", lambda: 0)
    called: list[int] = []
    monkeypatch.setattr(native, "parallel_call", lambda *a, **k: called.append(1))
    ours[0].grad = torch.randn(37, 13)
    ref[0].grad = ours[0].grad.clone()
    plain.step()
    torch.optim.SGD(ref[:1], lr=0.1).step()
    assert torch.equal(ours[0], ref[0]) and not called


def test_the_builder_takes_this_sgd_on_a_cpu_and_torchs_adam():
    opt = build_dense_optimizer(DenseOptimizerConfig(name="sgd", lr=0.1), _params(2))
    assert isinstance(opt, SGDWithBF16Copies)
    adam = build_dense_optimizer(DenseOptimizerConfig(name="adam"), _params(2))
    assert not isinstance(adam, SGDWithBF16Copies)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_is_bit_for_bit_torchs_sgd_and_casts(precision, monkeypatch):
    """The debug model trained 6 steps with SGD, the native step (and in bf16 its kept
    copies, read by the bf16 node) against torch's step and the forward's casts: the
    same weights, bit for bit."""
    _needs_native(0)
    if precision == "bf16" and not gemm.bf16_instructions():
        pytest.skip("no AVX512-BF16 or AMX: the bf16 node does not run here")
    cfg = load_config("debug", ["--optimizer.name=sgd", "--optimizer.lr=0.5"])
    ctx = DistContext(device=torch.device("cpu"))
    model, _, _ = build(cfg, ctx, lambda _m: None)
    twin = copy.deepcopy(model)
    data = make_synthetic(cfg)
    batches = [data.batch(i, 128) for i in range(6)]
    kept: list[int] = []
    real_keep = bf16_weights.keep
    monkeypatch.setattr(bf16_weights, "keep", lambda w, c: (kept.append(1), real_keep(w, c)))
    for use, m in ((True, model), (False, twin)):
        monkeypatch.setattr(dense_sgd, "USE", use)
        opt = build_dense_optimizer(cfg.optimizer, m.dense_parameters())
        for b in batches:
            loss = forward_loss(m, b, precision, torch.device("cpu"))
            backward_and_step(loss, opt, precision, torch.device("cpu"))
    assert bool(kept) == (precision == "bf16")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
