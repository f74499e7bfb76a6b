"""bf16 input gradients on AMX tiles with the ReLU mask applied as they are stored
(``native/input_grad_amx.c``) against float64 and torch's ``threshold_backward``, and
the rule of which layers take them. The kernel's tests run on a CPU with AMX-BF16 (and
skip elsewhere); the rule and the path without the kernel are checked on any host."""

from __future__ import annotations

import ctypes

import pytest
import torch
from helpers import needs_amx

from recscale import native
from recscale.modules import gemm, gemm_amx

BF16 = torch.bfloat16


def _operands(batch: int, k: int, n: int, strided: bool):
    """``g [batch, k]``, ``w [k, n]`` and a ReLU output ``x [batch, n]`` holding every
    kind of value the mask sees: zeros of both signs, negatives, NaN of both signs, inf."""
    gen = torch.Generator().manual_seed(batch + k + n)
    pad = 5 if strided else 0
    g = torch.randn(batch, k + pad, generator=gen).to(BF16)[:, pad:]
    w = torch.randn(k, n, generator=gen).to(BF16)
    x = torch.randn(batch, n + 2 * pad, generator=gen).to(BF16)[:, :n]
    specials = torch.tensor(
        [0.0, -0.0, -1.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-38],
        dtype=BF16,
    )
    flat = torch.randint(0, batch * n, (min(batch * n, 64),), generator=gen)
    rows, cols = flat // n, flat % n
    x[rows, cols] = specials[torch.arange(len(flat)) % len(specials)]
    return g, w, x


@pytest.mark.parametrize(
    "batch,k,n,strided",
    [
        (1, 32, 1, False),  # one sample: 31 zero rows in its block; one column
        (33, 64, 17, True),  # two blocks, the second with one sample; an edge column tile
        (64, 32, 32, False),  # whole blocks, one pair of column tiles
        (77, 96, 40, True),  # odd batch, three steps of k, a half pair of column tiles
        (300, 512, 368, False),  # config A's top input gradient shape, smaller batch
        (130, 320, 100, True),  # three chunks of k (K_CHUNK = 8 steps) with a short last
        (70, 1, 256, True),  # a logit layer's input gradient: k = 1, padded to 32
        (77, 16, 64, False),  # k = 16: half a step
        (40, 45, 33, True),  # k past one step by 13
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("round_only", [0, 1])
def test_amx_input_grad_is_the_rounded_fp32_product_masked_like_torch(
    batch, k, n, strided, threads, round_only, monkeypatch
):
    """fp32 out: g . w against float64 to fp32 sums (each bf16 product is exact). bf16 out:
    exactly the fp32 result rounded to bf16 (to nearest even, as torch rounds) and then
    masked as ``threshold_backward`` masks it (zero where x <= 0; a NaN keeps its
    gradient), which is also torch's own masked result to within a bf16 rounding. Both
    conversions: vcvtne2ps2bf16 and the integer rounding of CPUs without AVX512-BF16."""
    needs_amx()
    hook = ctypes.c_int.in_dll(native.library(), "recscale_igrad_round_only")
    monkeypatch.setattr(hook, "value", round_only)
    monkeypatch.setattr(gemm_amx, "_PACK_MIN_PARALLEL", 0)  # W's packing split too
    g, w, x = _operands(batch, k, n, strided)
    f32, none, no_dw = gemm_amx.input_grad(g, w, None, torch.float32, threads)
    assert f32.dtype == torch.float32 and f32.shape == (batch, n) and none is no_dw is None
    want = g.double() @ w.double()
    torch.testing.assert_close(f32.double(), want, rtol=1e-5, atol=1e-5 * k)
    got, db, dw = gemm_amx.input_grad(g, w, x, BF16, threads, bias_grad=True, x=x)
    assert got.dtype == BF16 and got.shape == (batch, n) and got.is_contiguous()
    masked = torch.ops.aten.threshold_backward(f32.to(BF16), x, 0.0)
    assert torch.equal(got.view(torch.int16), masked.view(torch.int16))
    assert db.dtype == torch.float32 and db.shape == (k,)  # the bias gradient, in fp32
    torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-5, atol=1e-5 * batch)
    # the weight gradient from the same pass: the AMX weight-gradient kernel's own bits
    assert dw.dtype == torch.float32 and dw.shape == (k, n)
    dw_alone, _ = gemm_amx.weight_grad(g, x, False, threads)
    assert torch.equal(dw.view(torch.int32), dw_alone.view(torch.int32))  # NaN columns too
    want_dw = g.double().t() @ x.double().nan_to_num(posinf=0.0, neginf=0.0)
    finite = x.isfinite().all(0)  # a column holding NaN or inf has a non-finite gradient
    torch.testing.assert_close(
        dw.double()[:, finite], want_dw[:, finite], rtol=1e-5, atol=1e-5 * (batch + 1)
    )
    # an input without a mask (an MLP's first layer): its weight gradient all the same
    f32_alone, _, dw_no_mask = gemm_amx.input_grad(g, w, None, torch.float32, threads, x=x)
    assert torch.equal(f32_alone, f32)
    assert torch.equal(dw_no_mask.view(torch.int32), dw_alone.view(torch.int32))
    f32_masked, _, _ = gemm_amx.input_grad(g, w, x, torch.float32, threads)
    assert torch.equal(f32_masked, torch.ops.aten.threshold_backward(f32, x.float(), 0.0))
    plain, _, _ = gemm_amx.input_grad(g, w, None, BF16, threads)
    assert torch.equal(plain.view(torch.int16), f32.to(BF16).view(torch.int16))


def test_amx_input_grad_gives_the_same_bits_on_any_split():
    """Each output is one thread's, summed in a fixed order, and the bias sums go by
    blocks of 32 samples: one thread and two agree bit for bit."""
    needs_amx()
    g, w, x = _operands(1000, 256, 200, False)
    one, db1, dw1 = gemm_amx.input_grad(g, w, x, BF16, 1, bias_grad=True, x=x)
    two, db2, dw2 = gemm_amx.input_grad(g, w, x, BF16, 2, bias_grad=True, x=x)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    assert torch.equal(db1, db2) and torch.equal(dw1.view(torch.int32), dw2.view(torch.int32))


def test_amx_input_grad_of_no_samples_is_empty():
    needs_amx()
    g, w, _ = _operands(1, 64, 48, False)
    x = torch.zeros(0, 48, dtype=BF16)
    out, db, dw = gemm_amx.input_grad(g[:0], w, x, torch.float32, 2, True, x)
    assert out.shape == (0, 48) and torch.equal(db, torch.zeros(64))
    assert torch.equal(dw, torch.zeros(64, 48))


@pytest.mark.parametrize("kernel", [True, False])
def test_input_grad_agrees_with_or_without_the_kernel(kernel, monkeypatch):
    """``gemm.input_grad`` on the kernel (where AMX is) and on torch's GEMM and mask (any
    host): the same masked product to a bf16 rounding, fp32 when asked; the bias gradient
    from the kernel's pass, else None (the caller sums)."""
    monkeypatch.setattr(gemm, "USE_AMX_IGRAD", kernel)
    g, w, x = _operands(70, 64, 50, True)
    want = (g.double() @ w.double()).where(~(x <= 0), torch.zeros((), dtype=torch.float64))
    got, db, dw = gemm.input_grad(g, w, x, BF16, bias_grad=True, x=x)
    assert got.dtype == BF16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    if kernel and gemm_amx.ready():
        torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-5, atol=1e-4)
        assert torch.equal(
            dw.view(torch.int32), gemm_amx.weight_grad(g, x, False, 1)[0].view(torch.int32)
        )
    else:
        assert db is None and dw is None
    got32, _, _ = gemm.input_grad(g, w, None, torch.float32)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), g.double() @ w.double(), rtol=1e-2, atol=1e-2)


def test_which_input_gradient_runs(monkeypatch):
    """The kernel takes bf16 layers of more than one output (a logit's stays on torch's
    outer product) and at most 2^19 weights; the rest (and every layer without AMX) run
    torch's GEMM and mask.
    The kernel stood in for by a recorder, so the rule is checked on any host."""
    calls = []

    def recorder(g, w, mask, out_dtype, threads, bias_grad, x):
        calls.append((tuple(w.shape), mask is not None, out_dtype, threads))
        return torch.zeros(g.shape[0], w.shape[1], dtype=out_dtype), None, None

    monkeypatch.setattr(gemm_amx, "input_grad", recorder)
    monkeypatch.setattr(gemm_amx, "ready", lambda: True)
    monkeypatch.setattr(gemm, "USE_AMX_IGRAD", True)

    def runs_kernel(batch, k, n, dtype=BF16, out_dtype=BF16):
        calls.clear()
        g = torch.zeros(batch, k, dtype=dtype)
        w = torch.zeros(k, n, dtype=dtype)
        gemm.input_grad(g, w, torch.zeros(batch, n, dtype=dtype), out_dtype)
        return bool(calls)

    assert runs_kernel(2048, 256, 512)  # config A's 512 -> 256
    assert runs_kernel(2048, 512, 368, out_dtype=torch.float32)  # A's first top layer
    assert runs_kernel(2048, 16, 64)  # 64 -> 16: half a step of k
    assert runs_kernel(77, 64, 40)  # a small batch
    assert not runs_kernel(2048, 1, 256)  # a logit's (256 -> 1)
    assert runs_kernel(2048, 512, 1024)  # config B's 1024 -> 512: 2^19 weights
    assert not runs_kernel(2048, 1024, 1024)  # 2^20 weights: oneDNN is faster there
    assert not runs_kernel(2048, 256, 512, dtype=torch.float32)  # fp32 has its own GEMMs
    monkeypatch.setattr(gemm_amx, "ready", lambda: False)
    assert not runs_kernel(2048, 256, 512)  # no AMX here
