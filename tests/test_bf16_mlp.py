"""bf16 MLPs on a CPU: the native bf16 weight gradient (``native/weight_grad_bf16.c``)
against float64, and the bf16 autograd node (``modules/mlp.py``'s ``_FusedMLPBF16``)
against a float64 emulation of the same rounding points."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_resume_identical, weight_grad_on_two_threads, wgrad_operands

from recscale import native
from recscale.modules import gemm, gemm_amx, small_layers_bf16
from recscale.modules.mlp import MLP, fused_bf16_applies

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _kernel_on_amx_too(monkeypatch):
    """An AMX CPU has AVX512-BF16 too: its kernel is held to the same references there."""
    monkeypatch.setattr(gemm, "_BF16_KERNEL_ON_AMX", True)


def _needs_native_bf16() -> None:
    if not gemm.native_bf16_wgrad():
        pytest.skip(f"no AVX512-BF16 weight-gradient kernel here: {native.status()}")


@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize(
    "batch,out,inp,strided",
    [
        (0, 7, 9, False),  # no samples: zero gradients
        (1, 6, 1, False),  # one sample (a pair with zero), one column
        (300, 1, 256, False),  # a logit's weight gradient: one row of one edge tile
        (127, 6, 16, False),  # a block of 64 pairs minus one sample (the odd one alone)
        (129, 13, 17, True),  # two blocks and one sample; edge tile rows 1, columns 1
        (300, 70, 130, True),  # split over two threads; 3 column blocks, the last 2 wide
        (257, 64, 50, False),  # 4-row edge tile, 4 vectors with the last 2 lanes
        (256, 512, 13, False),  # a narrow input: operands swapped, the bias from xs
        (129, 100, 7, True),  # narrow and strided
        (600, 8, 20, False),  # samples split into odd parts
    ],
)
@pytest.mark.parametrize("split", ["outputs", "samples"])
def test_native_bf16_weight_grad_is_the_fp32_sum_of_exact_products(
    batch, out, inp, strided, bias_grad, split, monkeypatch
):
    """dW = g^T x and db = g.sum(0) of bf16 operands, in fp32: each product of two bf16
    values is exact, so against float64 of the same values only fp32 sums differ (every
    edge: pairs of samples with an odd one out, partial tiles and vectors, blocks across
    threads, strided rows, the outputs or the samples split)."""
    _needs_native_bf16()
    monkeypatch.setattr(gemm, "_WGRAD_MIN_MACS", 0)  # threads on however little work
    monkeypatch.setattr(gemm, "_WGRAD_BATCH_SPLIT_BYTES", 0 if split == "outputs" else 1 << 40)
    g, x = wgrad_operands(batch, out, inp, strided, BF16)
    assert gemm._native_bf16_wgrad_applies(g, x)
    dw, db = weight_grad_on_two_threads(g, x, bias_grad)
    assert dw.dtype == torch.float32 and dw.shape == (out, inp) and dw.is_contiguous()
    want = g.double().t() @ x.double()
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5 * (batch + 1))
    if bias_grad:
        assert db.dtype == torch.float32
        torch.testing.assert_close(
            db.double(), g.double().sum(0), rtol=1e-5, atol=1e-5 * (batch + 1)
        )
    else:
        assert db is None


def test_bf16_weight_grad_without_the_kernel_is_fp32_too(monkeypatch):
    """Where the kernel does not run (AMX, no AVX512-BF16, or switched off) the gradients
    of bf16 operands still come back in fp32: torch's bf16 GEMM and a bf16 bias sum (fp32
    sums, rounded to bf16 once), widened."""
    monkeypatch.setattr(gemm, "USE_NATIVE_WGRAD", False)
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(70, 24, generator=gen).to(BF16), torch.randn(70, 40, generator=gen).to(BF16)
    dw, db = gemm.weight_grad(g, x, bias_grad=True)
    assert dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(dw.double(), g.double().t() @ x.double(), rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-2, atol=5e-2)


def test_which_bf16_weight_gradient_runs(monkeypatch):
    """The rule: the AVX512-BF16 kernel on a CPU with it and no AMX; on an AMX CPU the
    tiles (our kernel where the OS grants them, else oneDNN's GEMM), never vdpbf16ps (a
    sixth of their rate); the bf16 node wherever there are bf16 instructions."""
    avx512 = native.CPU_AVX2 | native.CPU_AVX512F
    amx = avx512 | native.CPU_AVX512_BF16 | native.CPU_AMX_BF16
    cases = [  # features, tiles granted -> (AVX512-BF16 kernel, AMX kernel, node)
        (avx512 | native.CPU_AVX512_BF16, False, (True, False, True)),
        (amx, True, (False, True, True)),
        (amx, False, (False, False, True)),
        (avx512, False, (False, False, False)),
        (0, False, (False, False, False)),  # no library
    ]
    monkeypatch.setattr(gemm, "_BF16_KERNEL_ON_AMX", False)
    for features, granted, want in cases:
        monkeypatch.setattr(native, "cpu_features", lambda f=features: f)
        monkeypatch.setattr(gemm_amx, "ready", lambda g=granted: g)
        got = (gemm.native_bf16_wgrad(), gemm.amx_wgrad(), gemm.bf16_instructions())
        assert got == want, (features, granted)


def _emulate(x, weights, biases, final_relu, upstream, round_grads=lambda li: False):
    """The bf16 node's arithmetic in float64 with its rounding points: bf16 operands and
    activations, fp32 bias (bf16 for a logit, as autocast's addmm), sums unrounded
    (``round_grads(li)``: layer li's weight and bias gradients rounded to bf16, as
    oneDNN's GEMM gives them on an AMX CPU)."""

    def bf(t: torch.Tensor) -> torch.Tensor:
        return t.to(BF16).double()

    n = len(weights)
    h = bf(x)
    acts = [h]
    for li, (w, b) in enumerate(zip(weights, biases)):
        logit = w.shape[0] == 1
        z = h @ bf(w).t() + (bf(b) if logit else b.double())
        if li < n - 1 or final_relu:
            z = z.clamp_min(0)
        h = bf(z)
        acts.append(h)
    g = bf(upstream)
    if final_relu:
        g = g * (acts[n] > 0)
    grads, grad_x = [None] * (2 * n), None
    for li in range(n - 1, -1, -1):
        w = bf(weights[li])
        grads[2 * li], grads[2 * li + 1] = g.t() @ acts[li], g.sum(0)
        if round_grads(li):
            grads[2 * li], grads[2 * li + 1] = bf(grads[2 * li]), bf(grads[2 * li + 1])
        g_in = bf(g * w) if w.shape[0] == 1 else bf(g @ w)
        if li > 0:
            g = g_in * (acts[li] > 0)
        else:
            grad_x = g_in
    return h, grad_x, grads


@pytest.mark.parametrize(
    "in_dim,widths,final_relu,input_grad",
    [
        (13, [64, 32, 16], True, False),  # a bottom MLP: narrow input, ReLU at the end
        (40, [48, 24, 1], False, True),  # a top MLP ending in a logit, its input's gradient
        (29, [16], True, True),  # one layer
        (40, [64, 32, 1], False, True),  # AMX input gradients, whole steps of k: fp32, masked
    ],
)
@pytest.mark.parametrize("wgrad", ["native", "amx", "onednn", "onednn+small"])
def test_bf16_mlp_node_matches_a_float64_emulation_of_its_rounding(
    in_dim, widths, final_relu, input_grad, wgrad, monkeypatch
):
    """Forward and backward of the bf16 node against float64 with the same bf16 rounding
    points: agreement to fp32 sums, from the AVX512-BF16 kernel or the AMX one. autocast's
    modules, which round the weight gradients to bf16, sit further from it. With oneDNN's
    weight gradients (an AMX CPU's for small layers) the node's gradients are the
    emulation's rounded to bf16, to a unit in the last place where fp32 sums in another
    order round the other way - but for a logit below a ReLU and a narrow first layer,
    whose own kernels (``small_layers_bf16``, "onednn+small") give fp32 sums."""
    small = wgrad == "onednn+small"
    monkeypatch.setattr(small_layers_bf16, "USE", small or wgrad != "onednn")
    if small and not small_layers_bf16.available():
        pytest.skip(f"no AVX512-BF16 here: {native.status()}")
    if wgrad == "native":
        _needs_native_bf16()
    elif wgrad == "amx":
        monkeypatch.setattr(gemm, "_BF16_KERNEL_ON_AMX", False)
        monkeypatch.setattr(gemm, "_AMX_MIN_WEIGHTS", 0)  # every layer on the tiles
        if not gemm.amx_wgrad():
            pytest.skip(f"no AMX tiles here: {native.status()}")
    elif not gemm.bf16_instructions():
        pytest.skip(f"no AVX512-BF16 or AMX here: {native.status()}")
    else:
        monkeypatch.setattr(gemm, "USE_NATIVE_WGRAD", False)
    if gemm.ONEDNN_LINEAR is None:
        pytest.skip("torch built without oneDNN")
    ref = MLP(in_dim, widths, final_relu, generator=torch.Generator().manual_seed(0), fused=False)
    node = MLP(in_dim, widths, final_relu, fused=True)
    node.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(67, in_dim, generator=gen)  # an odd batch: the kernel's lone sample
    upstream = torch.randn(67, widths[-1], generator=gen)
    runs = []
    for m in (node, ref):
        xx = x.clone().requires_grad_(input_grad)
        with torch.autocast("cpu", dtype=BF16):
            assert fused_bf16_applies(xx)
            y = m(xx)
        assert (type(y.grad_fn).__name__ == "_FusedMLPBF16Backward") == (m is node)
        assert y.dtype == BF16
        (y.float() * upstream.to(BF16).float()).sum().backward()
        runs.append((y.detach(), xx.grad, [p.grad for p in m.parameters()]))
    linears = [m for m in ref.layers if isinstance(m, torch.nn.Linear)]
    y_want, gx_want, g_want = _emulate(
        x,
        [m.weight.detach() for m in linears],
        [m.bias.detach() for m in linears],
        final_relu,
        upstream,
        round_grads=lambda li: (
            wgrad.startswith("onednn")
            and not (small and _own_kernel(li, widths, in_dim, input_grad))
        ),
    )
    (y_node, gx_node, g_node), (_, _, g_auto) = runs
    torch.testing.assert_close(y_node.double(), y_want, rtol=1e-2, atol=1e-2)
    if input_grad:
        assert gx_node.dtype == torch.float32
        torch.testing.assert_close(gx_node.double(), gx_want, rtol=1e-2, atol=1e-2)
    else:
        assert gx_node is None
    for i, (got, auto, want) in enumerate(zip(g_node, g_auto, g_want)):
        assert got.dtype == torch.float32 and got.is_contiguous()
        err = float((got.double() - want).norm() / want.norm())
        rounded = wgrad.startswith("onednn") and not (
            small and _own_kernel(i // 2, widths, in_dim, input_grad)
        )
        if rounded:  # a bf16 ulp is 2^-8 of a value: at most a few elements
            assert err < 2e-3, err
            continue
        assert err < 1e-4, err
        if want.dim() == 2 and want.numel() > 1:  # autocast's bf16-rounded weight gradients
            assert float((auto.double() - want).norm() / want.norm()) > err


def _own_kernel(li: int, widths: list[int], in_dim: int, input_grad: bool) -> bool:
    """Whether layer li's gradients come from ``small_layers_bf16`` (fp32 sums): a logit
    below a ReLU, or a narrow first layer whose input needs no gradient."""
    if widths[li] == 1:
        return li > 0
    return li == 0 and not input_grad and in_dim <= 32 and 4 * in_dim <= widths[0]


def test_the_bf16_node_runs_only_where_bf16_is_native(monkeypatch):
    """Switched off (or without AVX512-BF16, AMX or oneDNN), an MLP under bf16 autocast
    runs autocast's modules: the GEMMs of a CPU that emulates bf16 go through its
    dispatch mode, which the node's oneDNN calls would pass by."""
    m = MLP(8, [16, 4], True)
    x = torch.randn(5, 8)
    monkeypatch.setattr(gemm, "USE_FUSED_BF16", False)
    with torch.autocast("cpu", dtype=BF16):
        assert not fused_bf16_applies(x)
        y = m(x)
    assert type(y.grad_fn).__name__ != "_FusedMLPBF16Backward"
    assert not fused_bf16_applies(x)  # no autocast
    monkeypatch.setattr(gemm, "USE_FUSED_BF16", True)
    monkeypatch.setattr(native, "cpu_features", lambda: native.CPU_AVX2 | native.CPU_AVX512F)
    with torch.autocast("cpu", dtype=BF16):
        assert not fused_bf16_applies(x)


def test_a_bf16_run_resumes_bitwise(tmp_path):
    """train.precision=bf16 stopped at step 40 and resumed gives the losses of an
    uninterrupted run (the node's sums split the same way every step: its thread split
    of the weight gradient is even where partial sums are added); on a CPU without
    AVX512-BF16 the same for autocast's modules."""
    assert_resume_identical(tmp_path, ["--train.precision=bf16"])


def test_bench_names_the_bf16_mlp_path(monkeypatch):
    """``recscale bench`` says what ran the MLPs under bf16: the node and its weight
    gradients' kernel, or autocast's modules (without bf16 instructions, and on a
    GPU)."""
    from recscale.modules.mlp import bf16_mlp_path

    cpu = torch.device("cpu")
    monkeypatch.setattr(gemm, "_BF16_KERNEL_ON_AMX", False)
    avx512 = native.CPU_AVX2 | native.CPU_AVX512F
    for features, granted, want in [
        (avx512 | native.CPU_AVX512_BF16, False, "bf16 node, weight gradients on vdpbf16ps"),
        (avx512 | native.CPU_AVX512_BF16, False, "; logit and narrow first layer on vdpbf16ps"),
        (avx512 | native.CPU_AVX512_BF16 | native.CPU_AMX_BF16, True, "input gradients (with"),
        (avx512 | native.CPU_AVX512_BF16 | native.CPU_AMX_BF16, True, "on AMX tiles from"),
        (avx512 | native.CPU_AVX512_BF16 | native.CPU_AMX_BF16, False, "on oneDNN"),
        (avx512, False, "autocast's modules"),
    ]:
        monkeypatch.setattr(native, "cpu_features", lambda f=features: f)
        monkeypatch.setattr(gemm_amx, "ready", lambda g=granted: g)
        if gemm.ONEDNN_LINEAR is not None:
            assert want in bf16_mlp_path(cpu)
    assert bf16_mlp_path(torch.device("meta")) == "autocast's modules"
