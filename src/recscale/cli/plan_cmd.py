"""``recscale plan --config NAME --world-size N [--memory-per-rank GB] [--json]``: a dry run of
the sharding planner (no process group): placement, memory and cost per rank, imbalance.

``--device NAME`` forecasts the step on a catalogued device this machine need not have
(``perfmodel/forecast.py``): the plan is made for that device's memory and costs, and
the stages, step, samples/s, memory per device and (``--train-samples``) the time to
train are printed. ``--device this`` is the calibrated host (the performance model)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from recscale.cli.output import print_error
from recscale.config.errors import ConfigError, counted
from recscale.config.loader import load_config, preset_names
from recscale.config.small_files import json_text
from recscale.planner import Constraints, PlanError, Topology, plan_sharding
from recscale.planner.costs import CostLaws

THIS = "this"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan table sharding for N ranks (dry run, no processes)")
    p.add_argument(
        "--config", default="default", help=f"preset ({', '.join(preset_names())}) or TOML path"
    )
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument(
        "--device",
        default=None,
        help="forecast on this device: a catalogue entry (--list-devices) or 'this' (the "
        "calibrated host)",
    )
    p.add_argument("--device-file", default=None, help="TOML file of more device entries")
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "tf32", "bf16", "fp16", "fp8"],
        help="GEMM precision of the forecast (default: train.precision)",
    )
    p.add_argument(
        "--system",
        default=None,
        help="whose step a --device forecast models (default recscale; dle, hugectr, "
        "torchrec, ipex: the published systems of benchmarks/forecast_validation.py)",
    )
    p.add_argument(
        "--train-samples", type=float, default=None, help="forecast the time to train this many"
    )
    p.add_argument("--list-devices", action="store_true", help="print the device catalogue")
    p.add_argument(
        "--memory-per-rank", type=float, default=64.0, help="GB for embedding tables per rank"
    )
    p.add_argument(
        "--all-to-all-gbps",
        type=float,
        default=None,
        help="GB/s per rank for all-to-all and all-reduce (default: the calibration's "
        "measured local rate, else 12.5 = 100 Gb/s)",
    )
    p.add_argument(
        "--gather-gbps",
        type=float,
        default=None,
        help="random row-gather GB/s per rank (default: the calibration's lookup and "
        "update laws, else 10)",
    )
    p.add_argument(
        "--ssd-per-rank", type=float, default=0.0, help="GB of SSD per rank for tables (0 = none)"
    )
    p.add_argument("--ssd-gbps", type=float, default=2.0, help="SSD GB/s per rank")
    p.add_argument(
        "--host-per-rank",
        type=float,
        default=0.0,
        help="GPU runs: GB of host memory per rank for tables under a GPU cache (0 = none)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="per-op rates from `recscale bench calibrate` (default: this host's, if saved)",
    )
    p.add_argument("--json", action="store_true")


# The largest world size planned: beyond it the planner's per-rank work takes minutes
# (65,536 ranks: ~11 s on a 2-core VM), and no training job runs on more.
MAX_WORLD_SIZE = 65536
# Bounds of the other numbers a plan takes: beyond them the arithmetic overflows (1e308 GB
# is no integer number of bytes) or a rate of 5e-324 GB/s divides into infinity; a
# petabyte a rank, a petabyte a second and 1e18 samples are past any machine or job.
MAX_GB = 1e6
ONE_BYTE_GB = 1e-9
MAX_GBPS = 1e6
MIN_RATE = 1e-6
MAX_TRAIN_SAMPLES = 1e18


def check_args(args: argparse.Namespace, batch_size: int) -> None:
    """One-line errors, naming the flag, for numbers no plan can use (a world larger
    than the batch or than any job, a negative memory or bandwidth), before the planner
    runs."""
    w = args.world_size
    if not 1 <= w <= MAX_WORLD_SIZE:
        raise ConfigError("--world-size", f"a whole number in [1, {MAX_WORLD_SIZE:,}], got {w}")
    if w > batch_size:
        raise ConfigError(
            "--world-size", f"{w:,} ranks cannot split a global batch of {batch_size:,} samples"
        )
    for flag, value, low, top in (
        ("--memory-per-rank", args.memory_per_rank, ONE_BYTE_GB, MAX_GB),
        ("--all-to-all-gbps", args.all_to_all_gbps, MIN_RATE, MAX_GBPS),
        ("--gather-gbps", args.gather_gbps, MIN_RATE, MAX_GBPS),
        ("--ssd-per-rank", args.ssd_per_rank, 0.0, MAX_GB),
        ("--ssd-gbps", args.ssd_gbps, MIN_RATE, MAX_GBPS),
        ("--host-per-rank", args.host_per_rank, 0.0, MAX_GB),
        ("--train-samples", args.train_samples, 1.0, MAX_TRAIN_SAMPLES),
    ):
        if value is not None and not (math.isfinite(value) and low <= value <= top):
            raise ConfigError(flag, f"a number in [{low:g}, {top:g}], got {value:g}")


def _refuse_forecast_flags(args: argparse.Namespace) -> None:
    """Flags only a catalogue device's forecast reads, refused where none runs (they
    were dropped without a word: ``plan --system ipex`` printed recscale's plan)."""
    where = "the calibrated host" if args.device == THIS else "no --device"
    if args.system is not None:
        raise ConfigError(
            "--system",
            f"models another system's step on a catalogue --device; {where} runs recscale's own",
        )
    if args.precision is not None:
        raise ConfigError(
            "--precision",
            f"sets a catalogue --device forecast's GEMMs; with {where} the "
            "prediction is the calibration's, at train.precision (--train.precision=P)",
        )
    if args.device_file is not None:
        raise ConfigError(
            "--device-file", "adds catalogue entries for --device NAME or --list-devices"
        )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.device_file is not None and not Path(args.device_file).exists():
        raise ConfigError("--device-file", f"file not found: {args.device_file}")
    if args.list_devices:
        return _list_devices(args.device_file)
    cfg = load_config(args.config, overrides)
    if cfg.data.uses_dataset():  # the tables training would build: the dataset's sizes
        from recscale.train.data_source import adopt_dataset_shapes

        note = adopt_dataset_shapes(cfg, training=False)
        if note:
            print(f"recscale: {note}", file=sys.stderr)
    check_args(args, cfg.train.batch_size)
    if args.device is not None and args.device != THIS:
        return _forecast(cfg, args)
    _refuse_forecast_flags(args)
    from recscale.planner.from_config import plan_for, table_infos  # not for --help

    tables = table_infos(cfg)
    a2a = (args.all_to_all_gbps or 12.5) * 1e9
    topo = Topology(
        args.world_size,
        int(args.memory_per_rank * 1e9),
        a2a,
        a2a,
        (args.gather_gbps or 10.0) * 1e9,
        ssd_per_rank=int(args.ssd_per_rank * 1e9),
        ssd_bandwidth=args.ssd_gbps * 1e9,
        host_per_rank=int(args.host_per_rank * 1e9),
    )
    cal = _calibration(args.calibration or cfg.distributed.calibration)
    laws = _laws(cal, topo, args)
    d = cfg.distributed
    given = f"the plan file {d.plan}" if d.plan else f"distributed.sharding={d.sharding}"
    try:
        if d.plan or d.sharding != "auto":  # the plan a job of this config runs, checked
            plan = plan_for(cfg, args.world_size, topo.memory_per_rank)
        else:
            plan = plan_sharding(tables, topo, Constraints(batch_size=cfg.train.batch_size), laws)
    except PlanError as e:
        print_error(e)
        return 1
    pred = None
    if cal is not None:
        from recscale.perfmodel import predict

        pred = predict(cfg, cal, world_size=args.world_size, plan=plan)
    if args.device == THIS and pred is None:
        raise ConfigError(
            "--device", "'this' needs a calibration: run `recscale bench calibrate` (a minute)"
        )
    if args.train_samples and pred is None:  # no step forecast to divide it by
        raise ConfigError(
            "--train-samples",
            "needs a step forecast: a catalogue --device, or this host's calibration "
            "(`recscale bench calibrate`, a minute)",
        )
    if args.json:
        out = plan.to_dict()
        if pred is not None:
            out["predicted_step_ms"] = pred.step_seconds * 1e3
            out["predicted_samples_per_s"] = pred.samples_per_s
            out["predicted_stage_ms"] = pred.stages_ms
            out["predicted_memory_bytes"] = pred.memory_bytes
            if args.device == THIS:
                from recscale.perfmodel.model import standard_stages

                out["device"] = THIS
                out["predicted_stage_ms"] = standard_stages(pred.stages_ms)
                if args.train_samples:
                    out["predicted_train_hours"] = args.train_samples / pred.samples_per_s / 3600
        out["costs"] = laws.source
        print(json_text(out, indent=1))
        return 0
    print(
        f"plan for {args.config}: {len(tables)} tables on {counted(args.world_size, 'rank')} "
        f"({args.memory_per_rank:g} GB each), global batch {cfg.train.batch_size}"
        + (f"; {given}" if d.plan or d.sharding != "auto" else "")
    )
    from recscale.embedding.sizing import compression_summary

    for line in compression_summary(cfg):
        print(line)
    print(f"{'table':>6} {'rows':>12} {'dim':>4} {'GB':>8}  {'placement':<14} ranks")
    for t, p in zip(tables, plan.placements):
        ranks = p.ranks if len(p.ranks) <= 8 else f"{p.ranks[:3]}..{p.ranks[-1]} ({len(p.ranks)})"
        where = (
            f"  {p.placement}, cache {p.cache_bytes / 1e9:.3f} GB, "
            f"expected hit rate {p.hit_rate:.0%}"
            if p.placement != "device"
            else ""
        )
        print(
            f"{t.name:>6} {t.rows:>12,} {t.dim:>4} {t.bytes / 1e9:>8.3f}  {p.kind:<14} "
            f"{ranks}{where}"
        )
    mem, cost = plan.memory_per_rank, plan.cost_per_rank
    print(f"memory per rank: max {max(mem) / 1e9:.2f} GB, min {min(mem) / 1e9:.2f} GB")
    print(
        f"embedding cost per step (lookup + update + collectives; costs: {laws.source}): "
        f"slowest rank {plan.max_cost * 1e3:.3f} ms, "
        f"mean {sum(cost) / len(cost) * 1e3:.3f} ms, imbalance {plan.imbalance:.2f}"
    )
    if pred is not None:
        stages = "  ".join(f"{k} {v:.2f}" for k, v in pred.stages_ms.items())
        print(
            f"predicted step per rank (performance model, this machine's calibration): "
            f"{pred.step_seconds * 1e3:.2f} ms, {pred.samples_per_s:,.0f} samples/s "
            f"(slowest rank {pred.slowest_rank}); memory {pred.memory_bytes / 1e9:.2f} GB "
            f"on the largest rank; stages (ms): {stages}"
        )
        if args.train_samples:
            hours = args.train_samples / pred.samples_per_s / 3600
            print(f"time to train {args.train_samples:,.0f} samples: {hours:.2f} h")
    else:
        print(
            "no calibration for this machine: `recscale bench calibrate` (a minute) lets plan "
            "predict step times"
        )
    return 0


def _calibration(spec: str):
    """The calibration ``--calibration`` or ``distributed.calibration`` names (``auto``:
    this machine's saved one, when it reads), or None."""
    from recscale.perfmodel import find_calibration

    try:
        return find_calibration(spec or "auto")
    except ConfigError:  # the file is not one to read (a FIFO, a device...): it says so
        raise
    except (OSError, ValueError) as e:
        raise ConfigError("distributed.calibration", str(e)) from e


def _laws(cal, topo: Topology, args) -> CostLaws:
    """The planner's costs: the calibration's (what the performance model predicts
    with), the bandwidths given on the command line replacing its measured ones."""
    from dataclasses import replace

    if cal is None:
        return CostLaws.from_topology(topo)
    from recscale.perfmodel.model import planner_laws

    laws = planner_laws(cal)
    dflt = CostLaws.from_topology(topo)
    if args.all_to_all_gbps:
        laws = replace(
            laws,
            all_to_all_per_byte=dflt.all_to_all_per_byte,
            all_reduce_per_byte=dflt.all_reduce_per_byte,
        )
    if args.gather_gbps:
        laws = replace(laws, per_value=dflt.per_value, per_id=0.0)
    return laws


def _list_devices(extra: str | None) -> int:
    from recscale.perfmodel.devices import catalogue

    print(f"{'name':<12} {'kind':<4} {'GB':>5} {'GB/s':>6} {'units':>5}  peak TFLOP/s (dense)")
    for d in catalogue(extra).values():
        peaks = " ".join(f"{p} {v:g}" for p, v in d.peak_tflops.items())
        print(
            f"{d.name:<12} {d.kind:<4} {d.memory_gb:>5g} {d.memory_gbps:>6g} {d.units:>5}  "
            f"{peaks}  ({d.description})"
        )
    print(f"{THIS:<12} the calibrated host (`recscale bench calibrate`)")
    return 0


def _forecast(cfg, args) -> int:
    """``--device NAME``: the plan for that device and world size, and the forecast."""
    from recscale.perfmodel.devices import device_spec
    from recscale.perfmodel.forecast import EAGER_OP_S, forecast
    from recscale.perfmodel.systems import SYSTEMS

    dev = device_spec(args.device, args.device_file)
    system = args.system or "recscale"
    if system not in SYSTEMS:
        raise ConfigError("--system", f"unknown {system!r} (systems: {', '.join(SYSTEMS)})")
    try:
        f = forecast(cfg, dev, args.world_size, args.precision, SYSTEMS[system])
    except PlanError as e:
        print_error(f"{dev.name} x {args.world_size}: {e}")
        return 1
    hours = args.train_samples / f.samples_per_s / 3600 if args.train_samples else None
    if args.json:
        out = {**f.plan.to_dict(), **f.to_dict()}
        if hours is not None:
            out["predicted_train_hours"] = hours
        print(json_text(out, indent=1))
        return 0
    kinds = f.plan.kind_counts()
    print(
        f"forecast for {args.config} on {f.world_size} x {dev.name} ({dev.description}), "
        f"{f.precision}, global batch {cfg.train.batch_size}, as {f.system} runs it"
    )
    print(
        "plan: "
        + ", ".join(f"{n} {k}" for k, n in kinds.items())
        + f"; tables {f.table_bytes / 1e9:.2f} GB on the largest device"
    )
    if system != "recscale":
        print(f"system: {SYSTEMS[system].note}")
    if SYSTEMS[system].exchange == "partials":
        w = f.world_size
        print(
            f"tables as {system} runs them: every table's rows over the {w} devices by id "
            f"modulo {w} (the plan above), each scanning the global batch's ids; partial "
            "sums forward and each id's gradient back (all_to_all)"
        )
    width = max(len(k) for k in f.stage_ms)
    for k, v in f.stage_ms.items():
        if v:
            print(f"  {k:<{width}} {v:9.3f} ms  {v / f.step_ms:6.1%}")
    print(
        f"step {f.step_ms:.3f} ms (slowest device {f.slowest_rank}), "
        f"{f.samples_per_s:,.0f} samples/s, {f.kernels} kernels a step; "
        f"memory {f.memory_bytes / 1e9:.2f} GB of {dev.memory_gb:g} GB a device"
    )
    if f.host_ops:
        how = {
            "serial": "the step waits on the device mid-step: added to the device's time",
            "overlap": "issued while the device runs: what exceeds the device's time "
            "between the step's waits",
        }[f.host_mode]
        print(f"host: {f.host_ops} framework ops a step at {EAGER_OP_S * 1e6:.1f} us each ({how})")
    print(
        "bench stages (what `recscale bench throughput` times, ms): "
        + ", ".join(f"{k} {v:.3f}" for k, v in f.bench_stage_ms.items())
    )
    if hours is not None:
        print(f"time to train {args.train_samples:,.0f} samples: {hours:.2f} h")
    return 0
