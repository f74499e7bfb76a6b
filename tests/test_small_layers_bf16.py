"""The bf16 node's small layers (``native/small_layers_bf16.c``): a logit layer's backward
against torch's product and ``threshold_backward`` bit for bit and float64 sums, a
narrow first layer's weight gradient against float64, the same bits on any number of
threads, and the rule of which layers take them. The kernels' tests run on a CPU with
AVX512-BF16 (and skip elsewhere); the rule is checked on any host."""

from __future__ import annotations

import pytest
import torch

from recscale import native
from recscale.modules import small_layers_bf16 as small

BF16 = torch.bfloat16


def _needs_kernels() -> None:
    if not small.available():
        pytest.skip(f"no AVX512-BF16 here: {native.status()}")


def _on_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF16 else torch.int32)


def _logit_operands(batch: int, n: int, strided: bool):
    """``h [batch, n]`` (a ReLU output with every kind of value the mask sees: zeros of
    both signs, negatives, NaN of both signs, inf), ``w [1, n]``, ``dz [batch, 1]``."""
    gen = torch.Generator().manual_seed(batch * 7 + n)
    pad = 3 if strided else 0
    h = torch.randn(batch, n + pad, generator=gen).relu().to(BF16)[:, pad:]
    specials = torch.tensor(
        [0.0, -0.0, -1.0, float("nan"), -float("nan"), float("inf"), 1e-38], dtype=BF16
    )
    flat = torch.randint(0, batch * n, (min(batch * n, 40),), generator=gen)
    h[flat // n, flat % n] = specials[torch.arange(len(flat)) % len(specials)]
    w = torch.randn(1, n, generator=gen).to(BF16)
    dz = torch.randn(batch, 1, generator=gen).to(BF16)
    return h, w, dz


@pytest.mark.parametrize(
    "batch,n,strided",
    [
        (1, 1, False),  # one sample, one input
        (63, 17, True),  # a short block; a column tail past one vector
        (64, 256, False),  # one whole block, config A's width
        (130, 300, True),  # three blocks (the last of 2); past one chunk of 256 columns
        (2048, 256, False),  # config A's logit
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_logit_backward_is_torchs_masked_product_and_float64_sums(batch, n, strided, threads):
    """``dh`` is ``threshold_backward(dz * w, h, 0)`` bit for bit (torch's rounding of a
    bf16 product, a NaN in h keeping its gradient); ``dw`` and ``db`` are float64's sums
    to fp32 accuracy (each product of two bf16 values is exact in fp32), over the finite
    entries of h."""
    _needs_kernels()
    h, w, dz = _logit_operands(batch, n, strided)
    dh, dw, db = _on_threads(threads, lambda: small.logit_backward(h, w, dz, True, True))
    want = torch.ops.aten.threshold_backward(dz * w, h, 0.0)
    assert dh.dtype == BF16 and dh.shape == (batch, n)
    assert torch.equal(dh.view(torch.int16), want.view(torch.int16))
    finite = torch.isfinite(h).all(0)
    ref = (dz.double().t() @ torch.where(torch.isfinite(h), h, 0).double())[0]
    assert dw.shape == (1, n) and dw.dtype == torch.float32
    torch.testing.assert_close(dw[0][finite].double(), ref[finite], rtol=1e-5, atol=1e-5)
    assert torch.isnan(dw[0][~finite & torch.isnan(h).any(0)]).all()
    assert db.shape == (1,)
    torch.testing.assert_close(db.double(), dz.double().sum().reshape(1), rtol=1e-6, atol=1e-6)


def test_logit_backward_without_mask_or_input_gradient():
    """``mask=False``: the product everywhere (h need not be a ReLU output);
    ``input_grad=False``: no dh, the same dw and db; no samples: zeros."""
    _needs_kernels()
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(77, 40, generator=gen).to(BF16)  # negatives kept
    w = torch.randn(1, 40, generator=gen).to(BF16)
    dz = torch.randn(77, 1, generator=gen).to(BF16)
    dh, dw, db = small.logit_backward(h, w, dz, False, True)
    assert torch.equal(dh.view(torch.int16), (dz * w).view(torch.int16))
    none, dw2, db2 = small.logit_backward(h, w, dz, True, False)
    assert none is None and torch.equal(dw, dw2) and torch.equal(db, db2)
    empty = small.logit_backward(h[:0], w, dz[:0], True, True)
    assert empty[0].shape == (0, 40) and not empty[1].any() and not empty[2].any()


@pytest.mark.parametrize(
    "batch,out,n_in,strided",
    [
        (1, 16, 1, False),  # one sample (paired with zero), one input
        (37, 20, 5, True),  # odd batch; outputs past one block of 16 but short of 32
        (64, 64, 16, False),  # two blocks of 32 outputs; inputs past one register pass
        (2048, 512, 13, False),  # config A's first layer
        (99, 130, 32, True),  # the widest narrow input: three passes; a short last block
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_narrow_weight_grad_is_the_fp32_sum_of_exact_products(batch, out, n_in, strided, threads):
    """``dw = g^T x`` and ``db = g.sum(0)`` against float64: fp32 sums of exact products
    (pairs of samples through vdpbf16ps), contiguous ``[out, in]``."""
    _needs_kernels()
    gen = torch.Generator().manual_seed(batch + out + n_in)
    pad = 4 if strided else 0
    g = torch.randn(batch, out + pad, generator=gen).to(BF16)[:, pad:]
    x = torch.randn(batch, n_in + pad, generator=gen).to(BF16)[:, :n_in]
    dw, db = _on_threads(threads, lambda: small.narrow_weight_grad(g, x, True))
    assert dw.shape == (out, n_in) and dw.is_contiguous() and dw.dtype == torch.float32
    torch.testing.assert_close(dw.double(), g.double().t() @ x.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-5, atol=1e-4)
    dw_only, none = small.narrow_weight_grad(g, x, False)
    assert none is None and torch.equal(dw_only, dw)


def test_small_layers_give_the_same_bits_on_one_and_two_threads():
    """Each output is one thread's sum (narrow) or a block's partial added in block order
    (logit): the same bits however the threads split the work."""
    _needs_kernels()
    h, w, dz = _logit_operands(1000, 256, False)
    one = _on_threads(1, lambda: small.logit_backward(h, w, dz, True, True))
    two = _on_threads(2, lambda: small.logit_backward(h, w, dz, True, True))
    for a, b in zip(one, two):  # as bits: dw holds NaN where a column of h does
        assert torch.equal(_bits(a), _bits(b))
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(1001, 512, generator=gen).to(BF16)
    x = torch.randn(1001, 13, generator=gen).to(BF16)
    one = _on_threads(1, lambda: small.narrow_weight_grad(g, x, True))
    two = _on_threads(2, lambda: small.narrow_weight_grad(g, x, True))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    empty = small.narrow_weight_grad(g[:0], x[:0], True)
    assert not empty[0].any() and not empty[1].any()


def test_which_layers_take_the_small_kernels(monkeypatch):
    """A logit ``[1, n]`` over bf16 rows; a narrow input (<= 32, at most a quarter of the
    outputs); not fp32, not column-strided rows, not where the CPU lacks AVX512-BF16 or
    the switch is off."""
    monkeypatch.setattr(native, "cpu_features", lambda: native.CPU_AVX512_BF16)
    h, w = torch.zeros(8, 256, dtype=BF16), torch.zeros(1, 256, dtype=BF16)
    assert small.logit_applies(h, w)
    assert not small.logit_applies(h.float(), w)
    assert not small.logit_applies(h, torch.zeros(2, 256, dtype=BF16))
    assert not small.logit_applies(h.t().contiguous().t(), w)
    g, x = torch.zeros(8, 512, dtype=BF16), torch.zeros(8, 13, dtype=BF16)
    assert small.narrow_applies(g, x)
    assert not small.narrow_applies(g, torch.zeros(8, 33, dtype=BF16))  # too wide
    assert not small.narrow_applies(torch.zeros(8, 40, dtype=BF16), x)  # 4 x 13 > 40
    assert not small.narrow_applies(g, torch.zeros(9, 13, dtype=BF16))  # other batch
    monkeypatch.setattr(small, "USE", False)
    assert not small.logit_applies(h, w) and not small.narrow_applies(g, x)
    monkeypatch.setattr(small, "USE", True)
    monkeypatch.setattr(native, "cpu_features", lambda: native.CPU_AVX512F | native.CPU_AVX2)
    assert not small.logit_applies(h, w) and not small.narrow_applies(g, x)
