"""Where a GPU training step's time goes, kernel by kernel (torch.profiler over the
timed steps of ``recscale bench throughput``).

    python benchmarks/gpu_profile.py --out DIR [--steps 10] -- --config A --train.batch_size=16384
    python benchmarks/gpu_profile.py --out DIR --preset dle -- --train.precision=tf32

Arguments after ``--`` are ``recscale bench throughput`` overrides: with ``--preset``
(DLE's model at 65536, DCNv2 at 6912, A, B at 16384), added to each preset's; else the
run itself (``--config NAME`` among them). The precision is the CLI's default (fp32)
unless given. Runs the bench's warm-up untraced, then traces ``--steps`` steps and writes
DIR/<label>-kernels.csv: one row a kernel name with its calls and device time a step,
the kernel's class (gemm, elementwise, reduction, triton:<name>, copy, other) and, per
class, the share of the traced device time; it prints the classes and the 15 longest
kernels. The stage forecast (``benchmarks/forecast_stages.py``) compares its terms with
these classes: a GEMM term against the GEMM kernels, the launch model against the
kernel count.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

from recscale.bench.throughput import run_throughput
from recscale.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from forecast_validation import DLE_MODEL, capped  # noqa: E402

PRESETS = {
    "dle": ["--config", "criteo_terabyte", *capped(4), *DLE_MODEL, "--train.batch_size=65536"],
    "dcnv2": ["--config", "criteo_multihot_dcnv2", *capped(4), "--train.batch_size=6912"],
    "A": ["--config", "A", "--train.batch_size=16384"],
    "B": ["--config", "B", "--train.batch_size=16384"],
}
TRITON_KERNELS = ("_pooled_lookup_kernel", "_fused_update_kernel", "_piece_sum_kernel")
CLASSES = (
    ("gemm", re.compile(r"gemm|sm\d\d_xmma|cutlass|cublas|nvjet|ampere_|hopper_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched|index_put|gather", re.I)),
    ("reduction", re.compile(r"reduce|sum_kernel|norm|softmax", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|fill", re.I)),
)


def kernel_class(name: str) -> str:
    """The class a CUDA kernel's name puts it in (recscale's Triton kernels by name)."""
    if name.startswith(TRITON_KERNELS):
        return "triton:" + name.split("_kernel")[0].lstrip("_")
    for cls, pat in CLASSES:
        if pat.search(name):
            return cls
    return "other"


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def bench_config(overrides: list[str], device: str):
    """The bench run's config from its ``--config NAME`` and overrides, on ``device``."""
    name = overrides[overrides.index("--config") + 1]
    rest = [
        a
        for i, a in enumerate(overrides)
        if a != "--config" and overrides[i - 1 : i] != ["--config"]
    ]
    return load_config(name, [*rest, f"--train.device={device}"])


def profile(
    overrides: list[str], steps: int, warmup: int, device: str = "cuda"
) -> tuple[list[dict], dict]:
    """Trace ``steps`` timed steps; return per-kernel rows (ms a step) and the bench's
    report. ``device="cpu"`` traces the CPU's operators instead (nested operators then
    count more than once: a dry run of this script, not a profile)."""
    cfg = bench_config(overrides, device)
    cuda = device == "cuda"
    activity = torch.profiler.ProfilerActivity
    prof = torch.profiler.profile(activities=[activity.CUDA if cuda else activity.CPU])
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def turns():
        sync()
        prof.start()
        yield steps

    def stop(_seconds: list[float]) -> None:
        sync()
        prof.stop()

    report = run_throughput(
        cfg, steps=steps, warmup=warmup, turns=turns(), on_turn=stop, echo=lambda s: None
    )
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == kind:
            per[e.name][0] += 1
            per[e.name][1] += (e.device_time_total if cuda else e.cpu_time_total) / 1e3  # us -> ms
    rows = [
        {
            "kernel": k,
            "class": kernel_class(k),
            "calls_per_step": c / steps,
            "ms_per_step": ms / steps,
        }
        for k, (c, ms) in per.items()
    ]
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows, report


def main() -> None:
    own, overrides = split_args(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_profile")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (see profile())")
    ap.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[])
    args = ap.parse_args(own)
    # overrides after -- go to each preset (e.g. --train.precision=tf32), or make the run
    runs = [(p, PRESETS[p] + overrides) for p in args.preset]
    if not runs and overrides:
        runs = [("custom", overrides)]
    if not runs:
        ap.error("name a --preset or give bench overrides after --")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for label, ov in runs:
        rows, report = profile(ov, args.steps, args.warmup, args.device)
        total = sum(r["ms_per_step"] for r in rows)
        by_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for r in rows:
            by_class[r["class"]][0] += r["ms_per_step"]
            by_class[r["class"]][1] += r["calls_per_step"]
        with open(out / f"{label}-kernels.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        step_ms = report["ms_per_step"]
        print(
            f"== {label}: step {step_ms:.2f} ms (bench, median), kernels {total:.2f} ms a step, "
            f"{sum(r['calls_per_step'] for r in rows):.0f} launches a step"
        )
        for cls, (ms, calls) in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
            print(f"   {cls:<12} {ms:8.3f} ms  {calls:6.0f} launches  {ms / total:5.1%}")
        for r in rows[:15]:
            print(f"   {r['ms_per_step']:8.3f} ms x{r['calls_per_step']:<4.0f} {r['kernel'][:110]}")


if __name__ == "__main__":
    main()
