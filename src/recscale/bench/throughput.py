"""``recscale bench throughput``: steady-state training samples/s against the hardware bound.

Batches are generated beforehand (cycled), so the figure measures training, not
data generation. Each timed step is split into stages::

    lookup     embedding forward (one fused lookup over all tables)
    forward    bottom MLP + interaction + top MLP + loss
    backward   autograd backward, excluding ...
    sparse     ... the fused sparse optimizer applied inside the embedding backward
    dense_opt  the dense optimizer step
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from recscale import native
from recscale.bench.hardware import measure_gather_gbps, measure_gemm_gflops, step_cost
from recscale.config.schema import Config
from recscale.models.dlrm import build_model
from recscale.train.cache_prefetch import CachePrefetcher, cache_report, cached_storages
from recscale.train.data_source import make_synthetic
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.run import available_cores

STAGES = ("lookup", "forward", "backward", "sparse", "dense_opt")


class _SparseTimer:
    """Wraps each storage's fused backward (apply_pooled_gradients) to time it."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        for group in model.embeddings.groups:
            storage = group.storage
            original = storage.apply_pooled_gradients

            def timed(*args, _orig=original):
                t = time.perf_counter()
                _orig(*args)
                self.seconds += time.perf_counter() - t

            storage.apply_pooled_gradients = timed


def backward_and_step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> tuple[float, float]:
    """Backward (the fused sparse update runs inside it) then the dense step; returns
    the ``perf_counter`` after each."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t3 = time.perf_counter()
    opt.step()
    return t3, time.perf_counter()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_throughput(
    cfg: Config,
    steps: int = 50,
    warmup: int = 10,
    distinct_batches: int = 8,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    threads = cfg.train.threads or available_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    b = cfg.train.batch_size
    echo(
        f"building model ({sum(cfg.model.table_sizes):,} rows x dim {cfg.model.embedding_dim}) ..."
    )
    model = build_model(cfg.model, cfg.embedding, seed=cfg.train.seed)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    tiered = bool(cached_storages(model.embeddings))
    if tiered:  # fresh batches every step, or the cache would just learn 8 batches
        distinct_batches = warmup + steps
        echo(f"generating {distinct_batches} batches ...")
    batches = [data.batch(i, b) for i in range(distinct_batches)]
    ids_per_sample = sum(x.values.numel() for x in batches) / (b * len(batches))
    timer = _SparseTimer(model)
    totals = dict.fromkeys(STAGES, 0.0)

    step_seconds: list[float] = []

    def step(batch, record: bool) -> None:
        t0 = time.perf_counter()
        sparse0 = timer.seconds
        pooled = model.embed(batch)
        t1 = time.perf_counter()
        x = model.bottom(batch.dense) if model.bottom is not None else None
        logits = model.top(model.interaction(x, pooled)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        t2 = time.perf_counter()
        t3, t4 = backward_and_step(loss, opt)
        if record:
            step_seconds.append(t4 - t0)
            sparse = timer.seconds - sparse0
            for k, v in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2 - sparse, sparse, t4 - t3)):
                totals[k] += v

    echo(f"warm-up {warmup} steps, then {steps} timed steps of batch {b} on {threads} threads ...")
    # ssd tier: the prefetch pipeline brings batch t+1's rows in while step t runs; the
    # step time then includes any wait for it (reported as prefetch_wait).
    source = iter(CachePrefetcher(batches, model.embeddings)) if tiered else None
    waits: list[float] = []

    def next_batch(i: int, record: bool):
        if source is None:
            return batches[i % len(batches)]
        t = time.perf_counter()
        batch = next(source)
        if record:
            waits.append(time.perf_counter() - t)
        return batch

    for i in range(warmup):
        step(next_batch(i, False), record=False)
    for st in cached_storages(model.embeddings):
        st.stats = type(st.stats)()  # count the steady state only
    start = time.perf_counter()
    for i in range(steps):
        step(next_batch(i, True), record=True)
    for i, w in enumerate(waits):  # a step's time includes waiting for its batch
        step_seconds[i] += w
    elapsed = time.perf_counter() - start
    # Steady state = the median step: robust to the multi-ms stalls a shared VM
    # injects now and then; the mean over all steps is reported beside it.
    sps = b / statistics.median(step_seconds)

    gemm = measure_gemm_gflops(b)
    weights = [getattr(g.storage, "weight", None) for g in model.embeddings.groups]
    weights = [w for w in weights if w is not None] or [
        torch.empty(1 << 20, cfg.model.embedding_dim)
    ]
    gather = measure_gather_gbps(max(weights, key=len))
    cost = step_cost(cfg, model.interaction.out_dim, ids_per_sample)
    bound = cost.bound_samples_per_s(gemm, gather)
    cache = cache_report(model.embeddings, 0.0, sum(waits))
    return {
        **(
            {"embedding_cache": cache, "prefetch_wait_ms": 1e3 * sum(waits) / steps}
            if cache
            else {}
        ),
        "samples_per_s": sps,
        "samples_per_s_mean": steps * b / elapsed,
        "bound_samples_per_s": bound,
        "ratio_to_bound": sps / bound,
        "ms_per_step": 1e3 * b / sps,
        "stage_ms": {k: 1e3 * v / steps for k, v in totals.items()},
        "peak_rss_bytes": peak_rss_bytes(),
        "model_state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "gemm_gflops": gemm,
        "gather_gbps": gather,
        "mlp_gflop_per_sample": cost.mlp_flops_per_sample / 1e9,
        "embedding_bytes_per_sample": cost.embedding_bytes_per_sample,
        "batch_size": b,
        "threads": threads,
        "steps": steps,
        "sparse_optimizer": cfg.embedding.optimizer,
        "kernels": cfg.model.kernels,
        "native": native.status(),
    }


def format_report(name: str, r: dict[str, Any]) -> str:
    stages = "  ".join(f"{k} {v:.2f}" for k, v in r["stage_ms"].items())
    gib = 1 << 30
    return "\n".join(
        [
            f"config {name}: {r['samples_per_s']:,.0f} samples/s  (bound {r['bound_samples_per_s']:,.0f}, "
            f"ratio {r['ratio_to_bound']:.2f}; mean over all steps {r['samples_per_s_mean']:,.0f})",
            f"  {r['ms_per_step']:.2f} ms/step (median) of batch {r['batch_size']} on {r['threads']} threads; "
            f"stages (ms): {stages}",
            f"  peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB (model + optimizer state "
            f"{r['model_state_bytes'] / gib:.2f} GiB)",
            *(
                [
                    f"  ssd tier: cache hit rate {r['embedding_cache']['hit_rate']:.1%} "
                    f"({r['embedding_cache']['cache_rows']:,} of {r['embedding_cache']['table_rows']:,} rows), "
                    f"{r['embedding_cache']['bytes_read'] / 1e6 / r['steps']:.2f} MB read and "
                    f"{r['embedding_cache']['bytes_written'] / 1e6 / r['steps']:.2f} MB written per step, "
                    f"prefetch wait {r['prefetch_wait_ms']:.2f} ms/step"
                ]
                if "embedding_cache" in r
                else []
            ),
            f"  kernels: {r['kernels']}; native C kernels {r['native']}",
            f"  machine: GEMM {r['gemm_gflops']:.0f} GFLOP/s, random gather {r['gather_gbps']:.2f} GB/s; "
            f"per sample {r['mlp_gflop_per_sample'] * 1e3:.2f} MFLOP MLP, "
            f"{r['embedding_bytes_per_sample']:,.0f} embedding bytes",
        ]
    )
