"""A stack of Linear layers with ReLU between them (and optionally after the last).

Three paths with the same parameters (``layers``, so checkpoints don't care which ran):

- the reference ``nn.Sequential`` of ``nn.Linear`` / ``nn.ReLU`` (``model.kernels=torch``;
  also under bf16 autocast on CUDA and on CPUs that emulate bf16);
- :class:`_FusedMLPBF16` under bf16 autocast on a CPU with AVX512-BF16 or AMX: bf16
  GEMMs chained in one node, fp32 weight and bias gradients from a native pass (on AMX
  the tiles': our kernel for large layers, oneDNN's, rounded to bf16, for small ones);
- :class:`_FusedMLP`, one autograd node for the whole stack, with the same GEMMs but a
  hand-written backward that (measured on config A, batch 2048):

  * masks each ReLU gradient in place in the dgrad GEMM's output instead of writing a
    fresh ``[B, width]`` tensor (threshold_backward 0.6 -> 0.1 ms for a 512-wide layer:
    the write-allocate of 4 MB was most of it);
  * computes the weight gradient and the bias gradient in one pass of our kernel
    (:func:`recscale.modules.gemm.weight_grad`; AVX-512: 6-11% faster than MKL at the
    512-wide layers, 1.1-1.4x at the narrow ones; AVX2: level with MKL, 2% off the
    step), or without the native library through MKL; a narrow-input layer as
    ``(x^T g)^T`` (13 -> 512: 0.83 -> 0.45 ms; MKL is slow at ``g^T x`` with N = 13);
  * skips the input gradient when the input needs none (the dense features), and then,
    for a narrow first layer (13 -> 512), leaves that layer's ReLU mask to one native
    pass that also computes its weight and bias gradients
    (:func:`recscale.modules.gemm.narrow_weight_grad`: the mask pass and the packing of
    the 4 MB gradient go; 0.65 ms + the mask -> 0.45 ms in config A's step);
  * runs a logit layer (``n -> 1``) forward in one native pass and its backward - the
    weight, bias and input gradients with the previous ReLU's mask - in another
    (:func:`recscale.modules.gemm.logit_backward`; five torch ops took ~0.9 ms of
    config A's step);
  * runs a narrow first layer's forward (13 -> 512) in a native pass of its own
    (:func:`recscale.modules.gemm.narrow_forward`: oneDNN runs K = 13 at ~60 GFLOP/s);
  * on a CPU, runs the forward GEMMs with bias and ReLU fused in and the
    input-gradient GEMMs through oneDNN (:mod:`recscale.modules.gemm`: 190-215 GFLOP/s
    against MKL's 150-190 at config A's shapes).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recscale.modules import bf16_weights, gemm, small_layers_bf16


def _saved(ctx, grad_out: torch.Tensor) -> tuple:
    """A node's backward inputs: ``(activations, weights, g)`` with ``g`` the gradient at
    the last layer's output (through its ReLU when there is one: out of place, since
    ``grad_out`` is not ours to modify). The forward saved ``*acts, *weights``."""
    saved = ctx.saved_tensors
    n = (len(saved) - 1) // 2
    acts, weights = saved[: n + 1], saved[n + 1 :]
    g = torch.ops.aten.threshold_backward(grad_out, acts[n], 0.0) if ctx.final_relu else grad_out
    return acts, weights, g


class _FusedMLP(torch.autograd.Function):
    """``x [B, in] -> [B, out]`` through layers ``(W_l [o, i], b_l [o])``, ReLU after
    every layer but the last (and after the last too if ``final_relu``).

    Saved for backward: the input of every layer (each is the ReLU output of the layer
    before, so it also carries the ReLU mask) and the final output if it went through a
    ReLU -- the same tensors autograd would keep for the reference path.
    """

    @staticmethod
    def forward(ctx, x, final_relu, *params):
        weights, biases = params[0::2], params[1::2]
        acts = [x]
        h = x
        for li, (w, b) in enumerate(zip(weights, biases)):
            relu = li < len(weights) - 1 or final_relu
            if not relu and gemm.native_logit_applies(h, w):  # the logit layer: one pass
                h = gemm.logit_forward(h, w, b)
            elif li == 0 and gemm.native_narrow_forward_applies(h, w):  # 13 -> 512
                h = gemm.narrow_forward(h, w, b, relu)
            else:
                h = gemm.linear(h, w, b, relu=relu)
            acts.append(h)
        ctx.final_relu = final_relu
        ctx.save_for_backward(*acts, *weights)
        return h

    @staticmethod
    def backward(ctx, grad_out):
        acts, weights, g = _saved(ctx, grad_out)
        n = len(weights)
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        grad_x = None
        mask = None  # set when the first layer's ReLU mask is left to its own kernel
        for li in range(n - 1, -1, -1):
            x, w = acts[li], weights[li]
            need_w, need_b = ctx.needs_input_grad[2 + 2 * li], ctx.needs_input_grad[3 + 2 * li]
            if gemm.native_logit_applies(x, w):
                # the logit layer in one pass: dw, db and the input gradient, masked by
                # the previous ReLU (x is its output) when there is one
                need_x = li > 0 or ctx.needs_input_grad[0]
                g_in, dw, db = gemm.logit_backward(x, w, g, mask=li > 0, input_grad=need_x)
                grads[2 * li] = dw if need_w else None
                grads[2 * li + 1] = db if need_b else None
                if li > 0:
                    g = g_in
                else:
                    grad_x = g_in
                continue
            if mask is not None:  # the first layer, narrow: mask + dw + db in one pass
                grads[2 * li], grads[2 * li + 1] = gemm.narrow_weight_grad(g, x, mask, need_b)
                if not need_w:
                    grads[2 * li] = None
                continue
            if need_w:  # [o, i] = g^T x, and the bias gradient in the same pass
                grads[2 * li], grads[2 * li + 1] = gemm.weight_grad(g, x, bias_grad=need_b)
            elif need_b:
                grads[2 * li + 1] = g.sum(0)
            if li > 0:
                # K = 1 (a logit layer, not native): an outer product, twice as fast as a GEMM
                g_in = g * w if w.shape[0] == 1 else gemm.linear(g, w.t())
                if (
                    li == 1
                    and not ctx.needs_input_grad[0]
                    and gemm.native_narrow_wgrad_applies(g_in, acts[0])
                ):
                    # the layer below is the first, with a narrow input that needs no
                    # gradient: its kernel applies the ReLU mask (x) while it reads g_in
                    g, mask = g_in, x
                    continue
                # x = relu(previous layer): mask in place (g_in is our own fresh tensor).
                g = torch.ops.aten.threshold_backward.grad_input(g_in, x, 0.0, grad_input=g_in)
            elif ctx.needs_input_grad[0]:
                grad_x = gemm.linear(g, w.t())
        return (grad_x, None, *grads)


class _FusedMLPBF16(torch.autograd.Function):
    """:class:`_FusedMLP`'s contract under bf16 autocast on a CPU with AVX512-BF16 or AMX:
    the GEMMs take bf16 operands (the input and the weights cast once a step, as
    autocast casts them) with fp32 accumulation, and the activations stay bf16 from
    layer to layer.

    Against autocast's modules (what runs elsewhere), per layer: the bias and ReLU are
    applied in the forward GEMM's output (oneDNN; the bias added in fp32, not rounded to
    bf16 first), the ReLU mask in place in the input gradient, and the weight and bias
    gradients come out of one native pass in fp32 (``native/weight_grad_bf16.c``) where
    autocast rounds the weight gradient to bf16, casts it back and sums the bias in a
    pass of its own. On an AMX CPU the gradients run on the tiles instead. A layer whose
    input gradient our tile kernel takes (``gemm.input_grad``: 32 | out, up to 2^19
    weights) gets all three from its one pass over ``g`` and the layer's input: the
    input gradient masked as it is stored, the bias sums, and ``g`` and the input
    packed for the weight gradient's tile multiply. Other layers' weight gradients are
    our kernel's fp32 ones from 2^18 weights (``gemm.amx_wgrad``), oneDNN's, rounded to
    bf16 as autocast's are, below. On any AVX512-BF16 CPU a logit below a ReLU and a
    narrow first layer (13 -> 512) take one pass each of ``small_layers_bf16`` (fp32
    gradients). In the step,
    alternating with autocast's modules (``benchmarks/step_ab.py``): on a Zen 4 VM
    (AVX512-BF16) config A faster in 27 of 34 rounds (medians 21.8-25.2 ms against
    22.7-26.4), B in 10 of 12 (91.9-93.2 against 93.3-97.3); on an Intel Xeon VM with
    AMX, A in 3 of 4 (11.97 against 12.41 ms); there, the tile kernel's input gradients
    (and with them the other two) against oneDNN's GEMMs and torch's mask: A 13.92
    against 15.46 ms, 8 of 8 (``--switch amx_igrad``)."""

    @staticmethod
    def forward(ctx, x, final_relu, *params):
        weights, biases = params[0::2], params[1::2]
        n = len(weights)
        bf16 = torch.bfloat16
        wb = [bf16_weights.bf16_copy(w) for w in weights]  # the optimizer's, where it kept one
        h = x.to(bf16)
        acts = [h]
        with torch.autocast("cpu", enabled=False):  # every operand is already bf16
            for li, (w, b) in enumerate(zip(wb, biases)):
                relu = li < n - 1 or final_relu
                if w.shape[0] == 1:  # a logit: a GEMV (autocast's op, bias in bf16)
                    h = torch.addmm(b.to(bf16), h, w.t())
                    h = h.relu_() if relu else h
                else:
                    h = gemm.ONEDNN_LINEAR(h, w, b, "relu" if relu else "none", [], "")
                acts.append(h)
        ctx.final_relu, ctx.x_dtype = final_relu, x.dtype
        ctx.save_for_backward(*acts, *wb)
        return h

    @staticmethod
    def backward(ctx, grad_out):
        acts, weights, g = _saved(ctx, grad_out.to(torch.bfloat16))
        n = len(weights)
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        grad_x = None
        for li in range(n - 1, -1, -1):
            x, w = acts[li], weights[li]
            need_w, need_b = ctx.needs_input_grad[2 + 2 * li], ctx.needs_input_grad[3 + 2 * li]
            if li > 0 and small_layers_bf16.logit_applies(x, w):
                # a logit (n -> 1) below a ReLU: its three gradients in one pass over x
                g, dw, db = small_layers_bf16.logit_backward(x, w, g, mask=True, input_grad=True)
                grads[2 * li], grads[2 * li + 1] = dw if need_w else None, db if need_b else None
                continue
            # the input gradient first: where it runs on AMX tiles its pass over g and x
            # also gives the bias and weight gradients
            g_in = db = dw = None
            if li > 0:  # x = relu(previous layer): its mask applied to g . w
                g_in, db, dw = gemm.input_grad(
                    g, w, x, torch.bfloat16, need_b, x if need_w else None
                )
            elif ctx.needs_input_grad[0]:
                grad_x, db, dw = gemm.input_grad(
                    g, w, None, ctx.x_dtype, need_b, x if need_w else None
                )
            if need_w and dw is None and small_layers_bf16.narrow_applies(g, x):
                # a narrow first layer (13 -> 512): dw and db in one pass over g
                dw, db_w = small_layers_bf16.narrow_weight_grad(g, x, need_b and db is None)
                db = db if db is not None else db_w
            elif need_w and dw is None:  # fp32 [o, i] = g^T x (and the bias gradient)
                dw, db_w = gemm.weight_grad(g, x, bias_grad=need_b and db is None)
                db = db if db is not None else db_w
            elif need_b and db is None:
                db = g.sum(0, dtype=torch.float32)
            grads[2 * li], grads[2 * li + 1] = dw, db
            g = g_in
        return (grad_x, None, *grads)


def fused_bf16_applies(x: torch.Tensor) -> bool:
    """Whether an MLP's forward on ``x`` runs :class:`_FusedMLPBF16`: a CPU tensor under
    bf16 autocast, oneDNN there, and bf16 instructions (AVX512-BF16 or AMX) - elsewhere
    (AVX2, where bf16 GEMMs are emulated through fp32 ones) autocast's modules run."""
    return (
        x.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and gemm.ONEDNN_LINEAR is not None
        and gemm.USE_FUSED_BF16
        and gemm.bf16_instructions()
    )


def bf16_mlp_path(device: torch.device) -> str:
    """What runs an MLP under bf16 autocast on ``device``, in words (``recscale bench``
    says it): the bf16 node and where its weight gradients go, or autocast's modules."""
    cpu_node = device.type == "cpu" and gemm.ONEDNN_LINEAR is not None and gemm.USE_FUSED_BF16
    if not (cpu_node and gemm.bf16_instructions()):
        return "autocast's modules"
    small = "; logit and narrow first layer on vdpbf16ps" if small_layers_bf16.available() else ""
    return _bf16_gradients_path() + small


def _bf16_gradients_path() -> str:
    """Where the bf16 node's input and weight gradients run, in words."""
    if gemm.amx_wgrad():
        weights = gemm._AMX_MIN_WEIGHTS
        igrad = (
            f"input gradients (with the layer's bias and weight gradients) on AMX tiles up to "
            f"{gemm._AMX_IGRAD_MAX_WEIGHTS:,} weights, "
            if gemm.USE_AMX_IGRAD
            else ""
        )
        return (
            f"bf16 node, {igrad}other weight gradients on AMX tiles from {weights:,} "
            "weights, oneDNN below"
        )
    if gemm.native_bf16_wgrad():
        return "bf16 node, weight gradients on vdpbf16ps"
    return "bf16 node, weight gradients on oneDNN"


class MLP(nn.Module):
    def __init__(
        self,
        in_dim: int,
        widths: list[int],
        final_activation: bool,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
        fused: bool = True,
    ) -> None:
        """``fused``: run :class:`_FusedMLP` (same math, faster backward); False keeps
        the plain ``nn.Sequential`` (the reference path)."""
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for i, w in enumerate(widths):
            linear = nn.Linear(d, w, device=device)
            # Reference DLRM init: W ~ N(0, sqrt(2 / (fan_in + fan_out))),
            # b ~ N(0, sqrt(1 / fan_out)).
            with torch.no_grad():
                linear.weight.copy_(
                    torch.randn(w, d, generator=generator) * math.sqrt(2.0 / (d + w))
                )
                linear.bias.copy_(torch.randn(w, generator=generator) * math.sqrt(1.0 / w))
            layers.append(linear)
            if i < len(widths) - 1 or final_activation:
                # In place: the Linear's backward does not need its output, and ReLU's
                # backward reads only its own result, so no extra [B, width] buffer.
                layers.append(nn.ReLU(inplace=True))
            d = w
        self.layers = nn.Sequential(*layers)
        self.out_dim = d
        self.final_activation = final_activation
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.layers(x)
        params = [p for m in self.layers if isinstance(m, nn.Linear) for p in (m.weight, m.bias)]
        if torch.is_autocast_enabled(x.device.type):
            # bf16 on a CPU with bf16 instructions: the bf16 node; else (CUDA, or a CPU that
            # emulates bf16) autocast's modules, which cast each GEMM
            if fused_bf16_applies(x):
                return _FusedMLPBF16.apply(x, self.final_activation, *params)
            return self.layers(x)
        return _FusedMLP.apply(x, self.final_activation, *params)
