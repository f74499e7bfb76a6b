"""Time building a preset's model on the CPU - its tables' initial rows drawn (the first
thing a run of a large model waits for), and the MLPs.

    python benchmarks/model_build.py --config B [--rounds 2] [--section.key=value ...]

(e.g. ``--embedding.row_precision=split_bf16``: rows kept as bf16 halves are drawn on
the CPU and written a chunk at a time.)

Each round builds the model in a fresh process (a freed table's pages would otherwise
be reused) and prints the seconds, the threads and the tables' bytes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

ROUND = """
import time, torch
from recscale.config import load_config
from recscale.models.dlrm import build_model
cfg = load_config({config!r}, {overrides!r})
t = time.perf_counter()
model = build_model(cfg.model, cfg.embedding, seed=0)
s = time.perf_counter() - t
rows = sum(w.numel() * w.element_size() for w in (x.weight for x in model.embeddings.storages()))
print(f"{{s:.2f}} {{torch.get_num_threads()}} {{rows}}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="B")
    ap.add_argument("--rounds", type=int, default=2)
    args, overrides = ap.parse_known_args()  # the rest: --section.key=value overrides
    for r in range(args.rounds):
        t = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", ROUND.format(config=args.config, overrides=overrides)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        secs, threads, nbytes = float(out[0]), int(out[1]), int(out[2])
        print(
            f"round {r + 1}: config {args.config} built in {secs:.1f} s on {threads} threads "
            f"({nbytes / 1e9:.2f} GB of table rows; process {time.perf_counter() - t:.1f} s)"
        )


if __name__ == "__main__":
    main()
