"""Measure the training device's own limits: GEMM rate and random row-gather bandwidth
(the CPU's, or a GPU's: GEMMs in the run's precision on the tensor cores, HBM gathers).

The throughput bound of a DLRM step on a CPU is (Zion study; the CPU speed issue)::

    t_bound = MLP FLOPs / GEMM rate  +  embedding bytes / gather bandwidth

where MLP FLOPs count forward + both backward GEMMs (3 x 2 x in x out per layer per
sample) and embedding bytes count the forward row reads plus the sparse update's
read-modify-write of each row and its optimizer state.
"""

from __future__ import annotations

import json
import math
import os
import platform
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from recscale import native
from recscale.config.schema import Config
from recscale.config.small_files import loads_json, user_cache_dir, write_text_atomic
from recscale.embedding.sizing import (
    bytes_per_value,
    lookup_bytes_per_value,
    row_overhead,
    state_bytes,
)
from recscale.modules import gemm
from recscale.train.precision import gemms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, repeats: int, warmup: int = 2, device: torch.device | None = None) -> float:
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def measure_gemm_gflops(
    batch_size: int, device: torch.device | None = None, precision: str = "fp32", repeats: int = 10
) -> float:
    """Best GEMM rate over MLP-like shapes at this batch size (GFLOP/s), on ``device`` in
    ``precision`` (fp32, tf32 or bf16: the GEMMs a step of that precision runs).

    On a CPU every GEMM a step can run is timed - MKL (``torch.mm``), oneDNN (the fused
    linear the MLPs run) and our weight-gradient kernel (the same FLOPs as
    ``g^T x``) - and the fastest stands: the bound is what the hardware allows, so a step
    must never run its GEMMs faster than the probe did."""
    device = device or torch.device("cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    best = 0.0
    with gemms(precision, device):  # bf16 as the step runs it (emulated on AVX2)
        for k, n in ((512, 512), (1024, 1024), (512, 256)):
            a = torch.randn(batch_size, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            runs = [lambda a=a, b=b: torch.mm(a, b)]
            if device.type == "cpu" and dtype == torch.float32 and gemm.ONEDNN_LINEAR is not None:
                w = b.t().contiguous()
                runs.append(lambda a=a, w=w: gemm.ONEDNN_LINEAR(a, w, None, "none", [], ""))
                g = torch.randn(batch_size, n)
                if gemm._native_wgrad_applies(g, a):
                    runs.append(lambda a=a, g=g: gemm.weight_grad(g, a))
            for fn in runs:
                secs = _best_seconds(fn, repeats, device=device)
                best = max(best, 2 * batch_size * k * n / secs / 1e9)
    return best


def measure_gather_gbps(table: torch.Tensor, lookups: int = 1 << 16, repeats: int = 5) -> float:
    """Random row-gather bandwidth from ``table`` (GB/s of row bytes), on its device.

    Pass the model's own embedding storage: it is larger than the caches, and no
    extra memory is allocated (a probe table of its own would inflate peak RSS).

    Every repeat gathers rows it has not read before (its own random ids), as a
    training step does with ids spread over a large table: re-reading one id set
    measured the last-level cache after the first pass (64-byte rows: 10.9 GB/s
    against 3.9 GB/s from memory on this project's 2-core EPYC), which inflated the
    bound's embedding term.

    On a CPU the gather the step itself runs is timed too - the native pooled lookup
    (``native/embedding_lookup.c``: rows prefetched ahead, the threads splitting the
    ids), one id a bag - and the faster stands, as the GEMM probe takes its fastest
    kernel: on a 2-core EPYC VM (no AVX-512 in sight) ``index_select``, one row at a time
    and nothing prefetched, read 0.5-2.5 GB/s where the native lookup read 7.9-8.6, and a
    bound priced at the slower rate could be beaten.
    """
    rows, dim = table.shape
    if table.device.type == "cuda":
        lookups = max(lookups, 1 << 22)  # enough work to fill the GPU
    out = torch.empty(lookups, dim, dtype=table.dtype, device=table.device)
    warmup = 2
    ids = iter(
        [
            torch.randint(0, rows, (lookups,), device=table.device)
            for _ in range(2 * (warmup + repeats))
        ]
    )
    secs = _best_seconds(
        lambda: torch.index_select(table, 0, next(ids), out=out),
        repeats,
        warmup,
        device=table.device,
    )
    row_bytes = dim * table.element_size()
    gbps = lookups * row_bytes / secs / 1e9
    native_gather = _native_gather(table, lookups)
    if native_gather is not None:
        gather, n = native_gather
        secs = _best_seconds(lambda: gather(next(ids)), repeats, warmup)
        gbps = max(gbps, n * row_bytes / secs / 1e9)
    return gbps


def _native_gather(table: torch.Tensor, lookups: int):
    """``(gather, n)``: ``gather(ids)`` reads the rows ``ids[:n]`` of ``table`` through the
    step's own native lookup (one id a bag, the ids cut into one feature per thread so
    that every thread reads; returns ``(rows [n, dim], ...)``), or None where that kernel
    does not run on ``table``."""
    from recscale.embedding.lookup import native_pooled_lookup

    if not native.applies(table, table.shape[1], 128, rows=True) or table.dim() != 2:
        return None
    parts = max(1, min(torch.get_num_threads(), lookups))
    per = lookups // parts
    offsets = torch.arange(parts * per + 1, dtype=torch.int64)
    row_offset = torch.zeros(parts, dtype=torch.int64)
    sizes = torch.full((parts,), table.shape[0], dtype=torch.int64)

    def gather(ids: torch.Tensor):
        return native_pooled_lookup(
            table, ids[: parts * per], offsets, per, row_offset, sizes, None
        )

    return gather, parts * per


class OtherLoad:
    """CPU time other processes used over an interval (from ``/proc/stat`` minus this
    process's own): a probe taken while the machine was busy reads low, and a bound
    that reads low can be beaten - so the benchmark re-takes it."""

    def __init__(self, stat: str = "/proc/stat", self_stat: str = "/proc/self/stat") -> None:
        self._paths = (stat, self_stat)
        self._start = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open(self._paths[0]) as f:
                fields = [float(x) for x in f.readline().split()[1:]]
            with open(self._paths[1]) as f:
                own = f.read().rsplit(")", 1)[1].split()
            busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)
            return busy, sum(fields), float(own[11]) + float(own[12])  # utime + stime (ticks)
        except (OSError, ValueError, IndexError):  # no /proc, or not the format it has
            return None

    def cores_busy(self) -> float | None:
        """Average number of cores other processes kept busy since the last call."""
        end = self._read()
        if end is None or self._start is None:
            return None
        (b0, t0, o0), (b1, t1, o1) = self._start, end
        self._start = end
        if t1 <= t0:
            return 0.0
        cores = os.cpu_count() or 1
        return max(0.0, (b1 - b0 - (o1 - o0)) / (t1 - t0) * cores)


def record_path() -> Path | None:
    """Where this host's best probe readings are kept (``RECSCALE_HARDWARE_RECORD``: a
    path, or ``off``); default ``~/.cache/recscale/hardware-HOST.json``."""
    spec = os.environ.get("RECSCALE_HARDWARE_RECORD", "")
    if spec == "off":
        return None
    if spec:
        return Path(spec)
    base = user_cache_dir()
    return base / f"hardware-{platform.node() or 'host'}.json" if base else None


def _read_record(path: Path) -> dict[str, float]:
    """The readings kept at ``path``: a damaged or hand-edited file (not a JSON object, a
    FIFO, a reading that is not a positive finite number) counts as none of them, so the
    run's own probe stands and the next write replaces it."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would hang the read
            return {}
        record = loads_json(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
    }


def best_on_record(key: str, measured: float, path: Path | None = None) -> float:
    """The higher of ``measured`` and the best reading this host ever gave for ``key``
    (which is then updated); ``measured`` alone when there is no record.

    Why: on a shared VM the host can slow this guest without any sign inside it (no
    steal time, no other process), so a probe taken in a slow period reads low and the
    step it bounds can beat it. The best rate this hardware has shown is what it
    allows; a run in a slow period then reads as a low ratio, which it is.
    """
    path = path if path is not None else record_path()
    if path is None:
        return measured
    record = _read_record(path)
    best = max(measured, record.get(key, 0.0))
    if best > record.get(key, 0.0):
        record[key] = best
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # a concurrent run never reads half a file
            write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True))
        except OSError:
            pass  # read-only home: the run's own reading stands
    return best


@dataclass
class StepCost:
    mlp_flops_per_sample: float
    embedding_bytes_per_sample: float

    def bound_parts(self, gemm_gflops: float, gather_gbps: float) -> dict[str, float]:
        """A sample's seconds in the bound's two terms: its MLP products at the GEMM rate,
        its embedding rows' bytes at the gather rate."""
        return {
            "mlp_products": self.mlp_flops_per_sample / (gemm_gflops * 1e9),
            "embedding_rows": self.embedding_bytes_per_sample / (gather_gbps * 1e9),
        }

    def bound_samples_per_s(self, gemm_gflops: float, gather_gbps: float) -> float:
        return 1.0 / sum(self.bound_parts(gemm_gflops, gather_gbps).values())


def step_cost(cfg: Config, interaction_out_dim: int, ids_per_sample: float) -> StepCost:
    """FLOPs and bytes one training sample costs (see the module docstring)."""
    m = cfg.model
    macs = 0
    d = m.num_dense_features
    if d:
        for w in m.bottom_mlp:
            macs += d * w
            d = w
    d = interaction_out_dim
    if m.interaction == "dcnv2":  # two B x d x r GEMMs a cross layer
        macs += m.dcn_layers * 2 * d * m.dcn_rank
    for w in m.top_mlp:
        macs += d * w
        d = w
    dim, precision = m.embedding_dim, cfg.embedding.row_precision
    # forward read + update read + update write of the row (as stored: fp32, fp16, ...;
    # split_bf16's lookup reads the high halves only), read + write of its (fp32) state
    stored = dim * bytes_per_value(precision) + row_overhead(precision)
    read = dim * lookup_bytes_per_value(precision) + row_overhead(precision)
    row_bytes = read + 2 * stored + 2 * state_bytes(cfg.embedding, dim)
    return StepCost(
        mlp_flops_per_sample=6.0 * macs, embedding_bytes_per_sample=ids_per_sample * row_bytes
    )
