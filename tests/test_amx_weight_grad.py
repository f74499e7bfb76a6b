"""bf16 weight gradients on AMX tiles (``native/weight_grad_amx.c``) against float64,
and the rule of which layers take them. The kernel's tests run on a CPU with AMX-BF16
(and skip elsewhere); the dispatch rule is checked on any host."""

from __future__ import annotations

import pytest
import torch
from helpers import needs_amx, wgrad_operands

from recscale import native
from recscale.modules import gemm, gemm_amx

BF16 = torch.bfloat16


@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize(
    "batch,out,inp,strided",
    [
        (1, 1, 1, False),  # one sample: 31 zero samples in its step, one row, one column
        (33, 17, 45, True),  # two steps, the second with one sample; edge tiles both ways
        (64, 32, 32, False),  # one pair of tiles each way, two whole steps
        (67, 40, 29, True),  # odd everything
        (300, 100, 130, False),  # several pairs of tiles split over two threads
        (2100, 96, 48, True),  # more samples than a block of steps (2048)
        (256, 512, 13, False),  # a narrow input: x^T g, transposed back, the bias from g
        (129, 100, 7, True),  # narrow and strided
        (257, 1, 256, False),  # a logit's gradient: one row of 32
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_weight_grad_is_the_fp32_sum_of_exact_products(
    batch, out, inp, strided, bias_grad, threads
):
    """dW = g^T x and db = g.sum(0) of bf16 operands, in fp32: each product of two bf16
    values is exact, so against float64 only the fp32 sums differ (edge tiles and steps,
    padding, strided rows, the narrow swap, one and two threads)."""
    needs_amx()
    g, x = wgrad_operands(batch, out, inp, strided, BF16)
    dw, db = gemm_amx.weight_grad(g, x, bias_grad, threads)
    assert dw.dtype == torch.float32 and dw.shape == (out, inp) and dw.is_contiguous()
    want = g.double().t() @ x.double()
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5 * (batch + 1))
    if bias_grad:
        assert db.dtype == torch.float32 and db.shape == (out,)
        torch.testing.assert_close(
            db.double(), g.double().sum(0), rtol=1e-5, atol=1e-5 * (batch + 1)
        )
    else:
        assert db is None


def test_amx_weight_grad_gives_the_same_bits_on_any_split():
    """Each result is one thread's, summed in sample order: one thread and two agree
    bit for bit (a run resumes bitwise whatever the team's split)."""
    needs_amx()
    g, x = wgrad_operands(700, 96, 160, True, BF16)
    one, two = gemm_amx.weight_grad(g, x, True, 1), gemm_amx.weight_grad(g, x, True, 2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_no_samples_give_zero_gradients():
    needs_amx()
    g, x = torch.zeros(0, 40, dtype=BF16), torch.zeros(0, 20, dtype=BF16)
    dw, db = gemm_amx.weight_grad(g, x, True, 2)
    assert torch.equal(dw, torch.zeros(40, 20)) and torch.equal(db, torch.zeros(40))


@pytest.mark.parametrize("declines", [False, True])
def test_large_bf16_layers_take_the_amx_kernel_and_small_ones_onednn(declines, monkeypatch):
    """On an AMX CPU (any host: the CPU and the kernel stood in for) a layer with at least
    _AMX_MIN_WEIGHTS weights goes to the kernel, a smaller one to oneDNN's GEMM (rounded
    to bf16, widened); a kernel that declines (no tile grant) leaves it to oneDNN too."""
    calls = []

    def kernel(g, x, bias_grad, threads):
        calls.append((g.shape[1], x.shape[1]))
        if declines:
            return None
        return (g.float().t() @ x.float()), g.float().sum(0)

    monkeypatch.setattr(gemm_amx, "weight_grad", kernel)
    monkeypatch.setattr(gemm_amx, "ready", lambda: True)
    monkeypatch.setattr(native, "cpu_features", lambda: 15)  # AVX2 .. AMX-BF16
    monkeypatch.setattr(gemm, "_AMX_MIN_WEIGHTS", 64 * 32)
    assert gemm.amx_wgrad() and not gemm.native_bf16_wgrad()
    gen = torch.Generator().manual_seed(1)
    for out, inp in ((16, 16), (64, 32)):
        g = torch.randn(50, out, generator=gen).to(BF16)
        x = torch.randn(50, inp, generator=gen).to(BF16)
        dw, db = gemm.weight_grad(g, x, bias_grad=True)
        assert dw.dtype == db.dtype == torch.float32
        want = g.double().t() @ x.double()
        torch.testing.assert_close(dw.double(), want, rtol=1e-2, atol=5e-2)
        torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-2, atol=5e-2)
    assert calls == [(64, 32)]


def test_switched_off_an_amx_cpu_takes_onednn_not_the_avx512_bf16_kernel(monkeypatch):
    """``USE_AMX_WGRAD`` off, an AMX CPU still leaves the AVX512-BF16 kernel alone (it
    runs at a sixth of the tiles' rate there): oneDNN's GEMM."""
    monkeypatch.setattr(native, "cpu_features", lambda: 15)
    monkeypatch.setattr(gemm_amx, "ready", lambda: True)
    assert gemm.amx_wgrad()
    monkeypatch.setattr(gemm, "USE_AMX_WGRAD", False)
    assert not gemm.amx_wgrad() and not gemm.native_bf16_wgrad()
