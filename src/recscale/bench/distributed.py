"""``recscale bench pipeline``: hybrid-parallel training on N local ranks, with and
without the input-dist pipeline, and where each step's time goes.

Sequential stages, timed on every rank (the report takes rank 0's medians)::

    input_dist  bucketize ids + all-to-all of lengths, ids, weights + regroup
    forward     shard lookups + output all-to-all + MLPs + interaction + loss
    backward    gradient all-to-all + fused sparse updates + DDP all-reduce
    dense_opt   the dense optimizer step

Pipelined: the next batch's input_dist runs on a background thread during the
current step; the ideal step is then ``sequential - input_dist``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch

from recscale.config.errors import ConfigError, counted
from recscale.config.schema import Config
from recscale.data.columns import DatasetError
from recscale.distributed import init_distributed, plan_for
from recscale.distributed.pipeline import EmbeddingPipeline
from recscale.distributed.spawn import run_ranks
from recscale.embedding.cache_stats import CacheTooSmallError
from recscale.embedding.row_file import TierFileError
from recscale.planner.job_plan import default_memory_per_rank
from recscale.train.data_source import make_synthetic
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build, check_batch_divides
from recscale.train.precision import resolve_row_precision
from recscale.train.step import backward_and_step, forward_loss

STAGES = ("input_dist", "forward", "backward", "dense_opt")


def _rank_worker(cfg: Config, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    resolve_row_precision(cfg, torch.device("cpu"))  # as a training rank does
    ctx = init_distributed(torch.device("cpu"), cfg.distributed.timeout_s)
    model, module, plan = build(cfg, ctx, echo=lambda _m: None)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    b = cfg.train.batch_size
    n = b // ctx.world_size
    data = make_synthetic(cfg)
    batches = [data.batch(i, b).slice(ctx.rank * n, (ctx.rank + 1) * n) for i in range(8)]
    ebc = model.embeddings

    precision, device = cfg.train.precision, ctx.device

    def step(batch) -> None:  # training's step (train/step.py)
        backward_and_step(forward_loss(module, batch, precision, device), opt, precision, device)

    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    seq = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        ebc.enqueue(ebc.distribute_input(batch.values, batch.offsets, n, batch.weights))
        t1 = time.perf_counter()
        loss = forward_loss(module, batch, precision, device)
        t2 = time.perf_counter()
        t3, t4 = backward_and_step(loss, opt, precision, device)
        if i >= warmup:
            for s, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                stages[s].append(dt)
            seq.append(t4 - t0)

    source = itertools.islice(itertools.cycle(batches), warmup + steps)
    pipe = EmbeddingPipeline(source, ebc, ctx.device)
    piped, t_prev = [], None
    for i, batch in enumerate(pipe):
        step(batch)
        now = time.perf_counter()
        if i >= warmup and t_prev is not None:
            piped.append(now - t_prev)
        t_prev = now
    pipe.close()
    torch.distributed.barrier(group=ctx.dense)
    kinds = sorted({p.kind for p in plan.placements})
    torch.distributed.destroy_process_group()
    med = statistics.median
    return {
        "stages_ms": {s: med(v) * 1e3 for s, v in stages.items()},
        "sequential_step_ms": med(seq) * 1e3,
        "pipelined_step_ms": med(piped) * 1e3,
        "kinds": kinds,
    }


# What a rank refuses of the config or its inputs (not a fault of the benchmark).
RANKS_REFUSE = (ConfigError, DatasetError, CacheTooSmallError, TierFileError)


def run_pipeline_bench(
    cfg: Config, world_size: int, steps: int, warmup: int, threads: int
) -> dict[str, Any]:
    check_batch_divides(cfg, world_size)  # here: in the ranks, a traceback from each
    if not cfg.distributed.memory_per_rank_gb:
        mem = default_memory_per_rank(torch.device("cpu"), world_size)
        cfg.distributed.memory_per_rank_gb = mem / 1e9
    plan_for(cfg, world_size, int(cfg.distributed.memory_per_rank_gb * 1e9))  # fail early
    per_rank = run_ranks(
        _rank_worker,
        world_size,
        cfg,
        steps,
        warmup,
        threads,
        timeout=1800,
        passthrough=RANKS_REFUSE,  # one line, as `bench throughput` says it
    )
    r0 = per_rank[0]
    b = cfg.train.batch_size
    seq, piped = r0["sequential_step_ms"], r0["pipelined_step_ms"]
    ideal = seq - r0["stages_ms"]["input_dist"]
    return {
        "world_size": world_size,
        "threads_per_rank": threads,
        "batch_size": b,
        "sharding": r0["kinds"],
        "stages_ms": r0["stages_ms"],
        "sequential_step_ms": seq,
        "pipelined_step_ms": piped,
        "ideal_pipelined_step_ms": ideal,
        "sequential_samples_per_s": b / seq * 1e3,
        "pipelined_samples_per_s": b / piped * 1e3,
        "bound_samples_per_s": b / ideal * 1e3,
        "speedup": seq / piped,
    }


def format_pipeline_report(name: str, r: dict[str, Any]) -> str:
    st = "  ".join(f"{k} {v:.2f}" for k, v in r["stages_ms"].items())
    return (
        f"{name}: {counted(r['world_size'], 'rank')} x "
        f"{counted(r['threads_per_rank'], 'thread')}, global batch "
        f"{r['batch_size']}, sharding {', '.join(r['sharding'])}\n"
        f"  stages (ms, rank 0, sequential): {st}\n"
        f"  sequential: {r['sequential_step_ms']:.2f} ms/step  "
        f"{r['sequential_samples_per_s']:,.0f} samples/s\n"
        f"  pipelined:  {r['pipelined_step_ms']:.2f} ms/step  {r['pipelined_samples_per_s']:,.0f} "
        "samples/s "
        f"(x{r['speedup']:.2f})\n"
        f"  bound (input dist fully hidden): {r['ideal_pipelined_step_ms']:.2f} ms/step  "
        f"{r['bound_samples_per_s']:,.0f} samples/s; pipelined reaches "
        f"{r['pipelined_samples_per_s'] / r['bound_samples_per_s']:.2f} of it"
    )
