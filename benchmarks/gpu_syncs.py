"""Where a GPU training step waits on the device: every host-device synchronisation
(``.item()``, a size read back, a blocking copy) of ``recscale bench throughput``'s
timed steps, with the recscale line that asked for it.

    python benchmarks/gpu_syncs.py [--steps 3] -- --config A --train.batch_size=16384
    python benchmarks/gpu_syncs.py --preset dle --preset A -- --train.precision=tf32

Arguments after ``--`` are bench overrides, as in ``benchmarks/gpu_profile.py`` (its
presets too). Runs the bench's warm-up, then ``--steps`` steps under
``torch.cuda.set_sync_debug_mode("warn")`` and prints, per preset, the synchronisations
a step and each site: the innermost recscale frame (file:line, function) and the
step function it ran under (forward_loss, backward_and_step; a CUDA backward runs on
autograd's own thread, whose stack starts at the autograd function's ``backward``).

Why: the forecast (``perfmodel/systems.py``) prices the host's dispatch by where the
step waits. Before a wait the host issues kernels while the device runs the earlier
ones; at the wait the device drains; after it the device idles until the host issues
again. One wait a step near its end hides the host behind long kernels; waits spread
through the step add host and device time.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from recscale.bench.throughput import run_throughput

sys.path.insert(0, str(Path(__file__).parent))
from gpu_profile import PRESETS, bench_config, split_args  # noqa: E402

STEP_FUNCTIONS = ("forward_loss", "backward_and_step", "step")


def sync_site(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(innermost recscale frame, the step function it ran under) of one sync's stack."""
    ours = [f for f in stack if "/recscale/" in f.filename.replace("\\", "/")]
    if not ours:
        return "(outside recscale)", "?"
    inner = ours[-1]
    where = f"{inner.filename.split('/recscale/')[-1]}:{inner.lineno} {inner.name}"
    phase = next((f.name for f in ours if f.name in STEP_FUNCTIONS[:2]), ours[0].name)
    return where, phase


def count_syncs(overrides: list[str], steps: int, warmup: int) -> tuple[Counter, dict]:
    """Syncs over ``steps`` timed steps, by (site, phase); and the bench's report."""
    cfg = bench_config(overrides, "cuda")
    sites: Counter = Counter()
    shown = warnings.showwarning

    def record(message, category, *args, **kwargs):
        if "synchroniz" in str(message).lower():
            sites[sync_site(traceback.extract_stack()[:-1])] += 1
        else:
            shown(message, category, *args, **kwargs)

    def turns():
        torch.cuda.synchronize()
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        yield steps

    def stop(_seconds: list[float]) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        report = run_throughput(
            cfg, steps=steps, warmup=warmup, turns=turns(), on_turn=stop, echo=lambda s: None
        )
    return sites, report


def main() -> None:
    own, overrides = split_args(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[])
    args = ap.parse_args(own)
    if not torch.cuda.is_available():
        sys.exit("gpu_syncs: no CUDA device visible to torch")
    runs = [(p, PRESETS[p] + overrides) for p in args.preset] or [("custom", overrides)]
    if runs == [("custom", [])]:
        ap.error("name a --preset or give bench overrides after --")
    for label, ov in runs:
        sites, report = count_syncs(ov, args.steps, args.warmup)
        total = sum(sites.values()) / args.steps
        print(
            f"== {label}: {total:.1f} syncs a step, step {report['ms_per_step']:.2f} ms "
            f"({report['samples_per_s']:,.0f} samples/s)"
        )
        for (where, phase), n in sites.most_common():
            print(f"   {n / args.steps:5.1f} a step  {phase:<18} {where}")


if __name__ == "__main__":
    main()
