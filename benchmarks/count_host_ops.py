"""Count the framework ops one training step dispatches: the host-op figures of the
forecast's systems (``perfmodel/systems.py``) come from here.

    python benchmarks/count_host_ops.py recscale [--config A] [--steps 3] [--stages]
        [--device cuda] [overrides...]
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

``--stages`` also splits recscale's count by the stages ``recscale bench throughput``
times (lookup, forward, backward, sparse, dense_opt; the same marks): where a GPU step
is bound by its host, each stage's CUDA-event time is its ops' host time, so these are
what a per-stage host model needs. ``--device cuda`` counts the GPU path itself
(``model.kernels`` as configured: Triton's launches are not dispatcher ops, so they are
not in the count; the torch ops around them - sorts, read-backs, views - are).
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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # else its first dispatch imports torch._dynamo (train/precision.py)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def report(ops: collections.Counter, **fields) -> str:
    return json.dumps({**fields, "ops": sum(ops.values()), "top": ops.most_common(12)})


def count_recscale(
    config: str, overrides: list[str], steps: int, device: str = "cpu", stages: bool = False
) -> str:
    from recscale.config import load_config
    from recscale.distributed import DistContext
    from recscale.train.data_source import make_synthetic
    from recscale.train.optimizers import build_dense_optimizer
    from recscale.train.parallel import build
    from recscale.train.step import backward_and_step, forward_loss

    dev = torch.device(device)
    if dev.type == "cpu" and not any(o.startswith("--model.kernels") for o in overrides):
        overrides = [*overrides, "--model.kernels=torch"]
    cfg = load_config(config, [*overrides, f"--train.device={dev.type}"])
    model, _module, _plan = build(cfg, DistContext(device=dev), lambda _: None)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    data = make_synthetic(cfg)
    batches = [data.batch(i, cfg.train.batch_size).to(dev) for i in range(steps + 1)]
    precision = cfg.train.precision
    for b in batches[:steps]:
        backward_and_step(forward_loss(model, b, precision, dev), opt, precision, dev)
    c = OpCounter()
    count = lambda: sum(c.ops.values())  # noqa: E731 - the stages' clock
    sparse: list[tuple[int, int]] = []
    for storage in model.embeddings.storages():  # as bench/throughput.py's _SparseTimer
        update = storage.apply_pooled_gradients

        def counted(*args, _update=update):
            start = count()
            _update(*args)
            sparse.append((start, count()))

        storage.apply_pooled_gradients = counted
    marks: list[int] = []
    with c:
        t0 = count()
        loss = forward_loss(model, batches[-1], precision, dev, mark=lambda: marks.append(count()))
        t2 = count()
        t3, t4 = backward_and_step(loss, opt, precision, dev, count)
    fields = {"system": "recscale", "config": config, "overrides": overrides, "device": device}
    if stages:
        in_sparse = sum(b - a for a, b in sparse)
        fields["stage_ops"] = {
            "lookup": marks[0] - t0,
            "forward": t2 - marks[0],
            "backward": t3 - t2 - in_sparse,
            "sparse": in_sparse,
            "dense_opt": t4 - t3,
        }
    return report(c.ops, **fields)


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
    r.add_argument("--device", default="cpu", help="cpu (the GPU path's ops) or cuda")
    r.add_argument("--stages", action="store_true", help="split the count by bench stage")
    t = sub.add_parser("torchrec")
    t.add_argument("--world-size", type=int, default=2)
    t.add_argument("--tables", type=int, default=26)
    t.add_argument("--batch", type=int, default=256, help="samples a rank")
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--port", type=int, default=29577)
    args, overrides = ap.parse_known_args()
    if args.system == "recscale":
        print(count_recscale(args.config, overrides, args.steps, args.device, args.stages))
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
