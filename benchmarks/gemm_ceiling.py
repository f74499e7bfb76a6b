"""How close can a step's GEMMs get to the bound? Each MLP product of a config's step
timed alone, in the best library and operand layout available, against the bound's
GEMM rate.

For every layer ``in -> out`` of the bottom and top MLPs (dot interaction) the three
products of a training step - forward ``x W^T``, input gradient ``g W`` (not for the
first bottom layer: the dense features need none) and weight gradient ``g^T x`` - are
timed with MKL (``torch.mm``, with either operand transposed), oneDNN (the fused
linear the MLPs run) and, for weight gradients, our AVX-512 or AVX2 kernel
(``gemm.weight_grad``), operands pre-transposed for free and hot in the caches; the best
of ``--repeats`` in each of ``--rounds`` passes over all layers stands (a shared VM has
slow periods that last seconds; the best over separate passes sees past them). Their
sum is the time a step's GEMMs could take on this machine if nothing else got in the
way; docs/performance.md compares it with the GEMM part of the bound (``recscale bench
throughput``) and with the step.

    python benchmarks/gemm_ceiling.py --config A      # 2-core EPYC: 26.4 ms, 0.99 of 223 GFLOP/s
    # (the same VM without AVX-512: 34.65-36.66 ms, 0.93-0.985 of 170 GFLOP/s)
    python benchmarks/gemm_ceiling.py --config B --precision bf16   # operands in bf16

``--precision bf16`` times the products with bf16 operands (what ``train.precision=bf16``
runs on a CPU with AVX512-BF16 or AMX; without them torch's bf16 GEMMs are a scalar
loop): MKL's and oneDNN's, not our fp32 weight-gradient kernel.
"""

from __future__ import annotations

import argparse

import torch

from recscale.bench import hardware
from recscale.config import load_config
from recscale.modules import gemm
from recscale.modules.interaction import DotInteraction
from recscale.train.host_memory import set_host_memory


def best_seconds(fns, repeats: int) -> float:
    """The fastest of ``fns`` (different ways to compute one product), best of repeats."""
    return min(hardware._best_seconds(fn, repeats, warmup=3) for fn in fns)


def layer_times(batch: int, i: int, o: int, input_grad: bool, repeats: int, dtype: torch.dtype):
    """(forward, input gradient or 0, weight gradient) seconds for one ``i -> o`` layer."""
    x, w, g = (torch.randn(*s).to(dtype) for s in ((batch, i), (o, i), (batch, o)))
    xt, wt, gt = x.t().contiguous(), w.t().contiguous(), g.t().contiguous()
    dnn = gemm.ONEDNN_LINEAR

    def onednn(a, b):  # a @ b^T
        return lambda: dnn(a, b, None, "none", [], "")

    fwd = [lambda: torch.mm(x, w.t()), lambda: torch.mm(x, wt)]
    dgrad = [lambda: torch.mm(g, w), lambda: torch.mm(g, wt.t())]
    wgrad = [lambda: torch.mm(g.t(), x), lambda: torch.mm(gt, x), lambda: torch.mm(xt, g)]
    if gemm._native_wgrad_applies(g, x):  # our AVX-512 kernel, as the step runs it
        wgrad.append(lambda: gemm.weight_grad(g, x))
    if dnn is not None:
        if o > 1:
            fwd.append(onednn(x, w))
            wgrad += [onednn(gt, xt), onednn(gt, x.t())]
        if i > 1:
            dgrad += [onednn(g, wt), onednn(g, w.t())]
    return (
        best_seconds(fwd, repeats),
        best_seconds(dgrad, repeats) if input_grad else 0.0,
        best_seconds(wgrad, repeats),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument(
        "--gflops",
        type=float,
        default=0.0,
        help="the bound's GEMM rate to compare with (default: this run's best)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    # as training does: without it every product's output is a fresh mapping whose pages
    # fault in on each call (1 ms of a 13 -> 512 forward's 1.2)
    set_host_memory(cfg.train.host_memory)
    m, batch = cfg.model, cfg.train.batch_size
    if m.interaction != "dot":
        raise SystemExit(f"gemm_ceiling: dot interaction only (config has {m.interaction!r})")
    top_in = DotInteraction(len(m.table_sizes), m.embedding_dim, has_dense=True).out_dim
    mlps = [("bottom", [m.num_dense_features, *m.bottom_mlp]), ("top", [top_in, *m.top_mlp])]
    layers = [
        (name, li, i, o)
        for name, widths in mlps
        for li, (i, o) in enumerate(zip(widths[:-1], widths[1:]))
    ]
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    best: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for name, li, i, o in layers:
            times = layer_times(
                batch, i, o, not (name == "bottom" and li == 0), args.repeats, dtype
            )
            prev = best.get((name, li), [float("inf")] * 3)
            best[(name, li)] = [min(a, b) for a, b in zip(prev, times)]
    total = flops = best_rate = 0.0
    print(
        f"{args.config}: batch {batch}, {args.precision}, {torch.get_num_threads()} threads; "
        "ms (GFLOP/s)"
    )
    for name, li, i, o in layers:
        tf, td, tw = best[(name, li)]
        f = 2.0 * batch * i * o
        best_rate = max(best_rate, *(f / t / 1e9 for t in (tf, td, tw) if t))
        print(
            f"  {name:6s} {i:5d} -> {o:5d}  forward {tf * 1e3:7.3f} ({f / tf / 1e9:4.0f})"
            + (f"  input grad {td * 1e3:7.3f} ({f / td / 1e9:4.0f})" if td else "")
            + f"  weight grad {tw * 1e3:7.3f} ({f / tw / 1e9:4.0f})"
        )
        total += tf + td + tw
        flops += f * (3 if td else 2)
    rate = args.gflops or best_rate
    at_rate = flops / (rate * 1e9)
    print(
        f"GEMMs alone, each at its best: {total * 1e3:.2f} ms a step ({batch / total:,.0f} "
        "samples/s)"
    )
    print(
        f"the same FLOPs at {rate:.0f} GFLOP/s: {at_rate * 1e3:.2f} ms -> {at_rate / total:.3f} of "
        "that rate"
    )


if __name__ == "__main__":
    main()
