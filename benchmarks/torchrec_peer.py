"""The TorchRec side of ``benchmarks/peers.py``: one DLRM training benchmark through
TorchRec's public API, run by the *peer* venv's Python (TorchRec + fbgemm-gpu-cpu),
never imported by recscale.

It reads a spec (JSON) and the batches recscale made (``torch.save`` of plain tensors),
so both systems train the same shapes on the same ids::

    spec     {"table_sizes", "embedding_dim", "bottom_mlp", "top_mlp", "batch_size",
              "sparse_optimizer": "rowwise_adagrad" | "sgd" | "adam", "sparse_lr",
              "sparse_eps", "dense_lr", "threads", "warmup", "steps",
              "precision": "fp32" | "bf16" (bf16: torch.autocast on the CPU around the
              forward, as a TorchRec user turns it on)}
    batches  list of {"dense" [B, 13] f32, "values" [N] i64, "lengths" [F*B] i64
              (feature-major, as a KeyedJaggedTensor), "labels" [B] f32}

The model is what TorchRec's own DLRM example trains: ``DLRMTrain(DLRM(ebc, ...))``
under ``DistributedModelParallel`` (world size 1, gloo, CPU), tables sharded by
TorchRec's planner into FBGEMM's CPU table-batched embedding with the optimizer fused
into the backward, the dense parameters under a plain SGD (``KeyedOptimizerWrapper``).
``init_data_parallel=False``: with one rank DDP would only add a no-op all-reduce, and
recscale's one-rank step has none either.

Prints one JSON object: samples/s of the median step (as ``recscale bench throughput``
reports it), the mean, the ms per step and the peak RSS. With ``--turns`` it times the
steps in the turns ``peers.py --interleave`` asks for on stdin (``turn_protocol.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from turn_protocol import report_turn, stdin_turns  # benchmarks/, beside this file

OPTIMIZERS = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
    "adam": EmbOptimType.ADAM,
}


def build(spec: dict, world_size: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TorchRec's DLRM of ``spec`` on the CPU, sharded by its planner over ``world_size``
    gloo ranks (the process group already made); DDP over the dense part only beyond
    one rank (with one it would only add a no-op all-reduce)."""
    device = torch.device("cpu")
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=spec["embedding_dim"],
            num_embeddings=rows,
            feature_names=[f"f{i}"],
        )
        for i, rows in enumerate(spec["table_sizes"])
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=spec["num_dense"],
            dense_arch_layer_sizes=spec["bottom_mlp"],
            over_arch_layer_sizes=spec["top_mlp"],
            dense_device=device,
        )
    )
    fused = {"optimizer": OPTIMIZERS[spec["sparse_optimizer"]], "learning_rate": spec["sparse_lr"]}
    if spec["sparse_optimizer"] != "sgd":
        fused["eps"] = spec["sparse_eps"]
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused)]
    topology = Topology(world_size=world_size, compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology).collective_plan(
        model, sharders, dist.GroupMember.WORLD
    )
    dmp = DistributedModelParallel(
        module=model,
        device=device,
        plan=plan,
        sharders=sharders,
        init_data_parallel=world_size > 1,
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=spec["dense_lr"]),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def to_torchrec(b: dict, num_features: int) -> Batch:
    keys = [f"f{i}" for i in range(num_features)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=b["values"], lengths=b["lengths"])
    return Batch(dense_features=b["dense"], sparse_features=kjt, labels=b["labels"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="JSON spec file")
    p.add_argument("--batches", required=True, help="torch.save'd list of batches")
    p.add_argument(
        "--turns",
        action="store_true",
        help="after the warm-up, time steps in the turns read from stdin "
        "(benchmarks/turn_protocol.py) instead of spec['steps'] at once",
    )
    args = p.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(spec.get("port", 29561)))
    dist.init_process_group("gloo", rank=0, world_size=1)
    t_build = time.perf_counter()
    model, opt = build(spec)
    build_s = time.perf_counter() - t_build
    batches = [to_torchrec(b, len(spec["table_sizes"])) for b in torch.load(args.batches)]

    bf16 = spec.get("precision", "fp32") == "bf16"

    def step(batch: Batch) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model(batch)
        loss.backward()
        opt.step()

    for i in range(spec["warmup"]):
        step(batches[i % len(batches)])
    times: list[float] = []
    elapsed = 0.0
    for n in stdin_turns() if args.turns else [spec["steps"]]:
        first = len(times)
        start = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            step(batches[len(times) % len(batches)])
            times.append(time.perf_counter() - t)
        elapsed += time.perf_counter() - start
        if args.turns:
            report_turn(times[first:])
    b = spec["batch_size"]
    print(
        json.dumps(
            {
                "system": "torchrec",
                "samples_per_s": b / statistics.median(times),
                "samples_per_s_mean": len(times) * b / elapsed,
                "ms_per_step": 1e3 * statistics.median(times),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "build_seconds": build_s,
                "torch": torch.__version__,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
