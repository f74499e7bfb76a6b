"""``recscale bench calibrate``: measure this machine's per-op rates once, fit a few
constants per op, save them (plain JSON) for the performance model to reuse.

Each op is timed at a small grid of shapes as the training step runs it (fp32, the
machine's threads), then fitted by least squares on relative error (rows weighted by
1/t) to a cost law with non-negative coefficients::

    MLP layer forward     t = a * 2MKN + b * MN + c * MK + d * KN + e   (M batch, K in, N out)
    MLP layer backward    t = a * 4MKN + b * MN + c * MK + d * KN + e   (dgrad + wgrad, ReLU mask)
    dot interaction f+b   t = a * B K^2 D + b * B K^2 + c     (K = features + 1)
    embedding lookup      t = a * ids D + b * ids + c        (fused lookup, random rows)
    embedding update      t = a * ids D + b * ids + c        (fused backward + row-wise Adagrad)
    dense optimizer       t = a * params + c                  (fused Adam)
    element-wise          t = a * B width + c                 (concat; a cross layer's x0*y+x)
    all-to-all            t = a * bytes + c                   (bytes a rank sends; 2 local ranks)
    all-reduce            t = a * ring bytes + c              (2 (W-1)/W x the buffer's bytes)

The collectives are measured on ``collective_ranks`` local processes joined as training
joins them (gloo on CPU): the rates of this host's loopback. A cluster's network
differs - ``recscale plan --all-to-all-gbps`` overrides them.

The model (``model.py``) sums them over a config's layers; a step-level fit over whole
steps of four configurations (``STEP_CONFIGS``) then gives ``step_scale`` (ops in a
step vs alone) and ``step_overhead`` (dispatch, the loss).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from recscale.perfmodel.calibration import Calibration, Law, mlp_features
from recscale.perfmodel.fit import fit_law, fit_step_constants, step_configs


def median_seconds(fn, repeats: int = 7, warmup: int = 2) -> float:
    """``fn()``'s median wall time over ``repeats`` calls, after ``warmup`` untimed."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _mlp_layer(echo) -> tuple[Law, Law]:
    from recscale.modules.mlp import MLP

    rows, fwd, bwd = [], [], []
    for m in (256, 1024, 4096):
        for k, n in (
            (13, 512),
            (512, 256),
            (256, 64),
            (64, 16),
            (512, 512),
            (1024, 1024),
            (400, 512),
            (256, 1),
            (128, 1024),
        ):
            mlp = MLP(k, [n], final_activation=n > 1)
            x = torch.randn(m, k, requires_grad=True)
            g = torch.randn(m, n)
            fwd.append(median_seconds(lambda mlp=mlp, x=x: mlp(x)))
            out = mlp(x)
            bwd.append(median_seconds(lambda out=out, g=g: out.backward(g, retain_graph=True)))
            rows.append(mlp_features(m, k, n))
    echo(f"  MLP layers: {len(rows)} shapes")
    return (
        fit_law(["flops2", "mn", "mk", "kn", "one"], rows, fwd),
        fit_law(["flops4", "mn", "mk", "kn", "one"], rows, bwd),
    )


def _interaction(echo) -> Law:
    from recscale.modules.interaction import DotInteraction

    rows, ts = [], []
    for b in (256, 1024, 4096):
        for f, d in ((8, 8), (26, 16), (26, 32), (26, 64), (13, 128)):
            inter = DotInteraction(f, d, True)
            dense = torch.randn(b, d, requires_grad=True)
            emb = torch.randn(b, f, d, requires_grad=True)
            out = inter(dense, emb)
            g = torch.randn_like(out)

            def fb(inter=inter, dense=dense, emb=emb, g=g):
                inter(dense, emb).backward(g)

            ts.append(median_seconds(fb))
            k = f + 1
            rows.append({"bkkd": float(b * k * k * d), "bkk": float(b * k * k), "one": 1.0})
    echo(f"  dot interaction: {len(rows)} shapes")
    return fit_law(["bkkd", "bkk", "one"], rows, ts)


def _embedding(echo) -> tuple[Law, Law]:
    from recscale.config import load_config
    from recscale.embedding.optimizers import build_sparse_optimizer
    from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec

    cfg = load_config("debug", ["--embedding.optimizer=rowwise_adagrad"])
    rows, look, upd = [], [], []
    gen = torch.Generator().manual_seed(0)
    for d in (8, 16, 64, 128):
        tables = [TableSpec(f"C{i}", 1 << 19, d) for i in range(8)]  # 4M rows: beyond the caches
        ebc = EmbeddingBagCollection(tables, "sum", lambda: build_sparse_optimizer(cfg.embedding))
        for b in (512, 2048, 8192):
            for pool in (1, 4):
                n = b * pool * len(tables)
                values = torch.randint(0, 1 << 19, (n,), generator=gen)
                offsets = torch.arange(0, n + 1, pool)
                lookup = lambda ebc=ebc, v=values, o=offsets, b=b: ebc(v, o, b)  # noqa: E731
                look.append(median_seconds(lookup, repeats=5))
                g = torch.randn(b, len(tables) * d)
                out = lookup()
                # the fused backward applies the optimizer: each repeat is one more step
                upd.append(
                    median_seconds(
                        lambda out=out, g=g: out.backward(g, retain_graph=True), repeats=5
                    )
                )
                rows.append({"ids_d": float(n * d), "ids": float(n), "one": 1.0})
    echo(f"  embeddings: {len(rows)} shapes")
    return fit_law(["ids_d", "ids", "one"], rows, look), fit_law(["ids_d", "ids", "one"], rows, upd)


def _elementwise(echo) -> Law:
    """Concatenating [dense, embeddings] (cat, DCNv2) and a cross layer's x0 * y + x
    (DCNv2): B x width elements written forward and read back in the backward."""
    rows, ts = [], []
    for b in (256, 1024, 4096):
        for width in (64, 256, 1024, 3456):
            dense = torch.randn(b, 16, requires_grad=True)
            emb = torch.randn(b, width - 16, requires_grad=True)
            g = torch.randn(b, width)

            def fb(dense=dense, emb=emb, g=g):
                x0 = torch.cat([dense, emb], 1)
                torch.addcmul(x0, x0, x0).backward(g)

            ts.append(median_seconds(fb))
            rows.append({"bw": float(b * width), "one": 1.0})
    echo(f"  concat / cross-layer element-wise: {len(rows)} shapes")
    return fit_law(["bw", "one"], rows, ts)


def _dense_optimizer(echo) -> Law:
    rows, ts = [], []
    for p in (10_000, 300_000, 1_000_000, 3_000_000):
        w = torch.nn.Parameter(torch.randn(p))
        w.grad = torch.randn(p)
        opt = torch.optim.Adam([w], lr=1e-3, fused=True)
        ts.append(median_seconds(opt.step))
        rows.append({"params": float(p), "one": 1.0})
    echo(f"  dense optimizer: {len(rows)} sizes")
    return fit_law(["params", "one"], rows, ts)


COLLECTIVE_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # fp32 elements a rank sends


def _collective_worker(sizes: tuple[int, ...]) -> dict[str, list[float]]:
    import torch.distributed as dist

    from recscale.distributed import init_distributed

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"))
    g = ctx.dense
    out: dict[str, list[float]] = {"all_to_all": [], "all_reduce": []}
    for n in sizes:
        x = torch.randn(n - n % ctx.world_size)
        y = torch.empty_like(x)
        t_a2a, t_ar = [], []
        for _ in range(7):
            dist.barrier(group=g)
            t = time.perf_counter()
            dist.all_to_all_single(y, x, group=g)
            t_a2a.append(time.perf_counter() - t)
            dist.barrier(group=g)
            t = time.perf_counter()
            dist.all_reduce(x, group=g)
            t_ar.append(time.perf_counter() - t)
        out["all_to_all"].append(statistics.median(t_a2a[2:]))
        out["all_reduce"].append(statistics.median(t_ar[2:]))
    dist.destroy_process_group()
    return out


def _collectives(echo, world_size: int) -> tuple[Law, Law]:
    from recscale.distributed.spawn import run_ranks
    from recscale.planner.costs import ring_bytes

    res = run_ranks(_collective_worker, world_size, COLLECTIVE_SIZES, timeout=300)
    # the slower rank's time: a collective ends for everyone when the last rank is done
    a2a = [max(r["all_to_all"][i] for r in res) for i in range(len(COLLECTIVE_SIZES))]
    ar = [max(r["all_reduce"][i] for r in res) for i in range(len(COLLECTIVE_SIZES))]
    spread = (world_size - 1) / world_size
    rows_a2a = [{"bytes": 4.0 * n * spread, "one": 1.0} for n in COLLECTIVE_SIZES]
    rows_ar = [{"bytes": ring_bytes(4.0 * n, world_size), "one": 1.0} for n in COLLECTIVE_SIZES]
    echo(
        f"  collectives: all-to-all and all-reduce on {world_size} local ranks, "
        f"{len(COLLECTIVE_SIZES)} sizes"
    )
    return fit_law(["bytes", "one"], rows_a2a, a2a), fit_law(["bytes", "one"], rows_ar, ar)


# Whole steps the step-level fit uses; none is among the validation configurations
# (benchmarks/perfmodel_validation.py).
def calibrate(
    echo=print, threads: int | None = None, collective_ranks: int = 2, world_size: int = 1
) -> Calibration:
    """Measure and fit every law, then the step-level fit from whole steps: a step takes
    ``step_scale`` x the sum of its ops (ops run back to back share caches and cores
    differently than alone) plus ``step_overhead`` (dispatch, the loss).

    ``threads``: the torch threads each op runs on - calibrate at the threads a rank
    will train with (default: this process's). ``collective_ranks``: local processes
    for the collectives (0 or 1: none measured; the model then assumes 100 Gb/s).
    ``world_size`` > 1: the whole steps run on that many local ranks (the training
    path's sequential step), so the fit also holds what ranks sharing this host's cores
    and memory cost each other - a calibration for predicting W local ranks."""
    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    cal = Calibration(machine=platform.node() or "host", threads=threads, world_size=world_size)
    echo(f"calibrating on {threads} threads ...")
    cal.laws["mlp_forward"], cal.laws["mlp_backward"] = _mlp_layer(echo)
    cal.laws["interaction"] = _interaction(echo)
    cal.laws["lookup"], cal.laws["update"] = _embedding(echo)
    cal.laws["dense_opt"] = _dense_optimizer(echo)
    cal.laws["elementwise"] = _elementwise(echo)
    if max(collective_ranks, world_size) > 1:
        cal.laws["all_to_all"], cal.laws["all_reduce"] = _collectives(
            echo, max(collective_ranks, world_size)
        )
    _fit_steps(cal, threads, world_size, echo)
    return cal


def measure_step(cfg, threads: int, world_size: int) -> float:
    """Milliseconds of one whole step of ``cfg`` (the median of 15 after 5 warm-up): in
    this process, or on ``world_size`` local ranks (the training path's sequential step,
    the plan ``plan_for`` makes)."""
    if world_size == 1:
        from recscale.bench.throughput import run_throughput

        return run_throughput(cfg, steps=15, warmup=5, echo=lambda _m: None)["ms_per_step"]
    from recscale.bench.distributed import run_pipeline_bench

    cfg.distributed.calibration = "none"  # the job plans as plan_for(...) in fit_step_constants
    return run_pipeline_bench(cfg, world_size, 15, 5, threads)["sequential_step_ms"]


def _fit_steps(cal: Calibration, threads: int, world_size: int, echo) -> None:
    # the median of three runs: one run of a few-ms step can be 30% off on a shared VM,
    # and four whole-step points carry the two constants
    ms = [
        statistics.median(measure_step(cfg, threads, world_size) for _ in range(3))
        for cfg in step_configs(threads)
    ]
    fit_step_constants(cal, ms, echo)
