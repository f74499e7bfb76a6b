"""A training step with one switch on against off, alternating in one process (a shared
VM drifts by more than the differences this measures).

    python benchmarks/step_ab.py --switch bf16_node --config A --rounds 10
    python benchmarks/step_ab.py --switch bf16_node --config B --rounds 6 \
        --embedding.row_precision=split_bf16
    python benchmarks/step_ab.py --switch dot_stream --config B --rounds 6 \
        --train.precision=bf16 --embedding.row_precision=split_bf16

Switches (on = what recscale runs):

    bf16_node   modules/mlp.py's _FusedMLPBF16 against autocast's nn.Linear modules
                (gemm.USE_FUSED_BF16; runs train.precision=bf16, on CPUs with AVX512-BF16 or AMX)
    amx_wgrad   the bf16 node's weight gradients on AMX tiles (native/weight_grad_amx.c)
                against oneDNN's bf16 GEMM (gemm.USE_AMX_WGRAD; bf16, on CPUs with AMX)
    amx_igrad   the bf16 node's input gradients on AMX tiles with the ReLU mask as they are
                stored (native/input_grad_amx.c) against oneDNN's GEMM and threshold_backward
                (gemm.USE_AMX_IGRAD; bf16, on CPUs with AMX)
    small_bf16  the bf16 node's logit backward and narrow first-layer weight gradient in one
                native pass each (native/small_layers_bf16.c) against torch's ops
                (small_layers_bf16.USE; bf16, on CPUs with AVX512-BF16)
    dot_bf16    the native dot interaction's row written in bf16 for the bf16 top MLP and its
                gradient read in bf16 (native/dot_interaction_bf16.c) against an fp32 row
                (dot_interaction_cpu.USE_BF16_EDGES; bf16, on CPUs with AVX512-BF16)
    pooled_bf16 the native lookup's sums written in bf16 for the dot interaction, which
                reads them (and the bottom MLP's row) in bf16 and gives their gradients in
                bf16 to the fused update, against fp32 pooled vectors and gradients
                (dot_interaction_cpu.USE_BF16_POOLED; bf16, on CPUs with AVX512-BF16)
    dot_stream  the dot interaction's backward writing large gradients with
                non-temporal stores, against plain stores (recscale_dot_stream_bytes)
    dot_amx     the bf16 dot interaction on AMX tiles (native/dot_interaction_amx.c: bf16
                pooled vectors, d 16 or a multiple of 32) against the AVX-512 kernels
                (recscale_dot_amx; bf16, on CPUs with AMX)
    dot_narrow  the dot interaction of d = 16 or 32 on AVX-512 (native/dot_interaction_narrow.c)
                against the AVX2 pair kernels (recscale_dot_wide 1 against 2; on AVX-512 CPUs)
    mkl_first   MKL for every fp32 product of the MLPs (forward, input and weight gradients)
                against oneDNN's fused linear and native/weight_grad.c (gemm.MKL_FIRST:
                recscale turns it on on Intel CPUs and CPUs without AVX-512)
    dense_sgd   the dense SGD step in one native pass that also writes the bf16 node's weight
                copies (native/dense_sgd.c) against torch's SGD and the forward's casts
                (dense_sgd.USE; configs with optimizer.name = "sgd", fp32 or bf16)

Each round times ``--steps`` steps on and as many off (one untimed step after each
switch; the order swapped every round) on the same batches, made once. Prints each
round's median step time for both and the median over rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from recscale import native
from recscale.config import load_config
from recscale.distributed import DistContext
from recscale.modules import dot_interaction_cpu, gemm, small_layers_bf16
from recscale.train import dense_sgd
from recscale.train.data_source import make_synthetic
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build
from recscale.train.step import backward_and_step, forward_loss, setup_process, start_steps


def _flag(module: object, name: str) -> Callable[[bool], None]:
    """A switch that is a module-level flag."""

    def flip(on: bool) -> None:
        setattr(module, name, on)

    return flip


def _dot_stream(on: bool) -> None:
    stream = ctypes.c_int64.in_dll(native.library(), "recscale_dot_stream_bytes")
    if not hasattr(_dot_stream, "default"):
        _dot_stream.default = stream.value  # type: ignore[attr-defined]
    stream.value = _dot_stream.default if on else 1 << 62  # type: ignore[attr-defined]


def _dot_amx(on: bool) -> None:
    ctypes.c_int.in_dll(native.library(), "recscale_dot_amx").value = int(on)


def _dot_narrow(on: bool) -> None:
    # 2 = "the AVX2 tiles": for d < 64 that is the pair kernels (dot_interaction.c)
    ctypes.c_int.in_dll(native.library(), "recscale_dot_wide").value = 1 if on else 2


SWITCHES: dict[str, Callable[[bool], None]] = {
    "bf16_node": _flag(gemm, "USE_FUSED_BF16"),
    "amx_wgrad": _flag(gemm, "USE_AMX_WGRAD"),
    "amx_igrad": _flag(gemm, "USE_AMX_IGRAD"),
    "small_bf16": _flag(small_layers_bf16, "USE"),
    "dot_bf16": _flag(dot_interaction_cpu, "USE_BF16_EDGES"),
    "pooled_bf16": _flag(dot_interaction_cpu, "USE_BF16_POOLED"),
    "dot_stream": _dot_stream,
    "dot_narrow": _dot_narrow,
    "dot_amx": _dot_amx,
    "dense_sgd": _flag(dense_sgd, "USE"),
    "mkl_first": _flag(gemm, "MKL_FIRST"),
}


def stepper(cfg) -> tuple[Callable[[], float], torch.optim.Optimizer]:
    """``cfg``'s model set up as training sets it up, and a function that runs one
    training step (forward, backward, the dense step) on the next of 8 batches made
    once and returns its seconds; with the dense optimizer it steps."""
    device, _ = setup_process(cfg)
    model, _, _ = build(cfg, DistContext(device=device), print)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    start_steps(cfg)
    batches = [data.batch(i, cfg.train.batch_size) for i in range(8)]
    precision = cfg.train.precision
    k = 0

    def step() -> float:
        nonlocal k
        t = time.perf_counter()
        loss = forward_loss(model, batches[k % len(batches)], precision, device)
        backward_and_step(loss, opt, precision, device)
        k += 1
        return time.perf_counter() - t

    return step, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--config", default="A")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side a round")
    args, overrides = ap.parse_known_args()
    if args.switch == "bf16_node" and not gemm.bf16_instructions():
        raise SystemExit("this CPU has no AVX512-BF16 or AMX: the bf16 node does not run here")
    if args.switch in ("amx_wgrad", "amx_igrad", "dot_amx") and not gemm.amx_wgrad():
        raise SystemExit(f"the AMX kernels do not run here: {native.status()}")
    bf16_kernels = ("small_bf16", "dot_bf16", "pooled_bf16", "dot_amx")
    if args.switch in bf16_kernels and not native.cpu_features() & native.CPU_AVX512_BF16:
        raise SystemExit(f"the AVX512-BF16 kernels do not run here: {native.status()}")
    if args.switch in ("bf16_node", "amx_wgrad", "amx_igrad", *bf16_kernels):  # the bf16 step
        overrides = [*overrides, "--train.precision=bf16"]
    if args.switch in ("dot_stream", "dot_narrow") and not native.has_avx512():
        raise SystemExit(f"the AVX-512 interaction kernels do not run here: {native.status()}")
    cfg = load_config(args.config, overrides)
    step, _ = stepper(cfg)
    for _ in range(6):  # warm-up
        step()
    medians: dict[bool, list[float]] = {True: [], False: []}
    flip = SWITCHES[args.switch]
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            flip(on)
            step()
            medians[on].append(1e3 * statistics.median(step() for _ in range(args.steps)))
        print(f"round {r + 1}: on {medians[True][-1]:.2f} ms, off {medians[False][-1]:.2f} ms")
    flip(True)
    on, off = statistics.median(medians[True]), statistics.median(medians[False])
    wins = sum(a < b for a, b in zip(medians[True], medians[False]))
    print(
        f"config {args.config}, {args.switch}: on {on:.2f} ms/step, off {off:.2f} "
        f"(median of {args.rounds} rounds; on faster in {wins})"
    )


if __name__ == "__main__":
    main()
