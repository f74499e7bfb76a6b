"""Functions run on spawned ranks by the distributed tests (importable by child processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recscale.config import load_config
from recscale.data.synthetic import SyntheticCriteo
from recscale.distributed import init_distributed, shard, table_infos, uniform_plan
from recscale.models.dlrm import build_model
from recscale.planner import ShardingPlan
from recscale.train.hot_rows import assign_hot_rows
from recscale.train.optimizers import build_dense_optimizer


def parity_config(optimizer: str, pooling: str = "sum"):
    cfg = load_config(
        "debug",
        [
            f"--embedding.optimizer={optimizer}",
            f"--model.pooling={pooling}",
            "--data.max_ids_per_feature=3",
            "--optimizer.name=adam",
        ],
    )
    cfg.embedding.lr = 0.05
    return cfg


def global_batches(cfg, steps: int, batch_size: int):
    data = SyntheticCriteo(
        cfg.model.table_sizes,
        num_dense=cfg.model.num_dense_features,
        seed=7,
        zipf_alpha=1.05,
        min_ids=cfg.data.min_ids_per_feature,
        max_ids=cfg.data.max_ids_per_feature,
    )
    return [data.batch(i, batch_size, "train") for i in range(steps)], data.batch(
        0, batch_size, "eval"
    )


def train_and_report(module, model, dense_opt, batches, eval_batch):
    for b in batches:
        loss = F.binary_cross_entropy_with_logits(module(b), b.labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
    with torch.no_grad():
        preds = module(eval_batch)
    dense = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    return preds, dense


def reference(optimizer: str, pooling: str, steps: int, batch_size: int):
    """World size 1: the plain single-device model on the global batches."""
    torch.manual_seed(0)
    cfg = parity_config(optimizer, pooling)
    batches, eval_batch = global_batches(cfg, steps, batch_size)
    model = build_model(cfg.model, cfg.embedding, seed=0)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    preds, dense = train_and_report(model, model, opt, batches, eval_batch)
    ebc = model.embeddings
    tables = []
    for f, _spec in enumerate(ebc.tables):
        g = ebc.groups[int(ebc.group_of_feature[f])]
        lo = int(ebc.feature_row_offset[f])
        rows = torch.arange(lo, lo + ebc.tables[f].num_rows)
        tables.append((g.storage.read_rows(rows), g.storage.read_state(rows)))
    return preds, dense, tables


def mixed_plan(cfg, world_size: int) -> dict:
    """Every kind in one plan: table i takes kind i % 4 (column_wise over 2 ranks)."""
    kinds = ["table_wise", "row_wise", "column_wise", "data_parallel"]
    w = world_size
    placements = []
    for i, t in enumerate(table_infos(cfg)):
        kind = kinds[i % 4]
        ranks = {"table_wise": [(i + 1) % w], "column_wise": [i % w, (i + 1) % w]}.get(
            kind, list(range(w))
        )
        dims = [t.dim // 2, t.dim - t.dim // 2] if kind == "column_wise" else []
        placements.append(
            {
                "table": t.name,
                "kind": kind,
                "ranks": ranks,
                "memory_per_rank": {},
                "cost_per_rank": {},
                "dims": dims,
            }
        )
    return {
        "world_size": w,
        "placements": placements,
        "memory_per_rank": [0] * w,
        "cost_per_rank": [0.0] * w,
    }


def sharded_run(cases: list[tuple[str, str, str]], steps: int, batch_size: int):
    """On each rank, per case (plan, optimizer, pooling) - the plan being a kind for every
    table or "mixed" - train the sharded model on this rank's slices of the global
    batches; report predictions for the local eval slice, the dense weights, and every
    local table part."""
    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"), timeout_s=60)
    w, r = ctx.world_size, ctx.rank
    lo, hi = r * batch_size // w, (r + 1) * batch_size // w
    out = []
    for plan_name, optimizer, pooling in cases:
        cfg = parity_config(optimizer, pooling)
        batches, eval_batch = global_batches(cfg, steps, batch_size)
        torch.manual_seed(0)
        if plan_name == "mixed":
            plan = ShardingPlan.from_dict(mixed_plan(cfg, w))
        else:
            plan = uniform_plan(table_infos(cfg), w, plan_name)
        model = build_model(cfg.model, cfg.embedding, seed=0, materialize_embeddings=False)
        module = shard(model, plan, ctx)
        opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
        local = [b.slice(lo, hi) for b in batches]
        preds, dense = train_and_report(module, model, opt, local, eval_batch.slice(lo, hi))
        parts = []
        for s, storage, first in model.embeddings.local_parts():
            rows = torch.arange(first, first + s.num_rows)
            parts.append((s, storage.read_rows(rows), storage.read_state(rows)))
        out.append((preds, dense, parts))
    torch.distributed.destroy_process_group()
    return out


def die_mid_training(dying_rank: int, die_at_step: int):
    """Train the debug model; ``dying_rank`` exits abruptly at ``die_at_step``. The
    survivors must fail with an error (not hang): returns nothing when they do not."""
    import os
    import time

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"), timeout_s=30)
    cfg = parity_config("sgd")
    batches, _ = global_batches(cfg, 1, 64)
    model = build_model(cfg.model, cfg.embedding, seed=0, materialize_embeddings=False)
    module = shard(model, uniform_plan(table_infos(cfg), ctx.world_size, "row_wise"), ctx)
    n = 64 // ctx.world_size
    local = batches[0].slice(ctx.rank * n, (ctx.rank + 1) * n)
    start = time.monotonic()
    for step in range(10_000):
        if ctx.rank == dying_rank and step == die_at_step:
            os._exit(17)
        try:
            F.binary_cross_entropy_with_logits(module(local), local.labels).backward()
        except RuntimeError as e:
            raise RuntimeError(
                f"failed after {time.monotonic() - start:.1f}s at step {step}: {e}"
            ) from e


def checkpoint_hop(
    plan_name: str, chain: str, out_root: str, first_step: int, steps: int, batch_size: int
) -> None:
    """Restore ``chain`` into a model sharded by ``plan_name``, train ``steps`` more
    global batches (from ``first_step``), and write a full checkpoint to ``out_root``."""
    from pathlib import Path

    from recscale.checkpoint.manager import CheckpointManager
    from recscale.checkpoint.state import restore
    from recscale.config import CheckpointConfig

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"), timeout_s=60)
    w, r = ctx.world_size, ctx.rank
    cfg = parity_config("rowwise_adagrad")
    plan = (
        ShardingPlan.from_dict(mixed_plan(cfg, w))
        if plan_name == "mixed"
        else uniform_plan(table_infos(cfg), w, plan_name)
    )
    # rows zeroed, not drawn, as a resume builds them: the restore must write every one
    model = build_model(
        cfg.model, cfg.embedding, seed=0, materialize_embeddings=False, init_rows=False
    )
    module = shard(model, plan, ctx)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    trainer = restore(model, opt, [Path(p) for p in chain.split(",")])
    assert trainer["step"] == first_step
    batches, _ = global_batches(cfg, first_step + steps, batch_size)
    lo, hi = r * batch_size // w, (r + 1) * batch_size // w
    # Full first, then increments (rows touched since): the newest chain mixes both.
    ckpt_cfg = CheckpointConfig(
        every_steps=1, async_write=False, full_every=100, full_if_fraction=1.0
    )
    mgr = CheckpointManager(ckpt_cfg, Path(out_root), model, opt, {"plan": plan.to_dict()}, ctx)
    for i, b in enumerate(batches[first_step:]):
        local = b.slice(lo, hi)
        loss = F.binary_cross_entropy_with_logits(module(local), local.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 0:
            mgr.save(first_step + 1, {"step": first_step + 1})
    mgr.save(first_step + steps, {"step": first_step + steps})
    mgr.wait()
    torch.distributed.destroy_process_group()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def checkpoint_memory(root: str, big_rows: int) -> dict:
    """A 2-rank checkpoint where rank 1 holds one big table and rank 0 only small ones:
    returns rank 0's peak memory growth during the save and the part files each wrote."""
    from pathlib import Path

    from recscale.checkpoint.manager import CheckpointManager
    from recscale.config import CheckpointConfig

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"), timeout_s=60)
    cfg = parity_config("rowwise_adagrad")
    cfg.model.table_sizes = [big_rows] + cfg.model.table_sizes[1:]
    names = [t.name for t in table_infos(cfg)]
    plan = ShardingPlan.from_dict(
        {
            "world_size": 2,
            "memory_per_rank": [0, 0],
            "cost_per_rank": [0.0, 0.0],
            "placements": [
                {
                    "table": n,
                    "kind": "table_wise",
                    "ranks": [1 if i == 0 else 0],
                    "memory_per_rank": {},
                    "cost_per_rank": {},
                }
                for i, n in enumerate(names)
            ],
        }
    )
    model = build_model(cfg.model, cfg.embedding, seed=0, materialize_embeddings=False)
    module = shard(model, plan, ctx)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    batches, _ = global_batches(cfg, 1, 64)
    local = batches[0].slice(ctx.rank * 32, (ctx.rank + 1) * 32)
    F.binary_cross_entropy_with_logits(module(local), local.labels).backward()
    opt.step()
    mgr = CheckpointManager(
        CheckpointConfig(every_steps=1, async_write=False),
        Path(root),
        model,
        opt,
        {"plan": plan.to_dict()},
        ctx,
    )
    # Peak memory during the save alone: reset the process's high-water mark (VmHWM)
    # to its current size first, then read it back after.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss_before = _status_kb("VmRSS") * 1024
    mgr.save(1, {"step": 1})
    mgr.wait()
    peak = _status_kb("VmHWM") * 1024
    torch.distributed.barrier(group=ctx.dense)
    torch.distributed.destroy_process_group()
    return {"growth": peak - rss_before, "rank": ctx.rank}


COMPRESSED = [
    "--embedding.compression=qr",
    "--embedding.qr_buckets=8",
    "--embedding.table_compression=C2=tt,C3=mixed_dim,C4=none",
    "--embedding.hot_fraction=0.05",
]


def compressed_config():
    cfg = load_config(
        "debug",
        [
            "--data.max_ids_per_feature=3",
            "--optimizer.name=adam",
            "--embedding.tt_rank=2",
            *COMPRESSED,
        ],
    )
    return cfg


def compressed_reference(steps: int, batch_size: int):
    """World size 1 with compressed tables: eval predictions after ``steps``."""
    torch.manual_seed(0)
    cfg = compressed_config()
    batches, eval_batch = global_batches(cfg, steps, batch_size)
    model = build_model(cfg.model, cfg.embedding, seed=0)
    assign_hot_rows(model, cfg, lambda _msg: None)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    return train_and_report(model, model, opt, batches, eval_batch)[0]


def compressed_run(steps: int, batch_size: int):
    """The same on this rank's slices, compressed tables placed whole by the planner."""
    from recscale.embedding.placement import storage_factory
    from recscale.planner.from_config import plan_for

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"), timeout_s=60)
    w, r = ctx.world_size, ctx.rank
    lo, hi = r * batch_size // w, (r + 1) * batch_size // w
    cfg = compressed_config()
    batches, eval_batch = global_batches(cfg, steps, batch_size)
    torch.manual_seed(0)
    plan = plan_for(cfg, w, 1 << 40)
    model = build_model(cfg.model, cfg.embedding, seed=0, materialize_embeddings=False)
    module = shard(model, plan, ctx, storage_factory(cfg.embedding, torch.device("cpu"), "auto"))
    assign_hot_rows(model, cfg, lambda _msg: None)  # each rank: its own compressed tables
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    local = [b.slice(lo, hi) for b in batches]
    preds, _ = train_and_report(module, model, opt, local, eval_batch.slice(lo, hi))
    kinds = {p.table: p.kind for p in plan.placements}
    torch.distributed.destroy_process_group()
    return preds, kinds


def train_and_report_group(steps: int) -> bool:
    """``train`` as a torchrun worker calls it (no context given): returns whether a
    process group is still alive afterwards."""
    from recscale.train.run import train

    torch.set_num_threads(1)
    cfg = load_config("debug", [f"--train.steps={steps}", "--train.progress=false"])
    cfg.train.device = "cpu"
    metrics = train(cfg, None, echo=lambda _m: None)
    assert metrics["world_size"] == 2
    return torch.distributed.is_initialized()


def train_into_own_run_dir(root: str) -> str:
    """``train`` with a run directory of each rank's own making, as two ranks that
    timestamp a default name a second apart do; checkpointing on (every rank writes its
    part where rank 0 waits for it). Returns the directory the run's metrics are in."""
    import os
    from pathlib import Path

    from recscale.train.run import train

    torch.set_num_threads(1)
    cfg = load_config(
        "debug",
        [
            "--train.steps=4",
            "--train.progress=false",
            "--checkpoint.every_steps=2",
            "--distributed.sharding=column_wise",
            "--distributed.timeout_s=30",
        ],
    )
    cfg.train.device = "cpu"
    rank = int(os.environ["RANK"])
    train(cfg, Path(root) / f"rank{rank}", echo=lambda _m: None)
    return str(next(Path(root).glob("*/metrics.json")).parent)


def train_with_rank_overrides(root: str, by_rank: dict) -> str:
    """``train`` of the debug preset with ``by_rank[rank]`` overrides on each rank, as
    nodes that each read their own copy of a config file do. Returns "ok", or the
    error it stopped with as "TypeName: message"."""
    import os
    from pathlib import Path

    from recscale.config.errors import ConfigError
    from recscale.data.dataset import DatasetError
    from recscale.train.config_agreement import RankFailed
    from recscale.train.run import train

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    cfg = load_config(
        "debug",
        ["--train.steps=4", "--train.progress=false", "--distributed.timeout_s=30"]
        + list(by_rank.get(rank, [])),
    )
    cfg.train.device = "cpu"
    try:
        train(cfg, Path(root) / "run", echo=lambda _m: None)
    except (ConfigError, DatasetError, RankFailed) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def train_with_rank_memory(root: str, memory_by_rank: dict) -> dict:
    """``train`` of the debug preset (planner's sharding) where each rank's node reports
    its own memory (``memory_by_rank[rank]`` bytes a rank), as nodes of different sizes
    do. Returns the run's metrics and the plan this rank trained under."""
    import os
    from pathlib import Path

    import recscale.train.parallel as parallel
    from recscale.train.run import train

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    parallel.default_memory_per_rank = lambda _device, _w: memory_by_rank[rank]
    cfg = load_config(
        "debug",
        [
            "--train.steps=20",
            "--train.progress=false",
            "--distributed.timeout_s=30",
            "--data.max_ids_per_feature=2",
        ],
    )
    cfg.train.device = "cpu"
    metrics = train(cfg, Path(root) / "run", echo=lambda _m: None)
    return {"auc": metrics["auc"], "logloss": metrics["logloss"]}


def replicated_rows(precision: str, steps: int, batch_size: int):
    """On each rank: the debug model at ``embedding.row_precision=precision`` with every
    table replicated (data_parallel), trained ``steps`` steps on this rank's slices;
    returns each replicated storage's class and row dtype, and every table's rows."""
    from recscale.embedding.placement import storage_factory

    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"), timeout_s=60)
    w, r = ctx.world_size, ctx.rank
    lo, hi = r * batch_size // w, (r + 1) * batch_size // w
    cfg = parity_config("rowwise_adagrad")
    cfg.embedding.row_precision = precision
    batches, eval_batch = global_batches(cfg, steps, batch_size)
    torch.manual_seed(0)
    plan = uniform_plan(table_infos(cfg), w, "data_parallel")
    model = build_model(cfg.model, cfg.embedding, seed=0, materialize_embeddings=False)
    make = storage_factory(cfg.embedding, None, "auto")
    module = shard(model, plan, ctx, make, row_precision=precision)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    train_and_report(module, model, opt, [b.slice(lo, hi) for b in batches], eval_batch)
    kinds = [(type(s).__name__, str(s.weight.dtype)) for s in model.embeddings.storages()]
    rows = {}
    for s, storage, first in model.embeddings.local_parts():
        rows[s.feature] = storage.read_rows(torch.arange(first, first + s.num_rows))
    torch.distributed.destroy_process_group()
    return kinds, rows


def cli_as_rank(argv: list[str], out_dir: str) -> int:
    """``recscale ARGV`` as this rank (run_ranks' environment, as torchrun's), its fds 1
    and 2 on ``out_dir/rank{R}.out``/``.err``; returns its exit code. For the CLI paths
    the torchrun tests have already launched once (a launch costs two interpreters)."""
    import os
    import sys

    from helpers import standard_streams_to

    from recscale.cli.main import main

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1
    stem = os.path.join(out_dir, f"rank{os.environ['RANK']}")
    standard_streams_to(stem + ".out", stem + ".err")
    try:
        return main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
