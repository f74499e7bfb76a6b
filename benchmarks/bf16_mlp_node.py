"""The MLPs' bf16 node against autocast's modules in a training step, alternating in
one process (a shared VM drifts by more than the difference between them).

    python benchmarks/bf16_mlp_node.py --config A --rounds 10
    python benchmarks/bf16_mlp_node.py --config B --rounds 6 --embedding.row_precision=split_bf16

Each round times ``--steps`` steps with ``modules/mlp.py``'s ``_FusedMLPBF16`` and as
many with autocast's ``nn.Linear`` modules (``gemm.USE_FUSED_BF16`` switched; one
untimed step after each switch; the order swapped every round), on the same batches
made once, under ``train.precision=bf16`` (forced: it is what the switch is about).
Prints each round's median step time for both and the median over rounds. Needs a CPU
with AVX512-BF16 (or AMX): elsewhere the node does not run and the comparison is moot.
"""

from __future__ import annotations

import argparse
import statistics
import time

from recscale.config import load_config
from recscale.distributed import DistContext
from recscale.modules import gemm
from recscale.train.data_source import make_synthetic
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.parallel import build
from recscale.train.step import backward_and_step, forward_loss, setup_process, start_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per path a round")
    args, overrides = ap.parse_known_args()
    if not gemm.native_bf16_wgrad():
        raise SystemExit("this CPU has no AVX512-BF16: the bf16 node does not run here")
    cfg = load_config(args.config, [*overrides, "--train.precision=bf16"])
    device, _ = setup_process(cfg)
    model, _, _ = build(cfg, DistContext(device=device), print)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    start_steps(cfg)
    batches = [data.batch(i, cfg.train.batch_size) for i in range(8)]
    k = 0

    def step() -> float:
        nonlocal k
        t = time.perf_counter()
        loss = forward_loss(model, batches[k % len(batches)], "bf16", device)
        backward_and_step(loss, opt, "bf16", device)
        k += 1
        return time.perf_counter() - t

    for _ in range(6):  # warm-up
        step()
    medians: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for node in (True, False) if r % 2 == 0 else (False, True):
            gemm.USE_FUSED_BF16 = node
            step()
            medians[node].append(1e3 * statistics.median(step() for _ in range(args.steps)))
        mine, theirs = medians[True][-1], medians[False][-1]
        print(f"round {r + 1}: node {mine:.2f} ms, autocast {theirs:.2f} ms")
    node, auto = statistics.median(medians[True]), statistics.median(medians[False])
    wins = sum(a < b for a, b in zip(medians[True], medians[False]))
    print(
        f"config {args.config}: bf16 node {node:.2f} ms/step, autocast's modules {auto:.2f} "
        f"(median of {args.rounds} rounds; the node faster in {wins})"
    )


if __name__ == "__main__":
    main()
