"""The training loop: build, train with the fused sparse optimizer, evaluate, record.

One path for every world size: a single process is world size 1 of the same code
(build, restore, loop, evaluate and save never fork on it). The stages are small
functions below; ``train`` runs them in order.

Run directory contents::

    config.toml      the fully resolved config (reload with --config RUN_DIR/config.toml)
    train_log.jsonl  one line per log interval: step, loss, samples/s, elapsed
    metrics.json     eval metrics (auc, logloss, ne, calibration, ctr) + training stats
    checkpoints/     periodic checkpoints, and the final model (``recscale eval`` and
                     ``--resume`` read it at any world size and placement)
"""

from __future__ import annotations

import copy
import math
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from recscale import locks, native
from recscale.checkpoint.format import CheckpointError, read_manifest
from recscale.checkpoint.manager import CheckpointManager, resolve_chain, valid_chains
from recscale.checkpoint.state import restore
from recscale.config.errors import ConfigError, counted
from recscale.config.loader import config_to_toml
from recscale.config.schema import Config
from recscale.config.small_files import json_text, kind_of, open_log, write_text_atomic
from recscale.data.dataset import BinaryDataset
from recscale.data.prefetch import DeviceFeeder, Prefetcher
from recscale.distributed import DistContext, init_distributed, launched_by_torchrun, shutdown
from recscale.distributed.pipeline import EmbeddingPipeline
from recscale.embedding.cached_storage import TEMP_DIR_PREFIX
from recscale.embedding.sizing import compression_summary
from recscale.metrics import metrics_text
from recscale.models.dlrm import DLRM
from recscale.planner.from_config import batch_ids_per_table
from recscale.train.cache_prefetch import (
    cache_report,
    cached_storages,
    hit_rate_since,
    prefetch_depth,
    prefetch_on_thread,
    stall_guard,
    warm_caches,
)
from recscale.train.config_agreement import settle_on_every_rank
from recscale.train.data_source import (
    adopt_dataset_shapes,
    check_synthetic_memory,
    eval_batches,
    resume_batch_note,
    train_batches,
)
from recscale.train.hot_rows import assign_hot_rows
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build, reduce_step, score
from recscale.train.precision import bf16_note, tf32_note
from recscale.train.progress import Progress
from recscale.train.schedule import LRSchedule, schedule_note, scheduled
from recscale.train.step import (
    available_cores,
    backward_and_step,
    forward_loss,
    setup_process,
    start_steps,
    threads_note,
)
from recscale.train.stop import stop_at_step_boundary


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class RunDirInUse(RuntimeError):
    """The run directory holds another run (and this one is not resuming it)."""


def check_run_dir(run_dir: Path, resume: Path | None) -> None:
    """Refuse a run directory that holds another run: its checkpoints would be counted
    (and pruned) as this run's, and ``--resume`` would restore the other run. Resuming
    the run in that very directory is fine."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirInUse(
            f"--run-dir {run_dir} is {kind_of(run_dir)}; name a directory for the run"
        )
    if run_dir.resolve() == Path(run_dir.resolve().anchor):  # `--run-dir /` wrote /metrics.json
        raise RunDirInUse(
            f"--run-dir {run_dir} is the filesystem root; name a directory for the run"
        )
    marks = [n for n in ("config.toml", "metrics.json", "checkpoints") if (run_dir / n).exists()]
    if not marks:
        return
    if resume is not None:
        r = Path(resume).resolve()
        if run_dir.resolve() in (r, *r.parents):
            return
    raise RunDirInUse(
        f"{run_dir} holds another run ({', '.join(marks)}); continue it with --resume {run_dir}, "
        "or choose another --run-dir"
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_text_atomic(path, json_text(obj, indent=2, sort_keys=True) + "\n")


@dataclass
class Job:
    """What a training run is made of, once built (the config no longer changes)."""

    cfg: Config
    ctx: DistContext
    threads: int
    model: DLRM
    module: torch.nn.Module  # what is called: the model, DDP-wrapped on several ranks
    dense_opt: torch.optim.Optimizer
    ckpt: CheckpointManager | None
    plan_meta: dict[str, Any]
    run_dir: Path | None  # None on ranks other than 0: one writer
    echo: Callable[[str], None]


@dataclass
class LoopResult:
    step: int
    saved_step: int
    interrupted: bool
    last_loss: float
    seconds: float
    wait_s: float
    prefetch_s: float
    evals: list[dict[str, Any]]  # train.eval_every: the validation scores along the way
    reached: dict[str, Any] | None  # train.target_auc: the evaluation that reached it
    stop_signal: str | None = None  # SIGINT / SIGTERM that stopped it on this rank
    out_of_time: bool = False  # train.max_seconds ended it (on any rank) before train.steps


def _settle_config(cfg: Config, run_dir: Path | None, echo) -> Config:
    """A copy of ``cfg`` with everything decided before the run (dataset shapes, the ssd
    directory); the run never changes it afterwards."""
    cfg = copy.deepcopy(cfg)
    cfg.validate()
    note = adopt_dataset_shapes(cfg)
    if note:
        echo(f"recscale: {note}")
    if cfg.train.epochs > 0:  # steps from the data; the run's config records the steps
        if not cfg.data.uses_dataset():
            raise ConfigError(
                "train.epochs",
                "needs a dataset (data.path): synthetic data has no epochs; use train.steps",
            )
        rows = BinaryDataset(cfg.data.path, cfg.data.train_split).rows
        cfg.train.steps = max(1, math.ceil(cfg.train.epochs * rows / cfg.train.batch_size))
        echo(
            f"recscale: {cfg.train.epochs:g} epochs of {rows:,} rows = {cfg.train.steps:,} steps "
            f"of batch {cfg.train.batch_size}"
        )
        cfg.train.epochs = 0.0
    if cfg.embedding.placement != "device" and not cfg.embedding.ssd_dir:
        cfg.embedding.ssd_dir = (
            str(run_dir / "embeddings") if run_dir else tempfile.mkdtemp(prefix=TEMP_DIR_PREFIX)
        )
    return cfg


def _process(cfg: Config, ctx: DistContext | None) -> tuple[DistContext, int]:
    device, threads = setup_process(cfg)
    if ctx is None:
        ctx = (
            init_distributed(device, cfg.distributed.timeout_s)
            if launched_by_torchrun()
            else DistContext(device=device)
        )
    return ctx, threads


def build_job(
    cfg: Config, run_dir: Path | None, echo, ctx: DistContext | None, resume: Path | None = None
) -> Job:
    ctx, threads = _process(cfg, ctx)
    if run_dir is not None and ctx.distributed:
        # rank 0's directory on every rank: a default name (runs/<timestamp>) is each
        # rank's own clock, and rank 1 seeing rank 0's new directory took runs/<t>-2 -
        # its checkpoint parts went there while rank 0 waited for them
        run_dir = Path(ctx.broadcast(str(run_dir)))
    if run_dir is not None:
        check_run_dir(run_dir, resume)
        if ctx.is_main:  # one writer: a second run or --resume on this directory stops here
            locks.hold(run_lock(run_dir), f"run directory {run_dir}")
    ckpt_root = run_dir / "checkpoints" if run_dir is not None else None
    if not ctx.is_main:  # one voice and one writer: rank 0
        echo, run_dir = (lambda _msg: None), None
    cfg = settle_on_every_rank(lambda: _settle_config(cfg, run_dir, echo), ctx)
    if not cfg.data.uses_dataset():  # refused now, not after the training it would end
        check_synthetic_memory(cfg)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    model, module, plan = build(cfg, ctx, echo, init_rows=resume is None)
    if resume is None:  # a resumed run restores its hot ids with the factors
        assign_hot_rows(model, cfg, echo)
    dense_opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    plan_meta = plan.to_dict()
    ckpt = None
    if ckpt_root is not None and (
        cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes or cfg.train.save_model
    ):
        meta = {"config": config_to_toml(cfg), "plan": plan_meta}
        ckpt = CheckpointManager(
            cfg.checkpoint, ckpt_root, model, dense_opt, meta, ctx, cfg.distributed.timeout_s, echo
        )
    return Job(cfg, ctx, threads, model, module, dense_opt, ckpt, plan_meta, run_dir, echo)


def restore_job(job: Job, resume: Path) -> int:
    """Restore the newest valid chain under ``resume`` on every rank; returns its step.
    Rank 0 picks (and may repair) the chain; every rank loads its own parts of it."""
    ctx = job.ctx
    if ctx.world_size == 1:  # a chain that verifies but does not load: the next older one
        passed: list[tuple[str, CheckpointError]] = []  # the newer ones, and why
        try:
            for chain in valid_chains(resume, job.echo):
                try:
                    step = int(restore(job.model, job.dense_opt, chain)["step"])
                    break
                except CheckpointError as e:
                    passed.append((chain[-1].name, e))
            else:
                raise CheckpointError(f"no usable checkpoint in {resume}")
        except CheckpointError as e:  # none loads: why the newest did not (a config that
            raise (passed[0][1] if passed else e) from None  # fits none said it each time)
        for name, why in passed:
            job.echo(f"recscale: skipping checkpoint {name}: {why}")
    else:
        chain = ctx.broadcast(resolve_chain(resume, job.echo) if ctx.is_main else None)
        step = int(restore(job.model, job.dense_opt, chain)["step"])
    job.echo(f"recscale: resumed from {chain[-1]} (step {step}; chain of {len(chain)})")
    if ctx.is_main:
        note = resume_batch_note(job.cfg, read_manifest(chain[-1]).get("config"), step)
        if note:
            job.echo(f"recscale: {note}")
    if job.ckpt is not None and chain[-1].parent.resolve() == job.ckpt.root.resolve():
        job.ckpt.resume_from(chain)
    return step


def _announce(job: Job) -> None:
    cfg, ctx, t = job.cfg, job.ctx, job.cfg.train
    num_params = sum(p.numel() for p in job.model.dense_parameters())
    num_rows = sum(cfg.model.table_sizes)
    job.echo(
        f"recscale: DLRM with {len(cfg.model.table_sizes)} tables ({num_rows:,} rows, "
        f"dim {cfg.model.embedding_dim}), {num_params:,} dense parameters; "
        f"{t.steps:,} steps x batch {t.batch_size:,} on {ctx.device} "
        f"({counted(job.threads, 'thread')}"
        + (f" per rank, {ctx.world_size} ranks)" if ctx.distributed else ")")
    )
    for line in compression_summary(cfg):
        job.echo(f"recscale: {line}")
    for note in (
        bf16_note(t.precision, ctx.device),
        tf32_note(t.precision, ctx.device),
        threads_note(job.threads, ctx.device),
        schedule_note(cfg.optimizer, t.steps),
    ):
        if note:
            job.echo(f"recscale: {note}")
    if (
        ctx.device.type == "cpu"
        and cfg.model.kernels in ("auto", "native")
        and native.library() is None
    ):
        job.echo(
            f"recscale: native CPU kernels unavailable ({native.status()}); using numba (slower)"
        )


def train_loop(job: Job, start_step: int, resumed: bool) -> LoopResult:
    """Steps from ``start_step`` to ``train.steps`` (or a stop); Ctrl-C ends it cleanly."""
    cfg, ctx, t, model = job.cfg, job.ctx, job.cfg.train, job.model
    ebc = model.embeddings
    log_file = None
    if job.run_dir is not None:
        log_file = open_log(job.run_dir / "train_log.jsonl", append=resumed)
    progress = Progress(t.steps, t.batch_size, t.progress and ctx.is_main, initial=start_step)
    stream = Prefetcher(
        train_batches(cfg, start_step, ctx.rank, ctx.world_size),
        depth=cfg.data.prefetch_batches,
        pin=ctx.device.type == "cuda",
    )
    stream = DeviceFeeder(stream, ctx.device)  # CUDA: pinned, copied ahead on a side stream
    pipeline = None
    # A thread runs ahead when there is something to overlap: an input all-to-all, or
    # the prefetch of a cached tier (one process, device tables: neither; a tier whose
    # prefetch is CPU work with no core free for it: inline, ``prefetch_on_thread``).
    dist_ahead = cfg.distributed.pipeline and not ebc.identity
    prefetch_ahead = False
    if ebc.tiered():
        prefetch_ahead, why = prefetch_on_thread(ebc, cfg.embedding, job.threads, available_cores())
        if not dist_ahead:
            where = "a background thread" if prefetch_ahead else "inline, in each lookup"
            job.echo(f"recscale: cache prefetch: {where} ({why})")
    if dist_ahead or prefetch_ahead:
        guard = stall_guard(ebc, cfg.embedding, ctx.world_size)
        stream = pipeline = EmbeddingPipeline(stream, ebc, ctx.device, prefetch_depth(ebc), *guard)
    cached = bool(cached_storages(ebc))
    batches, wait_s, window_wait, cache_seen = iter(stream), 0.0, 0.0, (0, 0)
    step = saved_step = start_step
    interrupted = timed_out = False
    window_loss, window_steps, last_loss = 0.0, 0, float("nan")
    start = window_start = time.perf_counter()
    schedule = None
    if scheduled(cfg.optimizer):
        schedule = LRSchedule(cfg.optimizer, job.dense_opt, ebc.storages(), cfg.embedding.lr)
    evals: list[dict[str, Any]] = []
    reached_at = None
    job.module.train()
    signals = None
    try:
        with stop_at_step_boundary() as signals:
            while True:
                t_wait = time.perf_counter()
                batch = next(batches, None)
                wait_s += time.perf_counter() - t_wait
                if batch is None or step >= t.steps:
                    break
                out_of_time = bool(t.max_seconds) and time.perf_counter() - start >= t.max_seconds
                step += 1
                if schedule is not None:
                    schedule.step(step)
                batch = batch.to(ctx.device, non_blocking=True)
                # activations checked for NaN/inf too: a fused ReLU can hide them from the loss
                loss = forward_loss(job.module, batch, t.precision, ctx.device, check_finite=True)
                # the global mean loss; every rank stops together (see parallel.py)
                saving = job.ckpt is not None and job.ckpt.enabled
                loss_value, stop, interrupted, clock_due = reduce_step(
                    float(loss.detach()),
                    out_of_time,
                    signals.requested,
                    ctx,
                    saving and job.ckpt.due_by_time(),
                )
                if stop and math.isfinite(loss_value):
                    step -= 1  # this forward is dropped: the step boundary is the one before
                    timed_out = not interrupted
                    break
                if not math.isfinite(loss_value):
                    # Checked before backward: the fused sparse update must not apply a NaN step.
                    raise TrainingDiverged(
                        f"loss (or an activation) became {loss_value} at step {step}; stopping "
                        "(no update applied): lower the learning rates, or train in fp32"
                    )
                # + the embeddings' fused update
                backward_and_step(loss, job.dense_opt, t.precision, ctx.device)
                window_loss += loss_value
                window_steps += 1
                if saving and (clock_due or job.ckpt.due_by_steps(step)):  # any rank's clock
                    job.ckpt.save(step, {"step": step})
                    saved_step = step
                if t.eval_every and step % t.eval_every == 0:
                    ev = evaluate_during(job, step, time.perf_counter() - start, log_file)
                    evals.append(ev)
                    if t.target_auc and ev["auc"] >= t.target_auc:  # the same on every rank
                        reached_at = ev
                        job.echo(
                            f"recscale: target AUC {t.target_auc} reached at step {step} "
                            f"({ev['elapsed_s']:.1f}s)"
                        )
                        break
                if step % t.log_every == 0 or step == t.steps:
                    now = time.perf_counter()
                    sps = window_steps * t.batch_size / max(now - window_start, 1e-9)
                    last_loss = window_loss / window_steps
                    extra = ""
                    if cached:
                        hit, cache_seen = hit_rate_since(ebc, cache_seen)
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
                        log_file.write(json_text(rec) + "\n")
                        log_file.flush()
                    window_loss, window_steps, window_start = 0.0, 0, now
    except KeyboardInterrupt:  # a second signal: stopped mid-step
        interrupted = True
    finally:
        if pipeline is not None:
            pipeline.close(timeout=5.0 if interrupted or pipeline.stalled else None)
        progress.close()
        if log_file is not None:
            log_file.close()
    if window_steps:
        last_loss = window_loss / window_steps
    stop_signal = None
    if signals is not None and signals.signum is not None:
        stop_signal = signal.Signals(signals.signum).name
    return LoopResult(
        step,
        saved_step,
        interrupted,
        last_loss,
        time.perf_counter() - start,
        wait_s,
        pipeline.prefetch_seconds if pipeline is not None else 0.0,
        evals,
        reached_at,
        stop_signal,
        timed_out,
    )


def evaluate_during(job: Job, step: int, elapsed: float, log_file) -> dict[str, Any]:
    """Score the validation split mid-training (every rank; the result is global)."""
    cfg = job.cfg
    split = cfg.data.val_split if cfg.data.uses_dataset() else None
    m = score(job.module, eval_batches(cfg, split), job.ctx, cfg.train.precision)
    ev = {"step": step, "elapsed_s": elapsed, "auc": m["auc"], "logloss": m["logloss"]}
    job.echo(f"step {step}: validation {metrics_text(m)}")
    if log_file is not None:
        log_file.write(
            json_text(
                {
                    "step": step,
                    "val_auc": m["auc"],
                    "val_logloss": m["logloss"],
                    "elapsed_s": elapsed,
                }
            )
            + "\n"
        )
        log_file.flush()
    return ev


def save_final(job: Job, loop: LoopResult) -> None:
    """The final checkpoint (the trained model when ``train.save_model``): every rank its
    parts. An interrupted run on several ranks may have stopped at different steps on
    different ranks: its last periodic checkpoint stands."""
    ckpt, t = job.ckpt, job.cfg.train
    if ckpt is None or (loop.interrupted and job.ctx.world_size > 1):
        return
    if not ckpt.enabled:
        if not t.save_model or loop.interrupted:
            return
        final = replace(job.cfg.checkpoint, every_steps=1, async_write=False)
        ckpt = job.ckpt = CheckpointManager(
            final,
            ckpt.root,
            job.model,
            job.dense_opt,
            ckpt.meta,
            job.ctx,
            job.cfg.distributed.timeout_s,
        )
    if loop.step != loop.saved_step:  # the same on every rank: they stop at the same step
        ckpt.save(loop.step, {"step": loop.step})
    ckpt.wait()


def evaluate_job(job: Job) -> dict[str, float] | None:
    """Exact metrics over the whole eval set (every rank scores its slice); None when
    interrupted."""
    try:
        return score(job.module, eval_batches(job.cfg), job.ctx, job.cfg.train.precision)
    except KeyboardInterrupt:
        return None


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
    Ctrl-C (or SIGTERM) stops the loop cleanly: what was measured is still written (and
    a checkpoint, when checkpointing is on), with ``interrupted: true``.

    Under torchrun (or given ``ctx``) every rank runs this same function: tables are
    sharded, each rank trains on its slice of every global batch, and only rank 0
    prints, shows progress and writes ``run_dir`` (see ``train/parallel.py``). The
    process group made here (no ``ctx`` given) is destroyed when the run ends normally.
    """
    owns_process_group = ctx is None  # made here (under torchrun): destroyed here
    try:
        job = build_job(cfg, run_dir, echo, ctx, resume)
        start_step = restore_job(job, resume) if resume is not None else 0
        warm_caches(job.model.embeddings, job.echo, job.cfg.embedding, batch_ids_per_table(job.cfg))
        start_steps(job.cfg)
        if job.run_dir is not None:  # only now: a failed resume leaves the run's config alone
            write_text_atomic(job.run_dir / "config.toml", config_to_toml(job.cfg))
        _announce(job)
        loop = train_loop(job, start_step, resume is not None)
        save_final(job, loop)
        metrics = record(job, loop, start_step, resume is not None)
    finally:
        if run_dir is not None:
            locks.release(run_lock(run_dir))
    if owns_process_group:
        shutdown(job.ctx)
    return metrics


def run_lock(run_dir: Path) -> Path:
    return run_dir / ".recscale.lock"


def record(job: Job, loop: LoopResult, start_step: int, resumed: bool) -> dict[str, Any]:
    """Evaluate (unless interrupted), print and write ``metrics.json``."""
    t, ctx, echo = job.cfg.train, job.ctx, job.echo
    trained = loop.step - start_step
    metrics: dict[str, Any] = {
        "steps": loop.step,
        "samples": loop.step * t.batch_size,
        "resumed_from_step": start_step if resumed else None,
        "train_seconds": loop.seconds,
        "samples_per_s": trained * t.batch_size / max(loop.seconds, 1e-9),
        "train_loss": loop.last_loss,
        "interrupted": loop.interrupted,
        "stop_signal": loop.stop_signal,
        "device": str(ctx.device),
        "threads": job.threads,
        "world_size": ctx.world_size,
        "data_wait_seconds": loop.wait_s,
    }
    if loop.evals:
        metrics["validation"] = loop.evals
    if t.target_auc:
        metrics["target_auc"] = t.target_auc
        metrics["time_to_target_s"] = loop.reached["elapsed_s"] if loop.reached else None
        metrics["target_reached_step"] = loop.reached["step"] if loop.reached else None
    cache = cache_report(job.model.embeddings, loop.prefetch_s, loop.wait_s)
    if cache is not None:
        metrics["embedding_cache"] = cache
        echo(
            f"embedding cache: hit rate {cache['hit_rate']:.1%} over {cache['lookups']:,} row "
            "lookups; "
            f"{cache['bytes_read'] / 1e6:,.1f} MB read, {cache['bytes_written'] / 1e6:,.1f} MB "
            "written back"
            + (
                f"; slipstream skipped {cache['skipped_updates']:,} of "
                f"{cache['id_updates']:,} id updates as stale"
                if job.cfg.embedding.slipstream
                else ""
            )
        )
    ev = None if loop.interrupted else evaluate_job(job)
    if ev is None:
        metrics["interrupted"] = True
        echo(f"interrupted at step {loop.step}; no evaluation")
        metrics.update({"auc": None, "logloss": None, "ne": None})
    else:
        metrics.update(ev)
        echo(f"eval on {ev['count']:,} held-out samples: {metrics_text(ev)}")
    if job.ckpt is not None and job.ckpt.stats.saved:
        st = job.ckpt.stats
        metrics["checkpoints"] = {
            "saved": st.saved,
            "full": st.full,
            "incremental": st.incremental,
            "bytes": st.bytes,
            "stall_s": st.stall_seconds,
            "write_s": st.write_seconds,
            "last": st.last,
            "history": st.history,
        }
    if loop.out_of_time:  # said, or a short run reads as a finished one
        metrics["stopped_by"] = "train.max_seconds"
        echo(f"stopped at step {loop.step:,} of {t.steps:,}: train.max_seconds reached")
    echo(
        f"trained {trained:,} steps in {loop.seconds:.1f}s: "
        f"{metrics['samples_per_s']:,.0f} samples/s"
    )
    if job.run_dir is not None:
        _write_json(job.run_dir / "metrics.json", metrics)
        echo(f"wrote {job.run_dir}/metrics.json")
    return metrics
