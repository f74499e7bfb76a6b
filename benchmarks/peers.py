"""recscale and TorchRec side by side, in the same run, on the same machine and batches.

    python benchmarks/peers.py --torchrec-python /path/to/peer-venv/bin/python \\
        [--configs A B] [--rounds 3] [--steps 50] [--out peers.jsonl] [--peer-same-malloc]
        [--interleave [--turns 20] [--turn-steps 10]]
        [--precision bf16 [--row-precision auto|fp32|split_bf16]]

Each round runs ``recscale bench throughput --config C --json`` and TorchRec's DLRM on
the same shapes, optimizers and ids (``benchmarks/torchrec_peer.py``, run by the peer
venv's Python), one after the other in alternating order (recscale first in odd rounds,
TorchRec first in even ones), so a slow period of the machine hits both. Both report
batch / median step time over the same warm-up and step counts, on the same threads.
Per round it prints both rates and their ratio; at the end the median of the ratios.
Only ratios measured like this go into docs/performance.md.

On a shared VM whose speed changes from one second to the next a run of a minute per
side is still too coarse (one round on a 2-vCPU VM read 0.98x, the next 1.36x).
``--interleave`` keeps both processes alive - built, warmed up, then idle - and gives
them turns of ``--turn-steps`` steps, ``--turns`` of them a round, the first of each pair
alternating (``benchmarks/turn_protocol.py``); a round's ratio is the median of its
turns' ratios of median step times. Both models are then in memory together: a config
whose two copies do not fit in the memory available runs one after the other instead.

The peer venv (TorchRec has no CPU wheel set of its own; fbgemm-gpu-cpu 1.9 does not
load on torch 2.13)::

    python3 -m venv PEER_VENV
    PEER_VENV/bin/pip install torch==2.13.0 numpy fbgemm-gpu-cpu==1.8.0 tqdm
    PEER_VENV/bin/pip install --no-deps torchrec==1.8.0
    PEER_VENV/bin/pip install tensordict torchmetrics==1.0.3 pyre-extensions
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
from recscale.embedding.sizing import row_bytes
from recscale.train.data_source import make_synthetic
from recscale.train.step import available_cores

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
        batches.append(
            {"dense": x.dense, "values": x.values, "lengths": lengths, "labels": x.labels}
        )
    m, e = cfg.model, cfg.embedding
    if m.interaction != "dot" or cfg.optimizer.name != "sgd":
        raise SystemExit(
            "peers: TorchRec's DLRM is compared with a dot interaction and SGD "
            "on the MLPs (configs A and B)"
        )
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
        "precision": cfg.train.precision,
    }
    spec_path, batch_path = folder / "spec.json", folder / "batches.pt"
    spec_path.write_text(json.dumps(spec))
    torch.save(batches, batch_path)
    return spec_path, batch_path


class Worker:
    """One side of an interleaved pair: a process speaking ``turn_protocol``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None, log: Path):
        self.name, self.log = name, log
        self._err = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env
        )

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.wait()
        self._err.close()
        raise SystemExit(
            f"peers: the {self.name} worker stopped ({self.proc.returncode}):\n"
            + self.log.read_text()[-3000:]
        )

    def send(self, n: int) -> None:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()

    def turn(self, n: int) -> list[float]:
        self.send(n)
        return self.read()["step_s"]

    def finish(self) -> dict:
        self.send(0)
        result = self.read()
        self.proc.wait()
        self._err.close()
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def interleaved(
    ours: list[str],
    peer: list[str],
    peer_env: dict[str, str],
    turns: int,
    turn_steps: int,
    tmp: Path,
) -> tuple[dict, dict, list[float]]:
    """Both systems alive at once, taking turns of ``turn_steps`` steps (the first of
    each pair alternating), so a slow period of a shared machine lands on both sides of
    the pairs it spans: (recscale's result, TorchRec's, each turn's ratio of median step
    times). Both models are in memory together."""
    workers = {
        "recscale": Worker("recscale", ours, None, tmp / "recscale.log"),
        "torchrec": Worker("torchrec", [*peer, "--turns"], peer_env, tmp / "torchrec.log"),
    }
    try:
        for w in workers.values():  # built and warmed up: both idle from here on
            if not w.read().get("ready"):
                raise SystemExit(f"peers: the {w.name} worker did not say it was ready")
        ratios = []
        for t in range(turns):
            order = ["recscale", "torchrec"] if t % 2 == 0 else ["torchrec", "recscale"]
            median = {name: statistics.median(workers[name].turn(turn_steps)) for name in order}
            ratios.append(median["torchrec"] / median["recscale"])
        return workers["recscale"].finish(), workers["torchrec"].finish(), ratios
    finally:
        for w in workers.values():
            w.kill()


def both_fit(cfg: Config) -> tuple[bool, float, float]:
    """Whether two models of ``cfg`` fit in the memory available now (tables and their
    optimizer state twice, with 25% and 2 GiB to spare): (fits, GiB needed, GiB free)."""
    rows = sum(cfg.model.table_sizes)
    need = 2 * 1.25 * rows * row_bytes(cfg.embedding, cfg.model.embedding_dim) / 2**30 + 2
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    free = int(info["MemAvailable"].split()[0]) / 2**20
    return need <= free, need, free


def recscale_worker(config: str, warmup: int, precision: str, row_precision: str) -> None:
    """``--recscale-worker``: ``recscale bench throughput`` in turns read from stdin."""
    from turn_protocol import report_turn, stdin_turns

    from recscale.bench.throughput import run_throughput

    def echo(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    cfg = load_config(
        config, [f"--train.precision={precision}", f"--embedding.row_precision={row_precision}"]
    )
    r = run_throughput(cfg, warmup=warmup, echo=echo, turns=stdin_turns(), on_turn=report_turn)
    print(json.dumps(r), flush=True)


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(
            f"peers: {' '.join(cmd[:3])} ... failed ({proc.returncode}):\n" + proc.stderr[-3000:]
        )
    out = proc.stdout
    return json.loads(out[out.index("{") :])  # progress lines may come first


def main() -> None:
    p = argparse.ArgumentParser(description="recscale vs TorchRec, alternating, same run")
    p.add_argument(
        "--torchrec-python",
        required="--recscale-worker" not in sys.argv,
        help="python of a venv with torchrec 1.8 + fbgemm-gpu-cpu 1.8",
    )
    p.add_argument("--configs", nargs="+", default=["A", "B"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="also append each run as a JSON line here")
    p.add_argument(
        "--peer-same-malloc",
        action="store_true",
        help="give TorchRec's process the malloc settings recscale's "
        "train.host_memory=retain makes (GLIBC_TUNABLES: no mmap for large blocks, "
        "2 GiB kept at the heap top), so the comparison is of the rest",
    )
    p.add_argument(
        "--peer-same-env",
        action="store_true",
        help="give TorchRec's process the variables importing recscale sets "
        f"({', '.join(f'{k}={v}' for k, v in ENV_DEFAULTS.items())})",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep both processes alive and alternate turns of --turn-steps steps "
        "(--turns of them a round): a slow period of the machine then hits both "
        "sides of a pair; needs memory for both models (falls back otherwise)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: recscale's train.precision=bf16 against TorchRec under its own bf16 "
        "autocast (torch.autocast on the CPU around the forward; tables fp32 in both)",
    )
    p.add_argument(
        "--row-precision",
        choices=["auto", "fp32", "split_bf16"],
        default="auto",
        help="recscale's embedding.row_precision (TorchRec's tables stay fp32): auto (what "
        "recscale train runs: split_bf16 under bf16 on the CPU for rows wider than a cache "
        "line, else fp32), or one named; split_bf16 is recscale's Split-SGD-BF16 half of "
        "the bf16 recipe (the lookup reads bf16 halves, the update stays exact fp32)",
    )
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--turn-steps", type=int, default=10)
    p.add_argument("--recscale-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.recscale_worker:
        recscale_worker(args.recscale_worker, args.warmup, args.precision, args.row_precision)
        return
    # TorchRec runs in the environment this script was started in: without the variables
    # importing recscale set (its OpenMP waits, huge pages), which a TorchRec user's
    # process does not have. Inheriting them would slow it: OMP_WAIT_POLICY=PASSIVE makes
    # its every op wake a sleeping OpenMP worker (A: ~29k against ~40k samples/s).
    peer_env = {k: v for k, v in os.environ.items() if args.peer_same_env or k not in ENV_DEFAULTS}
    if args.peer_same_malloc:
        peer_env["GLIBC_TUNABLES"] = (
            "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
        )
    recscale = [sys.executable, "-m", "recscale", "bench", "throughput"]
    summary: dict[str, float] = {}
    resolved: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="recscale-peers-") as tmp:
        for name in args.configs:
            cfg = load_config(name, [f"--train.precision={args.precision}"])
            spec, batches = write_inputs(cfg, Path(tmp), args.steps, args.warmup)
            peer = [
                args.torchrec_python,
                str(HERE / "torchrec_peer.py"),
                "--spec",
                str(spec),
                "--batches",
                str(batches),
            ]
            ours = [
                *recscale,
                "--config",
                name,
                "--json",
                f"--train.precision={args.precision}",
                f"--embedding.row_precision={args.row_precision}",
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ]
            worker = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--recscale-worker",
                name,
                "--warmup",
                str(args.warmup),
                "--precision",
                args.precision,
                "--row-precision",
                args.row_precision,
            ]
            interleave = args.interleave
            if interleave:
                fits, need, free = both_fit(cfg)
                if not fits:
                    interleave = False
                    print(
                        f"{name}: both models need ~{need:.1f} GiB, {free:.1f} GiB available: "
                        "one after the other instead of interleaved",
                        flush=True,
                    )
            ratios = []
            for r in range(args.rounds):
                how = ""
                if interleave:
                    rs, tr, turn_ratios = interleaved(
                        worker, peer, peer_env, args.turns, args.turn_steps, Path(tmp)
                    )
                    ratio = statistics.median(turn_ratios)
                    how = (
                        f" [{args.turns} turns of {args.turn_steps} steps, their ratios "
                        f"{min(turn_ratios):.2f}-{max(turn_ratios):.2f}]"
                    )
                else:
                    order = [("recscale", ours), ("torchrec", peer)]
                    results = {}
                    for system, cmd in order if r % 2 == 0 else order[::-1]:
                        results[system] = run_json(cmd, peer_env if system == "torchrec" else None)
                    rs, tr = results["recscale"], results["torchrec"]
                    ratio = rs["samples_per_s"] / tr["samples_per_s"]
                ratios.append(ratio)
                print(
                    f"{name} {args.precision} round {r + 1}: "
                    f"recscale {rs['samples_per_s']:,.0f} samples/s "
                    f"(bound {rs['bound_samples_per_s']:,.0f}, {rs['ratio_to_bound']:.0%}), "
                    f"TorchRec {tr['samples_per_s']:,.0f}: {ratio:.2f}x; peak RSS "
                    f"{rs['peak_rss_bytes'] / 2**30:.2f} vs {tr['peak_rss_bytes'] / 2**30:.2f} "
                    f"GiB{how}",
                    flush=True,
                )
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(
                            json.dumps(
                                {
                                    "config": name,
                                    "precision": args.precision,
                                    "row_precision": rs.get("row_precision"),
                                    "round": r + 1,
                                    "recscale": rs,
                                    "torchrec": tr,
                                    "ratio": ratio,
                                }
                            )
                            + "\n"
                        )
            summary[name] = statistics.median(ratios)
            resolved[name] = rs.get("row_precision", args.row_precision)
            os.remove(batches)
    for name, ratio in summary.items():
        rows = "" if resolved[name] == "fp32" else f" (recscale's rows {resolved[name]})"
        print(
            f"{name} {args.precision}{rows}: recscale / TorchRec = {ratio:.2f}x "
            f"(median of {args.rounds} rounds)"
        )


if __name__ == "__main__":
    main()
