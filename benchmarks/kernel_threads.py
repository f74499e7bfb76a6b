"""One native kernel's calls inside a training step on one thread against split over
torch's threads, whatever the code would choose, alternating in one process: the time
of the kernel's calls (perf_counter around each ``native.parallel_call``) a step.

    python benchmarks/kernel_threads.py --config A --kernel recscale_igrad_amx_pack \
        --train.precision=bf16
    python benchmarks/kernel_threads.py --config A --kernel recscale_logit_backward_bf16 \
        --train.precision=bf16

Why: a call split over two threads pays the second one's hand-off (13 us on torch's
team, 50-60 us waking a pool thread on a VM); a short pass can run faster alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_ab import stepper  # this directory's: a training step set up as training does

from recscale import native
from recscale.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A")
    ap.add_argument("--kernel", required=True, help="a native kernel's name, recscale_...")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side a round")
    args, overrides = ap.parse_known_args()
    cfg = load_config(args.config, overrides)
    call = native.parallel_call
    alone = {"on": False}
    spent = [0.0]
    calls = [0]

    def timed(lib, kernel, n, args_of, threads, key=None, adaptive=True):
        if kernel != args.kernel:
            return call(lib, kernel, n, args_of, threads, key, adaptive)
        threads = 1 if alone["on"] else torch.get_num_threads()
        t = time.perf_counter()
        out = call(lib, kernel, n, args_of, threads, key, adaptive)
        spent[0] += time.perf_counter() - t
        calls[0] += 1
        return out

    native.parallel_call = timed  # the modules call it through the package
    step_once, _ = stepper(cfg)
    for _ in range(6):
        step_once()
    if not calls[0]:
        raise SystemExit(f"{args.kernel} does not run in this step ({native.status()})")
    got: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            alone["on"] = on
            step_once()
            spent[0] = 0.0
            for _ in range(args.steps):
                step_once()
            got[on].append(spent[0] * 1e3 / args.steps)
    one, split = statistics.median(got[True]), statistics.median(got[False])
    wins = sum(a < b for a, b in zip(got[True], got[False]))
    print(
        f"config {args.config}, {args.kernel}: one thread {one:.3f} ms a step, "
        f"{torch.get_num_threads()} threads {split:.3f} (median of {args.rounds} rounds; "
        f"one thread faster in {wins})"
    )


if __name__ == "__main__":
    main()
