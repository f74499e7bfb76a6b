"""``recscale bench throughput``: steady-state training samples/s against the hardware bound.

Batches are generated beforehand (cycled; on the training device), so the figure
measures training, not data generation. The model is built exactly as ``recscale
train`` builds it (``train.parallel.build``: world size 1 of the sharded pipeline) on
``train.device``, in ``train.precision``. On CUDA every stage is timed with CUDA events
on the stream (no host syncs inside a step) and the bound comes from the GPU's own
probes. Each timed step is split into stages::

    lookup     embedding forward (one fused lookup over all tables)
    forward    bottom MLP + interaction + top MLP + loss (each also on its own in
               ``stage_detail_ms``, with ``data``: making one batch)
    backward   autograd backward, excluding ...
    sparse     ... the fused sparse optimizer applied inside the embedding backward
    dense_opt  the dense optimizer step
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from recscale import native
from recscale.bench.disk import DiskCounters, measure_file_read_iops
from recscale.bench.hardware import (
    OtherLoad,
    best_on_record,
    measure_gather_gbps,
    measure_gemm_gflops,
    step_cost,
)
from recscale.config.schema import Config
from recscale.distributed import DistContext
from recscale.distributed.pipeline import EmbeddingPipeline
from recscale.embedding.row_io import io_uring_available
from recscale.embedding.storage import DeviceStorage
from recscale.modules import dot_interaction_cpu
from recscale.modules.gemm import fp32_route
from recscale.modules.interaction import DotInteraction
from recscale.modules.mlp import bf16_mlp_path
from recscale.native.team import team_status
from recscale.planner.from_config import batch_ids_per_table
from recscale.train.cache_prefetch import (
    cache_report,
    cached_storages,
    prefetch_depth,
    prefetch_on_thread,
    warm_caches,
)
from recscale.train.data_source import make_synthetic
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build
from recscale.train.precision import bf16_hardware, bf16_note, tf32_note
from recscale.train.step import (
    available_cores,
    backward_and_step,
    forward_loss,
    setup_process,
    start_steps,
    threads_note,
)

STAGES = ("lookup", "forward", "backward", "sparse", "dense_opt")


class Clock:
    """Timestamps on the host (CPU) or CUDA events on the current stream (GPU): a step's
    stages are timed without syncing the device inside the step; ``seconds`` resolves
    them at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3


class _SparseTimer:
    """Wraps each storage's fused backward (apply_pooled_gradients) to time it."""

    def __init__(self, model, clock: Clock) -> None:
        self.spans: list[tuple] = []
        for storage in model.embeddings.storages():
            original = storage.apply_pooled_gradients

            def timed(*args, _orig=original):
                t = clock.mark()
                _orig(*args)
                self.spans.append((t, clock.mark()))

            storage.apply_pooled_gradients = timed


def bf16_pooled(model, device: torch.device) -> bool:
    """Whether a bf16 step of ``model`` pools its embeddings in bf16 for the interaction
    (``DotInteraction.takes_bf16_pooled``)."""
    inter = getattr(model, "interaction", None)
    if not isinstance(inter, DotInteraction):
        return False
    with torch.autocast(device.type, dtype=torch.bfloat16):
        return inter.takes_bf16_pooled(device)


def interaction_on_amx(model) -> bool:
    """Whether that bf16 interaction runs on AMX tiles
    (``dot_interaction_cpu.amx_interaction``)."""
    inter = model.interaction
    return dot_interaction_cpu.amx_interaction(inter.dim, inter.num_rows, inter.self_interaction)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_throughput(
    cfg: Config,
    steps: int = 50,
    warmup: int = 10,
    distinct_batches: int = 8,
    echo: Callable[[str], None] = print,
    turns: Iterable[int] | None = None,
    on_turn: Callable[[list[float]], None] | None = None,
) -> dict[str, Any]:
    """Train ``warmup`` steps, then time ``steps`` steps and report them against the
    bound (the module docstring lists the stages).

    ``turns`` times the steps in turns instead, for a benchmark that alternates this
    process with another (``benchmarks/peers.py --interleave``): ``n`` steps for each
    ``n`` it yields, ``on_turn`` called with those steps' seconds after each turn. The
    iterator is first advanced after the warm-up and may wait (e.g. on stdin) between
    turns: only the turns' own time counts.
    """
    device, threads = setup_process(cfg)  # as training sets its process up
    precision = cfg.train.precision
    clock = Clock(device)
    b = cfg.train.batch_size
    echo(
        f"building model ({sum(cfg.model.table_sizes):,} rows x dim {cfg.model.embedding_dim}) "
        f"on {device} ..."
    )
    model, _module, _plan = build(cfg, DistContext(device=device), echo)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    tiered = bool(cached_storages(model.embeddings))
    warm_caches(model.embeddings, echo, cfg.embedding, batch_ids_per_table(cfg))
    retain = start_steps(cfg)
    if tiered and turns is not None:
        raise ValueError(
            "bench throughput: turns need the tables on the device "
            "(embedding.placement=device): a tier's batches are made per step"
        )
    if tiered:  # fresh batches every step, or the cache would just learn 8 batches
        distinct_batches = warmup + steps
        echo(f"generating {distinct_batches} batches ...")
    # made once, then held on the device: the figure is the training step alone
    t_data = time.perf_counter()
    batches = [data.batch(i, b).to(device) for i in range(distinct_batches)]
    data_ms = (
        1e3 * (time.perf_counter() - t_data) / distinct_batches
    )  # made by the loader thread in training
    ids_per_sample = sum(x.values.numel() for x in batches) / (b * len(batches))
    timer = _SparseTimer(model, clock)
    marks: list[tuple] = []

    def step(batch, record: bool) -> None:
        """Training's step (train/step.py), with the clock marking the model's stages."""
        t0 = clock.mark()
        n_sparse = len(timer.spans)
        stages: list = []
        loss = forward_loss(
            model, batch, precision, device, mark=lambda: stages.append(clock.mark())
        )
        t2 = clock.mark()
        t3, t4 = backward_and_step(loss, opt, precision, device, clock.mark)
        if record:
            t1, tb, ti = stages
            marks.append((t0, t1, t2, t3, t4, timer.spans[n_sparse:], (t1, tb, ti, t2)))
        else:
            timer.spans.clear()

    for note in (
        bf16_note(precision, device),
        tf32_note(precision, device),
        threads_note(threads, device),
    ):
        if note:
            echo(f"note: {note}")
    echo(
        f"warm-up {warmup} steps, then {steps if turns is None else 'turns of'} timed steps "
        f"of batch {b} on {device}"
        + (f" ({threads} threads)" if device.type == "cpu" else f" ({precision})")
        + " ..."
    )
    # host/ssd tiers: the embedding pipeline brings batch t+1's rows in while step t runs
    # (as in training, where ``prefetch_on_thread`` says so; else each lookup brings its
    # own); the step time then includes any wait for it (prefetch_wait).
    source, prefetch_mode = None, None
    if tiered:
        ahead, why = prefetch_on_thread(model.embeddings, cfg.embedding, threads, available_cores())
        prefetch_mode = "thread" if ahead else "inline"
        echo(f"cache prefetch: {'a background thread' if ahead else 'inline'} ({why})")
        if ahead:
            depth = prefetch_depth(model.embeddings)
            source = iter(EmbeddingPipeline(iter(batches), model.embeddings, device, depth))
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
        st.rows.stats = type(st.rows.stats)()
    disk_start = DiskCounters.now()
    elapsed, i = 0.0, 0
    for n in [steps] if turns is None else turns:
        first = len(marks)
        if clock.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            step(next_batch(i, True), record=True)
            i += 1
        if clock.cuda:
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        if on_turn is not None:
            on_turn([clock.seconds(m[0], m[4]) for m in marks[first:]])
    steps = i
    if not steps:
        raise ValueError("bench throughput: no timed step (steps = 0, or no turn)")
    totals = dict.fromkeys(STAGES, 0.0)
    detail = dict.fromkeys(("bottom_mlp", "interaction", "top_mlp"), 0.0)
    step_seconds: list[float] = []
    for i, (t0, t1, t2, t3, t4, spans, fwd) in enumerate(marks):
        for k, (a, z) in zip(detail, zip(fwd[:-1], fwd[1:])):
            detail[k] += clock.seconds(a, z)
        sparse = sum(clock.seconds(a, z) for a, z in spans)
        parts = (
            clock.seconds(t0, t1),
            clock.seconds(t1, t2),
            clock.seconds(t2, t3) - sparse,
            sparse,
            clock.seconds(t3, t4),
        )
        for k, v in zip(STAGES, parts):
            totals[k] += v
        # a step's time includes waiting for its batch
        step_seconds.append(clock.seconds(t0, t4) + (waits[i] if waits else 0.0))
    # Steady state = the median step: robust to the multi-ms stalls a shared VM
    # injects now and then; the mean over all steps is reported beside it.
    sps = b / statistics.median(step_seconds)

    # The bound's probes: the best of several repeats, re-taken (up to twice more) when
    # other processes kept a core busy meanwhile, and again (up to three times) while the
    # step beat the bound; then the best this host ever read (hardware.best_on_record):
    # the host can slow a VM with no sign inside it.
    load = OtherLoad()
    gemm = measure_gemm_gflops(b, device, precision)
    probe_load = load.cores_busy()
    for _ in range(2):
        if device.type != "cpu" or probe_load is None or probe_load < 0.25:
            break
        echo(f"the machine was busy during the GEMM probe ({probe_load:.2f} other cores): again")
        gemm = max(gemm, measure_gemm_gflops(b, device, precision))
        probe_load = load.cores_busy()
    weights = [s.weight for s in model.embeddings.storages() if isinstance(s, DeviceStorage)] or [
        # written, so its pages are real (untouched ones all read the one zero page)
        torch.ones(1 << 20, cfg.model.embedding_dim, device=device)
    ]
    table = max(weights, key=len)
    gather = measure_gather_gbps(table)
    cost = step_cost(cfg, model.interaction.out_dim, ids_per_sample)
    for _ in range(3):
        if sps <= cost.bound_samples_per_s(gemm, gather):
            break
        gemm = max(gemm, measure_gemm_gflops(b, device, precision))
        gather = max(gather, measure_gather_gbps(table))
    probe = {"gemm_gflops": gemm, "gather_gbps": gather}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{threads}"
    gemm = best_on_record(f"gemm/{name}/{precision}/batch{b}", gemm)
    # gather rates depend on the row width and on whether the table fits a cache
    table_mib = 1 << max(0, (table.numel() * table.element_size() >> 20).bit_length())
    row_bytes = table.shape[1] * table.element_size()
    # "gather2": from fresh ids each repeat; the readings under "gather/" re-read one
    # id set (a cache rate), so they must not raise this one
    gather = best_on_record(f"gather2/{name}/row{row_bytes}B/table{table_mib}MiB", gather)
    bound = cost.bound_samples_per_s(gemm, gather)
    slow = probe["gemm_gflops"] / gemm
    if slow < 0.85:
        echo(
            f"note: the GEMM probe ran at {slow:.0%} of this host's best ({gemm:.0f} GFLOP/s): "
            "the machine was slow during this run, and the ratio to the bound reads low"
        )
    if sps > bound:
        echo(
            f"warning: measured {sps:,.0f} samples/s exceeds the bound {bound:,.0f}: the probes "
            "read low (a busy machine?); take the figures from a quiet run"
        )
    cache = cache_report(model.embeddings, 0.0, sum(waits))
    io = tier_io(model.embeddings, DiskCounters.now().since(disk_start), steps, b, echo)
    pooled = precision == "bf16" and bf16_pooled(model, device)
    return {
        **(
            {
                "embedding_cache": cache,
                "cache_prefetch": prefetch_mode,
                # the step waiting for its batch, or in its lookup for the batch's reads
                "prefetch_wait_ms": 1e3 * cache["prefetch_stall_seconds"] / steps,
            }
            if cache
            else {}
        ),
        **({"tier_io": io} if io else {}),
        "samples_per_s": sps,
        "samples_per_s_mean": steps * b / elapsed,
        "bound_samples_per_s": bound,
        # the bound's step in its two terms (format_gap sets the stages against them)
        "bound_ms": {k: 1e3 * b * v for k, v in cost.bound_parts(gemm, gather).items()},
        "ratio_to_bound": sps / bound,
        "ms_per_step": 1e3 * b / sps,
        "stage_ms": {k: 1e3 * v / steps for k, v in totals.items()},
        # forward split further; data: making one batch (overlapped with the step in training)
        "stage_detail_ms": {"data": data_ms, **{k: 1e3 * v / steps for k, v in detail.items()}},
        "peak_rss_bytes": peak_rss_bytes(),
        "host_memory_retained": retain,
        "model_state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "gemm_gflops": gemm,
        "probe_gemm_gflops": probe["gemm_gflops"],
        "probe_gather_gbps": probe["gather_gbps"],
        "other_cores_busy_during_probe": probe_load,
        "bound_beaten": sps > bound,
        "gather_gbps": gather,
        "mlp_gflop_per_sample": cost.mlp_flops_per_sample / 1e9,
        "embedding_bytes_per_sample": cost.embedding_bytes_per_sample,
        "batch_size": b,
        "threads": threads,
        "steps": steps,
        "sparse_optimizer": cfg.embedding.optimizer,
        "kernels": cfg.model.kernels,
        "fp32_products": fp32_route() if device.type == "cpu" else None,
        "native": native.status(),
        "native_threads": team_status(native.library()),
        "bf16_hardware": bf16_hardware(device),
        "bf16_mlp": bf16_mlp_path(device),
        "bf16_pooled": pooled,
        "interaction_amx": pooled and interaction_on_amx(model),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "row_precision": cfg.embedding.row_precision,
        "peak_device_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    }


def format_gap(r: dict[str, Any]) -> str:
    """Where a step stands against the bound's two terms: the stages that move embedding
    rows (lookup, sparse) against the rows' term, the rest (forward and backward - the
    MLPs, the interaction, the loss - and the dense optimizer) against the products'."""
    parts, st = r["bound_ms"], r["stage_ms"]
    rows = st["lookup"] + st["sparse"]
    dense = st["forward"] + st["backward"] + st["dense_opt"]

    def share(bound: float, took: float) -> str:
        return f"{bound / took:.2f}" if took > 0 else "-"

    return (
        f"  against the bound's {parts['mlp_products'] + parts['embedding_rows']:.2f} ms a step: "
        f"the embedding rows {parts['embedding_rows']:.2f} ms at the gather rate, taken in "
        f"lookup + sparse {rows:.2f} ({share(parts['embedding_rows'], rows)}); the MLP products "
        f"{parts['mlp_products']:.2f} ms at the GEMM rate, taken with the rest of forward + "
        f"backward + dense_opt in {dense:.2f} ({share(parts['mlp_products'], dense)})"
    )


def format_report(name: str, r: dict[str, Any]) -> str:
    stages = "  ".join(f"{k} {v:.2f}" for k, v in r["stage_ms"].items())
    gib = 1 << 30
    return "\n".join(
        [
            f"config {name}: {r['samples_per_s']:,.0f} samples/s  (bound "
            f"{r['bound_samples_per_s']:,.0f}, "
            f"ratio {r['ratio_to_bound']:.2f}; mean over all steps {r['samples_per_s_mean']:,.0f})",
            f"  {r['ms_per_step']:.2f} ms/step (median) of batch {r['batch_size']} on "
            f"{r['device_name'] if r['device'] != 'cpu' else str(r['threads']) + ' threads'} "
            f"({r['precision']}"
            + (f", bf16 on {r['bf16_hardware']}" if r["precision"] == "bf16" else "")
            + (f": {r['bf16_mlp']}" if r["precision"] == "bf16" and r.get("bf16_mlp") else "")
            + (f", {r['row_precision']} rows" if r.get("row_precision", "fp32") != "fp32" else "")
            + (", pooled vectors in bf16" if r.get("bf16_pooled") else "")
            + (" into the interaction on AMX tiles" if r.get("interaction_amx") else "")
            + f"); stages (ms): {stages}",
            format_gap(r),
            f"  peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB (model + optimizer state "
            f"{r['model_state_bytes'] / gib:.2f} GiB; freed memory "
            + (
                "kept for the next step)"
                if r["host_memory_retained"]
                else "returned to the system)"
            ),
            *(
                [
                    f"  ssd tier: cache hit rate {r['embedding_cache']['hit_rate']:.1%} "
                    f"({r['embedding_cache']['cache_rows']:,} of "
                    f"{r['embedding_cache']['table_rows']:,} rows), "
                    f"{r['embedding_cache']['bytes_read'] / 1e6 / r['steps']:.2f} MB read and "
                    f"{r['embedding_cache']['bytes_written'] / 1e6 / r['steps']:.2f} MB written "
                    "per step, "
                    f"prefetch wait {r['prefetch_wait_ms']:.2f} ms/step"
                ]
                if "embedding_cache" in r
                else []
            ),
            *([format_tier_io(r["tier_io"])] if r.get("tier_io") else []),
            f"  kernels: {r['kernels']}"
            + (
                f" (fp32 products: {r['fp32_products']})"
                if r.get("fp32_products") and r["precision"] != "bf16"
                else ""
            )
            + f"; native C kernels {r['native']}, "
            f"{r.get('native_threads', '')}",
            f"  {r['device']}: GEMM {r['gemm_gflops']:.0f} GFLOP/s, random gather "
            f"{r['gather_gbps']:.2f} GB/s"
            + (
                " (this run's probes)"  # no record kept (RECSCALE_HARDWARE_RECORD=off) or beaten
                if (r["gemm_gflops"], r["gather_gbps"])
                == (r["probe_gemm_gflops"], r["probe_gather_gbps"])
                else f" (this host's best; this run's probes {r['probe_gemm_gflops']:.0f}, "
                f"{r['probe_gather_gbps']:.2f})"
            )
            + (
                f" (other processes: {r['other_cores_busy_during_probe']:.2f} cores busy during "
                "the probe)"
                if r.get("other_cores_busy_during_probe")
                else ""
            )
            + "; "
            f"per sample {r['mlp_gflop_per_sample'] * 1e3:.2f} MFLOP MLP, "
            f"{r['embedding_bytes_per_sample']:,.0f} embedding bytes",
        ]
    )


def tier_io(ebc, disk: DiskCounters, steps: int, batch: int, echo) -> dict[str, Any] | None:
    """The ssd tier's I/O per step over the timed steps, and the bound it sets: the
    disk's random-read rate at the tier's depth (probed after the run over the tier's
    largest file, ``bench/disk.py``) over the pages the disk actually read and wrote per
    step (``/proc/self/io``: page-cache hits excluded)."""
    files = [st for st in cached_storages(ebc) if getattr(st, "path", None) is not None]
    if not files:
        return None
    depth = max(st.rows.depth for st in files)
    access = "/".join(sorted({st.rows.access for st in files}))
    io: dict[str, float] = {}
    for st in files:
        for k, v in st.io_stats().items():
            io[k] = io.get(k, 0) + v
    per_step = {k: io[k] / steps for k in ("rows_read", "rows_written", "io_requests")}
    skipped = sum(st.stats.skipped for st in files)
    updates = sum(st.stats.id_updates for st in files)
    out: dict[str, Any] = {
        "io_depth": depth,
        "ssd_access": access,
        "io_engine": "io_uring" if io_uring_available() else "threads",
        "rows_read_per_step": per_step["rows_read"],
        "rows_written_per_step": per_step["rows_written"],
        "requests_per_step": per_step["io_requests"],
        "io_ms_per_step": 1e3 * io["io_seconds"] / steps,
        "requests_per_s": io["io_requests"] / io["io_seconds"] if io["io_seconds"] else 0.0,
    }
    if updates:  # slipstream on: the share of id updates skipped (warm-up included)
        out["slipstream_skipped_share"] = skipped / updates
    if disk.read_bytes >= 0:
        pages = (disk.read_bytes + disk.write_bytes) / 4096 / steps
        out["disk_read_mb_per_step"] = disk.read_bytes / 1e6 / steps
        out["disk_write_mb_per_step"] = disk.write_bytes / 1e6 / steps
        out["disk_pages_per_step"] = pages
        # under a page a step (the page cache answered nearly everything; a stray page
        # over the run) the disk bounds nothing: a bound of 1e9 samples/s is noise
        if pages >= 1:
            path = max((st.path for st in files), key=lambda p: p.stat().st_size)
            echo(f"probing the disk: 4 KiB random reads over {path} ...")
            try:
                iops = measure_file_read_iops(path, depth)
            except OSError as e:
                echo(f"note: could not probe the disk through {path}: {e}")
                iops = {}
            if iops:
                rate = iops[f"qd{depth}"]
                out["disk_iops_qd1"] = iops["qd1"]
                out[f"disk_iops_qd{depth}"] = rate
                out["disk_probe_file_gb"] = iops["file_bytes"] / 1e9
                out["disk_probe_direct"] = bool(iops["direct"])
                out["io_bound_samples_per_s"] = batch * rate / pages
                # beside the disk this run met, the best it has given (a virtual disk
                # slows for minutes at a time): per depth, file size and access, as the
                # GEMM probe keeps its best
                kind = "direct" if iops["direct"] else "buffered"
                key = f"disk/qd{depth}/{kind}/file{round(iops['file_bytes'] / 1e9)}GB"
                best = best_on_record(key, rate)
                out[f"disk_iops_best_qd{depth}"] = best
                out["io_bound_best_samples_per_s"] = batch * best / pages
    return out


def format_tier_io(io: dict[str, Any]) -> str:
    d = io["io_depth"]
    how = (
        f"{io['requests_per_step']:,.0f} requests ({io['requests_per_s']:,.0f}/s at depth {d}"
        f" through {io.get('io_engine', 'threads')}"
        + (", O_DIRECT" if io["ssd_access"] == "direct" else "")
        if io["ssd_access"] in ("pread", "direct")
        else f"copies through the file's map ({io['ssd_access']}"
    )
    line = (
        f"  ssd I/O: {io['rows_read_per_step']:,.0f} rows read, "
        f"{io['rows_written_per_step']:,.0f} written per step in "
        f"{how}, {io['io_ms_per_step']:.1f} ms/step)"
    )
    if "slipstream_skipped_share" in io:
        line += f"; slipstream skipped {io['slipstream_skipped_share']:.1%} of id updates"
    if "disk_read_mb_per_step" in io:
        line += (
            f"; from the disk {io['disk_read_mb_per_step']:.2f} MB read, "
            f"{io['disk_write_mb_per_step']:.2f} MB written per step"
        )
    if io.get("disk_pages_per_step", 1.0) < 1:
        line += "; under a page a step from the disk: no I/O bound"
    if "io_bound_samples_per_s" in io:
        line += (
            f"; disk 4 KiB random reads over the tier's {io['disk_probe_file_gb']:.1f} GB "
            f"file{' (O_DIRECT)' if io['disk_probe_direct'] else ''} "
            f"{io['disk_iops_qd1']:,.0f}/s at depth 1, "
            f"{io[f'disk_iops_qd{d}']:,.0f}/s at {d}: I/O bound "
            f"{io['io_bound_samples_per_s']:,.0f} samples/s"
        )
        best = io.get(f"disk_iops_best_qd{d}", 0.0)
        if best > 1.01 * io[f"disk_iops_qd{d}"]:
            line += (
                f" (at this host's best reading of such a file, {best:,.0f}/s: "
                f"{io['io_bound_best_samples_per_s']:,.0f})"
            )
    return line
