"""recscale and TorchRec side by side, in the same run, on the same machine and batches.

    python benchmarks/peers.py --torchrec-python /path/to/peer-venv/bin/python \\
        [--configs A B] [--rounds 3] [--steps 50] [--out peers.jsonl] [--peer-same-malloc]

Each round runs ``recscale bench throughput --config C --json`` and TorchRec's DLRM on
the same shapes, optimizers and ids (``benchmarks/torchrec_peer.py``, run by the peer
venv's Python), one after the other in alternating order (recscale first in odd rounds,
TorchRec first in even ones), so a slow period of the machine hits both. Both report
batch / median step time over the same warm-up and step counts, on the same threads.
Per round it prints both rates and their ratio; at the end the median of the ratios.
Only ratios measured like this go into docs/performance.md.

The peer venv (TorchRec has no CPU wheel set of its own; fbgemm-gpu-cpu 1.9 does not
load on torch 2.13)::

    python3 -m venv /work/peers-venv
    /work/peers-venv/bin/pip install torch==2.13.0 numpy fbgemm-gpu-cpu==1.8.0 tqdm
    /work/peers-venv/bin/pip install --no-deps torchrec==1.8.0
    /work/peers-venv/bin/pip install tensordict torchmetrics==1.0.3 pyre-extensions
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from recscale import ENV_DEFAULTS
from recscale.config.loader import load_config
from recscale.config.schema import Config
from recscale.train.data_source import make_synthetic
from recscale.train.run import available_cores

HERE = Path(__file__).resolve().parent
DISTINCT_BATCHES = 8  # as recscale bench throughput cycles


def write_inputs(cfg: Config, folder: Path, steps: int, warmup: int) -> tuple[Path, Path]:
    """The spec and the batches the TorchRec worker trains on: the very batches
    ``recscale bench throughput`` makes (same generator, seed and indices)."""
    torch.manual_seed(cfg.train.seed)
    data = make_synthetic(cfg)
    b = cfg.train.batch_size
    batches = []
    for i in range(DISTINCT_BATCHES):
        x = data.batch(i, b)
        lengths = x.offsets[1:] - x.offsets[:-1]
        batches.append({"dense": x.dense, "values": x.values, "lengths": lengths,
                        "labels": x.labels})  # fmt: skip
    m, e = cfg.model, cfg.embedding
    if m.interaction != "dot" or cfg.optimizer.name != "sgd":
        raise SystemExit("peers: TorchRec's DLRM is compared with a dot interaction and SGD "
                         "on the MLPs (configs A and B)")  # fmt: skip
    spec = {
        "table_sizes": list(m.table_sizes),
        "embedding_dim": m.embedding_dim,
        "num_dense": m.num_dense_features,
        "bottom_mlp": list(m.bottom_mlp),
        "top_mlp": list(m.top_mlp),
        "batch_size": b,
        "sparse_optimizer": e.optimizer,
        "sparse_lr": e.lr,
        "sparse_eps": e.eps,
        "dense_lr": cfg.optimizer.lr,
        "threads": cfg.train.threads or available_cores(),
        "warmup": warmup,
        "steps": steps,
    }
    spec_path, batch_path = folder / "spec.json", folder / "batches.pt"
    spec_path.write_text(json.dumps(spec))
    torch.save(batches, batch_path)
    return spec_path, batch_path


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"peers: {' '.join(cmd[:3])} ... failed ({proc.returncode}):\n"
                         + proc.stderr[-3000:])  # fmt: skip
    out = proc.stdout
    return json.loads(out[out.index("{") :])  # progress lines may come first


def main() -> None:
    p = argparse.ArgumentParser(description="recscale vs TorchRec, alternating, same run")
    p.add_argument("--torchrec-python", required=True,
                   help="python of a venv with torchrec 1.8 + fbgemm-gpu-cpu 1.8")  # fmt: skip
    p.add_argument("--configs", nargs="+", default=["A", "B"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="also append each run as a JSON line here")
    p.add_argument("--peer-same-malloc", action="store_true",
                   help="give TorchRec's process the malloc settings recscale's "
                   "train.host_memory=retain makes (GLIBC_TUNABLES: no mmap for large blocks, "
                   "2 GiB kept at the heap top), so the comparison is of the rest")  # fmt: skip
    p.add_argument(
        "--peer-same-env",
        action="store_true",
        help="give TorchRec's process the variables importing recscale sets "
        f"({', '.join(f'{k}={v}' for k, v in ENV_DEFAULTS.items())})",
    )
    args = p.parse_args()
    # TorchRec runs in the environment this script was started in: without the variables
    # importing recscale set (its OpenMP waits, huge pages), which a TorchRec user's
    # process does not have. Up to session 9 it inherited them: OMP_WAIT_POLICY=PASSIVE
    # made its every op wake a sleeping OpenMP worker (A: ~29k against ~40k samples/s).
    peer_env = {k: v for k, v in os.environ.items()
                if args.peer_same_env or k not in ENV_DEFAULTS}  # fmt: skip
    if args.peer_same_malloc:
        peer_env["GLIBC_TUNABLES"] = (
            "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
        )
    recscale = [sys.executable, "-m", "recscale", "bench", "throughput"]
    summary = {}
    with tempfile.TemporaryDirectory(prefix="recscale-peers-") as tmp:
        for name in args.configs:
            cfg = load_config(name)
            spec, batches = write_inputs(cfg, Path(tmp), args.steps, args.warmup)
            peer = [args.torchrec_python, str(HERE / "torchrec_peer.py"),
                    "--spec", str(spec), "--batches", str(batches)]  # fmt: skip
            ours = [*recscale, "--config", name, "--json",
                    "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
            ratios = []
            for r in range(args.rounds):
                order = [("recscale", ours), ("torchrec", peer)]
                results = {}
                for system, cmd in order if r % 2 == 0 else order[::-1]:
                    results[system] = run_json(cmd, peer_env if system == "torchrec" else None)
                rs, tr = results["recscale"], results["torchrec"]
                ratio = rs["samples_per_s"] / tr["samples_per_s"]
                ratios.append(ratio)
                print(f"{name} round {r + 1}: recscale {rs['samples_per_s']:,.0f} samples/s "
                      f"(bound {rs['bound_samples_per_s']:,.0f}, {rs['ratio_to_bound']:.0%}), "
                      f"TorchRec {tr['samples_per_s']:,.0f}: {ratio:.2f}x; peak RSS "
                      f"{rs['peak_rss_bytes'] / 2**30:.2f} vs {tr['peak_rss_bytes'] / 2**30:.2f} GiB",
                      flush=True)  # fmt: skip
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({"config": name, "round": r + 1, "recscale": rs,
                                            "torchrec": tr, "ratio": ratio}) + "\n")  # fmt: skip
            summary[name] = statistics.median(ratios)
            os.remove(batches)
    for name, ratio in summary.items():
        print(f"{name}: recscale / TorchRec = {ratio:.2f}x (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
