"""The training loop: build, train with the fused sparse optimizer, evaluate, record.

Run directory contents::

    config.toml      the fully resolved config (reload with --config RUN_DIR/config.toml)
    train_log.jsonl  one line per log interval: step, loss, samples/s, elapsed
    metrics.json     eval metrics (auc, logloss, ne, calibration, ctr) + training stats
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recscale import native
from recscale.checkpoint.manager import CheckpointManager, resolve_chain
from recscale.checkpoint.state import restore
from recscale.config.errors import ConfigError
from recscale.config.loader import config_to_toml
from recscale.config.schema import Config
from recscale.data.batch import Batch
from recscale.data.prefetch import Prefetcher
from recscale.distributed import DistContext, init_distributed, launched_by_torchrun
from recscale.distributed.checkpoint import ShardedTables, restore_sharded
from recscale.distributed.pipeline import InputDistPipeline
from recscale.distributed.planning import auto_placements
from recscale.models.dlrm import DLRM, build_model
from recscale.train.cache_prefetch import (
    CachePrefetcher,
    cache_report,
    cached_storages,
    hit_rate_since,
)
from recscale.train.data_source import adopt_dataset_shapes, eval_batches, train_batches
from recscale.train.metrics import binary_metrics
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build_sharded, evaluate_distributed, reduce_step
from recscale.train.progress import Progress


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available")
    return torch.device(name)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterable[Batch], device: torch.device) -> dict[str, float]:
    """Score every batch and compute exact metrics over all predictions."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for batch in batches:
        batch = batch.to(device)
        logits.append(model(batch).float().cpu())
        labels.append(batch.labels.cpu())
    model.train(was_training)
    return binary_metrics(torch.cat(logits), torch.cat(labels))


def save_model(model: DLRM, path: Path) -> None:
    """Weights + embedding optimizer state, written atomically (tmp + fsync + rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(model.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def train(
    cfg: Config,
    run_dir: Path | None = None,
    echo: Callable[[str], None] = print,
    resume: Path | None = None,
    ctx: DistContext | None = None,
) -> dict[str, Any]:
    """Train per ``cfg``; returns (and writes to ``run_dir``) the metrics dict.

    ``resume``: a checkpoint, or a run directory whose newest valid checkpoint
    (chain) is restored; training continues from its step with the same batches.
    Ctrl-C stops the loop cleanly: what was measured is still written (and a
    checkpoint, when checkpointing is on), with ``interrupted: true``.

    Under torchrun (or given ``ctx``) every rank runs this same function: tables are
    sharded, each rank trains on its slice of every global batch, and only rank 0
    prints, shows progress and writes ``run_dir`` (see ``train/parallel.py``).
    """
    cfg.validate()
    t = cfg.train
    torch.manual_seed(t.seed)
    threads = t.threads or available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
    torch.set_num_threads(threads)
    device = resolve_device(t.device)
    if ctx is None:
        ctx = (init_distributed(device, cfg.distributed.timeout_s) if launched_by_torchrun()
               else DistContext(device=device))  # fmt: skip
    device = ctx.device
    ckpt_root = run_dir / "checkpoints" if run_dir is not None else None
    if not ctx.is_main:  # one voice and one writer: rank 0
        echo, run_dir = (lambda _msg: None), None
    note = adopt_dataset_shapes(cfg)
    if note:
        echo(f"recscale: {note}")
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_to_toml(cfg))

    placements = None
    if cfg.embedding.placement != "device":
        if ctx.distributed:
            raise ConfigError(
                "embedding.placement", "ssd, host and auto are single-process for now"
            )
        if not cfg.embedding.ssd_dir:
            cfg.embedding.ssd_dir = (
                str(run_dir / "embeddings") if run_dir else tempfile.mkdtemp(prefix="recscale-ssd-")
            )
        if cfg.embedding.placement == "auto":
            placements = auto_placements(cfg, echo)
    tables = None
    if ctx.distributed:
        model, module, plan = build_sharded(cfg, ctx, echo)
        plan_meta = plan.to_dict()
        tables = ShardedTables(model, ctx)
    else:
        model = build_model(cfg.model, cfg.embedding, device=device, seed=t.seed,
                            placements=placements)  # fmt: skip
        module = model
        plan_meta = {"world_size": 1, "tables": "whole, one storage group per dim"}
    dense_opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    ckpt = None
    if ckpt_root is not None:
        meta = {"config": config_to_toml(cfg), "plan": plan_meta}
        ckpt = CheckpointManager(cfg.checkpoint, ckpt_root, model, dense_opt, meta, tables)
    start_step = 0
    if resume is not None:
        chain = resolve_chain(resume, echo) if ctx.is_main else None
        if ctx.distributed:  # rank 0 picks (and may repair) the chain; every rank loads it
            box = [chain]
            torch.distributed.broadcast_object_list(box, src=0, group=ctx.dense)
            chain = box[0]
            start_step = int(restore_sharded(model, dense_opt, chain)["step"])
        else:
            start_step = int(restore(model, dense_opt, chain)["step"])
        echo(f"recscale: resumed from {chain[-1]} (step {start_step}; chain of {len(chain)})")
        if ckpt is not None and chain[-1].parent.resolve() == ckpt.root.resolve():
            ckpt.resume_from(chain)
    num_params = sum(p.numel() for p in model.dense_parameters())
    num_rows = sum(cfg.model.table_sizes)
    echo(
        f"recscale: DLRM with {len(cfg.model.table_sizes)} tables ({num_rows:,} rows, "
        f"dim {cfg.model.embedding_dim}), {num_params:,} dense parameters; "
        f"{t.steps} steps x batch {t.batch_size} on {device} ({threads} threads"
        + (f" per rank, {ctx.world_size} ranks)" if ctx.distributed else ")")
    )
    if (
        device.type == "cpu"
        and cfg.model.kernels in ("auto", "native")
        and native.library() is None
    ):
        echo(f"recscale: native CPU kernels unavailable ({native.status()}); using numba (slower)")

    log_file = (
        (run_dir / "train_log.jsonl").open("a" if resume else "w") if run_dir is not None else None
    )
    progress = Progress(t.steps, t.batch_size, t.progress and ctx.is_main, initial=start_step)
    source = train_batches(cfg, start_step, ctx.rank, ctx.world_size)
    stream = Prefetcher(source, depth=cfg.data.prefetch_batches)
    pipeline = cache_pipe = None
    if ctx.distributed:
        if cfg.distributed.pipeline:
            stream = pipeline = InputDistPipeline(stream, model.embeddings, device)
    elif cached_storages(model.embeddings):
        stream = cache_pipe = CachePrefetcher(stream, model.embeddings)
    batches, wait_s, window_wait, cache_seen = iter(stream), 0.0, 0.0, (0, 0)
    step, interrupted = start_step, False
    saved_step = start_step
    window_loss, window_steps, last_loss = 0.0, 0, float("nan")
    start = window_start = time.perf_counter()
    model.train()
    try:
        while True:
            t_wait = time.perf_counter()
            batch = next(batches, None)
            wait_s += time.perf_counter() - t_wait
            if batch is None:
                break
            out_of_time = bool(t.max_seconds) and time.perf_counter() - start >= t.max_seconds
            if step >= t.steps or (out_of_time and not ctx.distributed):
                break
            step += 1
            batch = batch.to(device, non_blocking=True)
            logits = module(batch)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss_value = float(loss.detach())
            if ctx.distributed:  # global mean loss; every rank stops together (see parallel.py)
                loss_value, stop = reduce_step(loss_value, out_of_time, ctx)
                if stop and math.isfinite(loss_value):
                    step -= 1
                    break
            if not math.isfinite(loss_value):
                # Checked before backward: the fused sparse update must not apply a NaN step.
                raise TrainingDiverged(
                    f"loss became {loss_value} at step {step}; stopping (no update applied)"
                )
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # also applies the embedding optimizer to the touched rows
            dense_opt.step()
            window_loss += loss_value
            window_steps += 1
            if ckpt is not None and ckpt.enabled and ckpt.due(step):
                ckpt.save(step, {"step": step})
                saved_step = step
            if step % t.log_every == 0 or step == t.steps:
                now = time.perf_counter()
                sps = window_steps * t.batch_size / max(now - window_start, 1e-9)
                last_loss = window_loss / window_steps
                extra = ""
                if cache_pipe is not None:
                    hit, cache_seen = hit_rate_since(model.embeddings, cache_seen)
                    stall_ms = 1e3 * (wait_s - window_wait) / window_steps
                    extra = f", cache hit {hit:.1%}, stall {stall_ms:.1f} ms/step"
                window_wait = wait_s
                progress.update(window_steps, last_loss, sps, extra)
                if log_file is not None:
                    rec = {
                        "step": step,
                        "loss": last_loss,
                        "samples_per_s": sps,
                        "elapsed_s": now - start,
                    }
                    log_file.write(json.dumps(rec) + "\n")
                    log_file.flush()
                window_loss, window_steps, window_start = 0.0, 0, now
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if pipeline is not None:
            pipeline.close(timeout=None if not interrupted else 5.0)
        if cache_pipe is not None:
            cache_pipe.close()
        progress.close()
        if log_file is not None:
            log_file.close()
    train_seconds = time.perf_counter() - start
    if window_steps:
        last_loss = window_loss / window_steps
    trained = step - start_step
    tiered = cfg.embedding.placement != "device"
    if (ckpt is not None and (ctx.distributed or tiered) and t.save_model and not ckpt.enabled
            and not interrupted):  # fmt: skip
        # A sharded (or ssd-tier) run's model.pt: a final checkpoint in the plan-independent
        # format, which `recscale eval` and `--resume` read at any world size and placement.
        final = replace(cfg.checkpoint, every_steps=1, async_write=False)
        ckpt = CheckpointManager(final, ckpt_root, model, dense_opt, ckpt.meta, tables)
    if ckpt is not None and ckpt.enabled and not (interrupted and ctx.distributed):
        # (an interrupted sharded run may have stopped at different steps on different
        # ranks: its last periodic checkpoint stands)
        if step != saved_step:
            ckpt.save(step, {"step": step})
        ckpt.wait()

    metrics: dict[str, Any] = {
        "steps": step,
        "samples": step * t.batch_size,
        "resumed_from_step": start_step if resume is not None else None,
        "train_seconds": train_seconds,
        "samples_per_s": trained * t.batch_size / max(train_seconds, 1e-9),
        "train_loss": last_loss,
        "interrupted": interrupted,
        "device": str(device),
        "threads": threads,
        "world_size": ctx.world_size,
        "data_wait_seconds": wait_s,
    }
    cache = cache_report(
        model.embeddings, cache_pipe.prefetch_seconds if cache_pipe else 0.0, wait_s
    )
    if cache is not None:
        metrics["embedding_cache"] = cache
        echo(
            f"embedding cache: hit rate {cache['hit_rate']:.1%} over {cache['lookups']:,} row lookups; "
            f"{cache['bytes_read'] / 1e6:,.1f} MB read, {cache['bytes_written'] / 1e6:,.1f} MB written back"
        )
    ev = None
    if not interrupted:
        try:
            if ctx.distributed:
                ev = binary_metrics(*evaluate_distributed(module, eval_batches(cfg), ctx))
            else:
                ev = evaluate(model, eval_batches(cfg), device)
        except KeyboardInterrupt:
            interrupted = metrics["interrupted"] = True
    if ev is None:
        echo(f"interrupted at step {step}; no evaluation")
        metrics.update({"auc": None, "logloss": None, "ne": None})
    else:
        metrics.update(ev)
        echo(
            f"eval on {ev['count']:,} held-out samples: AUC {ev['auc']:.4f}  logloss {ev['logloss']:.4f}  "
            f"NE {ev['ne']:.4f}  calibration {ev['calibration']:.3f}"
        )
    if ckpt is not None and ckpt.enabled:
        st = ckpt.stats
        metrics["checkpoints"] = {"saved": st.saved, "full": st.full, "incremental": st.incremental,
                                  "bytes": st.bytes, "stall_s": st.stall_seconds, "write_s": st.write_seconds,
                                  "last": st.last, "history": st.history}  # fmt: skip
    echo(
        f"trained {trained} steps in {train_seconds:.1f}s: {metrics['samples_per_s']:,.0f} samples/s"
    )
    if run_dir is not None:
        if t.save_model and not ctx.distributed and not tiered:
            save_model(model, run_dir / "model.pt")
        _write_json(run_dir / "metrics.json", metrics)
        echo(f"wrote {run_dir}/metrics.json")
    return metrics
