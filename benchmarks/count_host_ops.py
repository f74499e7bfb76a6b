"""Count the framework ops one training step dispatches: the host-op figures of the
forecast's systems (``perfmodel/systems.py``) come from here.

    python benchmarks/count_host_ops.py recscale [--config A] [--steps 3] [overrides...]
    PEER_VENV/bin/python benchmarks/count_host_ops.py torchrec [--world-size 2] [--tables 26]

Each op that reaches the dispatcher (aten, fbgemm, c10d; views and detaches included,
as each costs the host a dispatch) is counted by a ``TorchDispatchMode`` around one
step after a warm-up: forward, backward (with its fused sparse update) and the dense
optimizer. Prints the total and the most frequent ops as JSON. recscale's step runs
``model.kernels=torch`` by default - the op sequence of its GPU path, whose Triton
kernels stand where the torch ops of the reference path are. TorchRec's step is its
DLRM example's as ``torchrec_peer.py`` builds it (``DLRMTrain`` under
``DistributedModelParallel``, FBGEMM's table-batched embedding with the optimizer fused
into the backward), in ``--world-size`` gloo ranks on the CPU (the peer venv of
``benchmarks/peers.py``). Counted on 2026-11-25: recscale
config A 197, config B 215; TorchRec 1.8, 26 one-hot tables, rank 0 of 2 / 4 / 8
ranks 373 / 379 / 391.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched inside it, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def report(ops: collections.Counter, **fields) -> str:
    return json.dumps({**fields, "ops": sum(ops.values()), "top": ops.most_common(12)})


def count_recscale(config: str, overrides: list[str], steps: int) -> str:
    from recscale.config import load_config
    from recscale.distributed import DistContext
    from recscale.train.data_source import make_synthetic
    from recscale.train.optimizers import build_dense_optimizer
    from recscale.train.parallel import build
    from recscale.train.step import backward_and_step, forward_loss

    if not any(o.startswith("--model.kernels") for o in overrides):
        overrides = [*overrides, "--model.kernels=torch"]
    cfg = load_config(config, overrides)
    dev = torch.device("cpu")
    model, _module, _plan = build(cfg, DistContext(device=dev), lambda _: None)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    batches = [data.batch(i, cfg.train.batch_size) for i in range(steps + 1)]
    precision = cfg.train.precision
    for b in batches[:steps]:
        backward_and_step(forward_loss(model, b, precision, dev), opt, precision, dev)
    with OpCounter() as c:
        backward_and_step(forward_loss(model, batches[-1], precision, dev), opt, precision, dev)
    return report(c.ops, system="recscale", config=config, overrides=overrides)


def _torchrec_rank(rank: int, world: int, tables: int, batch: int, steps: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torchrec_peer import build, to_torchrec  # benchmarks/, beside this file

    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = [1000 * (i + 1) for i in range(tables)]
    spec = {
        "table_sizes": rows,
        "embedding_dim": 128,
        "num_dense": 13,
        "bottom_mlp": [512, 256, 128],
        "top_mlp": [1024, 1024, 512, 256, 1],
        "sparse_optimizer": "sgd",
        "sparse_lr": 0.1,
        "dense_lr": 0.1,
    }
    model, opt = build(spec, world)

    def make_batch():
        b = {
            "dense": torch.randn(batch, 13),
            "values": torch.cat([torch.randint(0, n, (batch,)) for n in rows]),
            "lengths": torch.ones(tables * batch, dtype=torch.int64),
            "labels": torch.randint(0, 2, (batch,)).float(),
        }
        return to_torchrec(b, tables)

    def step(b) -> None:
        opt.zero_grad(set_to_none=True)
        loss, _ = model(b)
        loss.backward()
        opt.step()

    for _ in range(steps):
        step(make_batch())
    b = make_batch()
    with OpCounter() as c:
        step(b)
    if rank == 0:
        print(report(c.ops, system="torchrec", world_size=world, tables=tables), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="system", required=True)
    r = sub.add_parser("recscale")
    r.add_argument("--config", default="A")
    r.add_argument("--steps", type=int, default=3, help="warm-up steps before the counted one")
    t = sub.add_parser("torchrec")
    t.add_argument("--world-size", type=int, default=2)
    t.add_argument("--tables", type=int, default=26)
    t.add_argument("--batch", type=int, default=256, help="samples a rank")
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--port", type=int, default=29577)
    args, overrides = ap.parse_known_args()
    if args.system == "recscale":
        print(count_recscale(args.config, overrides, args.steps))
        return
    import torch.multiprocessing as mp

    world = args.world_size
    mp.spawn(
        _torchrec_rank,
        args=(world, args.tables, args.batch, args.steps, args.port),
        nprocs=world,
    )


if __name__ == "__main__":
    sys.exit(main())
