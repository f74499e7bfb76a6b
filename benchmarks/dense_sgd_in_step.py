"""The dense step's own time inside a training step: the optimizer's ``step`` and the
bf16 node's reads of its weights in bf16, with the native SGD pass (``dense_sgd.USE``:
the copies written in the pass) against torch's SGD and the forward's casts,
alternating in one process. A whole step moves by more than this from one round to the
next on a shared VM; these two parts are timed alone (perf_counter around each).

    python benchmarks/dense_sgd_in_step.py --config A --train.precision=bf16
    python benchmarks/dense_sgd_in_step.py --config B --train.precision=bf16 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time

from step_ab import stepper  # this directory's: a training step set up as training does

from recscale.config import load_config
from recscale.modules import bf16_weights, mlp
from recscale.train import dense_sgd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side a round")
    args, overrides = ap.parse_known_args()
    cfg = load_config(args.config, overrides)
    if cfg.optimizer.name != "sgd":
        raise SystemExit(f"optimizer.name is {cfg.optimizer.name!r}: the native pass is SGD's")
    step_once, opt = stepper(cfg)
    spent = {"casts": 0.0, "step": 0.0}
    cast = bf16_weights.bf16_copy

    def timed_cast(w):
        t = time.perf_counter()
        out = cast(w)
        spent["casts"] += time.perf_counter() - t
        return out

    mlp.bf16_weights.bf16_copy = timed_cast  # the module mlp reads it from
    step = opt.step

    def timed_step(*a, **kw):
        t = time.perf_counter()
        out = step(*a, **kw)
        spent["step"] += time.perf_counter() - t
        return out

    opt.step = timed_step
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for use in (True, False) if r % 2 == 0 else (False, True):
            dense_sgd.USE = use
            for s in range(args.steps + 2):  # two untimed steps after the switch
                if s == 2:
                    spent["casts"] = spent["step"] = 0.0
                step_once()
            got[use].append((spent["casts"] * 1e3 / args.steps, spent["step"] * 1e3 / args.steps))
    for use in (True, False):
        casts = statistics.median(c for c, _ in got[use])
        steps = statistics.median(s for _, s in got[use])
        what = "native pass" if use else "torch's SGD"
        print(
            f"config {args.config} {cfg.train.precision}, {what}: bf16 reads {casts:.3f} ms, "
            f"optimizer step {steps:.3f} ms, together {casts + steps:.3f} "
            f"(medians of {args.rounds} rounds of {args.steps} steps)"
        )


if __name__ == "__main__":
    main()
