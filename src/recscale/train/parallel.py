"""Building and stepping the model the same way at every world size.

* build the model with its tables on the meta device, plan, and ``shard`` it (world
  size 1: a one-rank plan, whole tables);
* each rank takes its slice ``[r B/W, (r+1) B/W)`` of every global batch;
* one all-reduce per step of (loss, stop flag): the logged loss is the global mean,
  a NaN anywhere stops every rank before any update, and a time limit hit on one
  rank stops all at the same step (collectives must stay matched);
* evaluation: every global eval batch is split (and padded) across ranks, and the
  predictions are all-gathered so the metrics are exact over the whole set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.data.batch import Batch
from recscale.data.dataset import BinaryDataset, DatasetError
from recscale.data.synthetic import DENSE_DRAW_BYTES
from recscale.distributed import DistContext, one_rank_plan, shard
from recscale.embedding.placement import storage_factory
from recscale.embedding.sizing import row_bytes
from recscale.launch_env import local_world_size
from recscale.metrics import binary_metrics
from recscale.models.dlrm import DLRM, build_model
from recscale.modules.interaction_padding import PAD_MULTIPLE
from recscale.perfmodel import calibrated_laws
from recscale.planner import PlanError, ShardingPlan
from recscale.planner.from_config import ids_per_sample, plan_for, with_tiers
from recscale.planner.job_plan import (
    available_memory,
    configured_tiers,
    default_memory_per_rank,
    ssd_free_bytes,
    with_kernels,
)
from recscale.planner.layout import build_layout, table_bytes_per_rank
from recscale.train.data_source import popularity_ranks, synthetic_eval_set_bytes
from recscale.train.precision import autocast
from recscale.units import size_text


def check_batch_divides(cfg: Config, world_size: int) -> None:
    """Every rank trains an equal slice of each global batch."""
    if cfg.train.batch_size % world_size:
        raise ConfigError(
            "train.batch_size", f"{cfg.train.batch_size} does not divide across {world_size} ranks"
        )


def build(
    cfg: Config, ctx: DistContext, echo: Callable[[str], None], init_rows: bool = True
) -> tuple[DLRM, nn.Module, ShardingPlan]:
    """The model every rank trains, at any world size: build it with its tables on the
    meta device, plan, and ``shard`` it (world size 1: the one-rank plan, whole tables,
    idle distribution stages - unless a plan or a sharding kind is asked for). Returns
    (model, the module to call - DDP-wrapped on several ranks -, plan)."""
    w = ctx.world_size
    check_batch_divides(cfg, w)
    e, d = cfg.embedding, cfg.distributed
    if d.calibration not in ("auto", "none") and (w == 1 or d.plan or d.sharding != "auto"):
        calibrated_laws(cfg)  # a file this plan does not use is still read: a typo fails now
    if w == 1 and not d.plan and d.sharding == "auto":
        plan = one_rank_plan([f"C{i + 1}" for i in range(len(cfg.model.table_sizes))])
    else:
        if e.memory_budget_gb and w > 1:  # one process's budget: planned with, it was not
            raise ConfigError(
                "embedding.memory_budget_gb",
                f"is the budget of one process's placement=auto; at {w} ranks each rank "
                "plans with distributed.memory_per_rank_gb (set that instead)",
            )
        gb = d.memory_per_rank_gb
        memory = int(gb * 1e9) if gb else default_memory_per_rank(ctx.device, w)
        ssd = 0
        if e.placement == "auto":  # several ranks: the planner places tiers per rank
            ssd = int(ssd_free_bytes(e.ssd_dir) * 0.9) // w
        if w > 1:
            memory, ssd = _smallest_on_any_rank(ctx, memory, ssd)
        laws = _shared_laws(cfg, ctx) if d.sharding == "auto" and not d.plan else None
        try:
            plan = plan_for(cfg, w, memory, ssd_per_rank=ssd, laws=laws)
        except PlanError as err:
            raise ConfigError("distributed.memory_per_rank_gb", str(err)) from err
    # The plan is where each table's tier is decided, at every world size ...
    plan = with_tiers(plan, configured_tiers(cfg, echo, ctx.device, w))
    plan = with_kernels(plan, cfg, ctx.device)  # ... and each table's kernel
    check_memory(cfg, plan, ctx)
    check_dense_memory(cfg, ctx.device)
    check_batch_memory(cfg, ctx)
    check_eval_batch_memory(cfg, ctx.world_size)
    model = build_model(
        cfg.model,
        cfg.embedding,
        device=ctx.device,
        seed=cfg.train.seed,
        materialize_embeddings=False,
        init_rows=init_rows,  # False: a checkpoint's rows are restored into it next
    )
    make_storage = storage_factory(
        e,
        ctx.device,
        cfg.model.kernels,
        subdir=f"rank{ctx.rank:05d}" if w > 1 else "",
        rank_of_id=popularity_ranks(cfg),  # lazy: only an ssd file asks
    )
    module = shard(model, plan, ctx, make_storage, row_precision=e.row_precision)
    if w > 1:
        kinds = plan.kind_counts()
        mem = plan.memory_per_rank
        tiers = sorted({p.placement for p in plan.placements} - {"device"})
        echo(
            f"recscale: {w} ranks; sharding "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + (
                f"; planned embedding memory per rank {min(mem) / 1e9:.3f}-{max(mem) / 1e9:.3f} GB"
                if any(mem)
                else ""
            )
            + (f"; tiers {', '.join(tiers)}" if tiers else "")
        )
    return model, module, plan


def _smallest_on_any_rank(ctx: DistContext, memory: int, ssd: int) -> tuple[int, int]:
    """The memory and ssd budgets every rank plans with: the smallest any rank has. Each
    rank plans for itself, and its budgets come from its own node (its memory, its
    disk's free space, which moves by the second): ranks planning with different budgets
    make different plans (two gloo ranks given 1 GB and 150 kB for the debug model:
    tables replicated on one, split by rows on the other) and exchange the wrong slices."""
    t = torch.tensor([memory, ssd], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.dense)
    return int(t[0]), int(t[1])


def _shared_laws(cfg: Config, ctx: DistContext):
    """Rank 0's calibrated planner costs on every rank (each rank must make the same
    plan); rank 0's config error raised on every rank, so none waits for the others."""
    got: tuple[str, object] = ("ok", None)
    if ctx.is_main:
        try:
            got = ("ok", calibrated_laws(cfg))
        except ConfigError as e:
            got = ("error", (e.key, e.message))
        except Exception as e:  # noqa: BLE001 - any failure here must reach every rank
            got = ("error", ("distributed.calibration", f"{type(e).__name__}: {e}"))
    kind, value = ctx.broadcast(got)
    if kind == "error":
        raise ConfigError(*value)
    return value


# The share of the memory available that in-memory tables may take: the rest holds the
# step's activations, the data's batches and the held-out set.
TABLE_SHARE = 0.9


def check_memory(cfg: Config, plan: ShardingPlan, ctx: DistContext) -> None:
    """Fail in a second, naming the fixes, when this rank's in-memory tables (rows,
    optimizer state) cannot fit the memory there is - instead of a raw allocator error
    minutes later (a 40M-row hash space per table, a 10^12-row table). CPU ranks on one
    host (``LOCAL_WORLD_SIZE``) share its memory: each checks against its share."""
    e = cfg.embedding
    names = [f"C{i + 1}" for i in range(len(cfg.model.table_sizes))]
    dims = cfg.model.dims()
    layout = build_layout(names, list(cfg.model.table_sizes), dims, plan)
    tier = {n: "device" for n in names} | {p.table: p.placement for p in plan.placements}
    dp = set(layout.dp_features)  # replicated tables always stay in memory
    need = table_bytes_per_rank(
        layout, lambda w: row_bytes(e, w), lambda f: f in dp or tier[names[f]] == "device"
    )[ctx.rank]
    have = available_memory(ctx.device)
    sharing = local_world_size() if ctx.device.type == "cpu" else 1
    have //= sharing  # the ranks on this host each hold their tables in its memory
    if need > TABLE_SHARE * have:
        where = "GPU" if ctx.device.type == "cuda" else "host"
        each = f" to each of the {sharing} ranks on this host" if sharing > 1 else ""
        raise ConfigError(
            "embedding.placement",
            f"the embedding tables in {where} memory need {size_text(need)} (rows x (dim + "
            f"optimizer state) x 4 bytes) but {size_text(have)} are available{each}, of which "
            f"the tables may take {TABLE_SHARE:.0%} ({size_text(TABLE_SHARE * have)}; the "
            "rest is the step's and the data's): use "
            "--embedding.placement=auto (the planner moves the largest tables to "
            f"{'host memory or ' if where == 'GPU' else ''}ssd), or give the dataset fewer rows "
            "(`recscale data preprocess --mode vocab`, or a smaller --hash-size)",
        )


# Host bytes an id of a batch takes at the step's peak, as measured (config debug over a
# multi-hot dataset of 4,096 ids a bag - 27M ids a batch -, peak RSS against the batch
# size and `data.prefetch_batches`, 2026-11-27): the loader's ids, their int64 copies and
# bag indices, the lookup's sorted ids and permutation ...
STEP_BYTES_PER_ID = 52
# ... and an id of each batch waiting in the prefetch queue.
QUEUED_BYTES_PER_ID = 6


def batch_bytes_per_sample(cfg: Config, forward_only: bool = False) -> int:
    """An estimate of the host bytes one training sample takes at the step's peak (low:
    the activations are counted once): its inputs (dense values drawn in float64 then
    normalised in a second float64 copy, kept in float32; the label), its ids in the step
    and in the batches queued ahead (``data.prefetch_batches``) and, forward and back,
    the pooled embeddings and every layer's output (the interaction's included) in
    float32 (DCNv2's as its stack keeps them). A multi-hot dataset's ids
    count at its bag sizes (counted as one a table, 65,535-id bags ran out of memory).
    ``forward_only``: a sample of an evaluation batch (no queue, no backward)."""
    m = cfg.model
    ids = sum(ids_per_sample(cfg))
    per_id = STEP_BYTES_PER_ID + QUEUED_BYTES_PER_ID * cfg.data.prefetch_batches
    if forward_only:
        per_id = STEP_BYTES_PER_ID
    f, dims = len(m.table_sizes), m.dims()
    passes = 1 if forward_only else 2
    widths = sum(m.bottom_mlp) + sum(m.top_mlp) + sum(dims)
    cross = 0  # DCNv2's float32 values, counted as modules/dcn.py keeps them
    if m.interaction == "dcnv2":
        d = sum(dims) + (m.bottom_mlp[-1] if m.bottom_mlp else 0)
        r, n = m.dcn_rank, m.dcn_layers
        # x0 and each layer's input, low-rank product and output saved for the backward,
        # and the backward's own; forward only (no grad) one layer's at a time
        cross = 3 * d + r if forward_only else d + n * (2 * d + r) + 3 * d + r
    else:
        widths += (f + 1) * f // 2
    dense = m.num_dense_features * (DENSE_DRAW_BYTES + 4)
    return int(dense + ids * per_id + 8 + widths * 4 * passes + cross * 4)


def dense_parameter_counts(cfg: Config) -> dict[str, int]:
    """The MLPs' and the interaction's parameters (weights and biases), by the config
    key that sizes them - what ``DLRM`` will allocate, counted before it does."""
    m = cfg.model
    dims = m.dims()

    def mlp(n_in: int, widths: list[int]) -> int:
        total = 0
        for w in widths:
            total += n_in * w + w
            n_in = w
        return total

    dense = m.bottom_mlp[-1] if m.num_dense_features and m.bottom_mlp else 0
    counts = {"model.bottom_mlp": mlp(m.num_dense_features, m.bottom_mlp) if dense else 0}
    if m.interaction == "dot":
        n = len(dims) + (1 if dense else 0)
        width = n * (n - 1) // 2 + (n if m.interaction_self else 0) + dense
        top_in = -(-width // PAD_MULTIPLE) * PAD_MULTIPLE  # zero columns pad it (DotInteraction)
    else:
        top_in = sum(dims) + dense
        if m.interaction == "dcnv2":
            counts["model.dcn_rank"] = m.dcn_layers * (2 * top_in * m.dcn_rank + top_in)
    counts["model.top_mlp"] = mlp(top_in, m.top_mlp)
    return counts


def check_dense_memory(cfg: Config, device: torch.device) -> None:
    """Fail in a second, naming the key that sizes the largest part, when the dense
    model's parameters with their gradients and an optimizer's state (16 bytes each at
    most: Adam) cannot fit the memory of ``device`` (they live there) - a typo'd width
    of 10^8 otherwise ends in a raw allocator error while the model is built."""
    counts = dense_parameter_counts(cfg)
    need = 16 * sum(counts.values())
    have = available_memory(device)
    if need > have:
        key = max(counts, key=counts.__getitem__)
        where = "GPU" if device.type == "cuda" else "host"
        raise ConfigError(
            key,
            f"the MLPs and the interaction hold {sum(counts.values()):,} parameters "
            f"({counts[key]:,} sized by {key}): {size_text(need)} with their gradients "
            f"and optimizer state, but {size_text(have)} of {where} memory are available",
        )


def check_batch_memory(cfg: Config, ctx: DistContext) -> None:
    """Fail before the first batch is drawn, naming ``train.batch_size``, when one rank's
    share of a batch cannot fit the memory there is (a typo'd 10^10 would otherwise
    stop the data thread with a raw allocator error, or the kernel kill the process)."""
    local = cfg.train.batch_size // ctx.world_size
    need = local * batch_bytes_per_sample(cfg)
    have = available_memory(torch.device("cpu"))
    if need > have:
        raise ConfigError(
            "train.batch_size",
            f"{cfg.train.batch_size:,} samples ({local:,} a rank) need at least "
            f"{size_text(need)} of host memory for a batch's inputs and activations, but "
            f"{size_text(have)} are available: use a smaller batch",
        )


def check_eval_batch_memory(cfg: Config, world_size: int, split: str | None = None) -> None:
    """:func:`check_batch_memory` for the evaluations' batches (``train.eval_batch_size``,
    forward only, every rank its slice), before the model is built: an eval batch of
    8,192 samples at dim 65,536 asked for 56 GB after training had run, a traceback.
    A synthetic set's batches are drawn beside the samples kept so far: with all of them."""
    rows, kept = cfg.train.eval_batch_size, 0
    if cfg.data.uses_dataset():  # no batch larger than the splits scored
        splits = [split or cfg.data.eval_split]
        if cfg.train.eval_every and split is None:
            splits.append(cfg.data.val_split)
        try:
            rows = min(rows, max(BinaryDataset(cfg.data.path, s).rows for s in splits))
        except (DatasetError, OSError):
            return  # a split that is not there is named where it is opened
    else:
        rows, kept = min(rows, cfg.data.eval_samples), synthetic_eval_set_bytes(cfg)
    local = -(-rows // world_size)
    need = local * batch_bytes_per_sample(cfg, forward_only=True) + kept
    have = available_memory(torch.device("cpu"))
    if need > have:
        held = f" beside the {size_text(kept)} of samples kept" if kept else ""
        raise ConfigError(
            "train.eval_batch_size",
            f"evaluation batches of {rows:,} samples ({local:,} a rank) need at least "
            f"{size_text(need)} of host memory for their inputs and activations{held}, but "
            f"{size_text(have)} are available: use a smaller eval batch",
        )


def reduce_step(
    loss_value: float,
    out_of_time: bool,
    signalled: bool,
    ctx: DistContext,
    checkpoint_due: bool = False,
) -> tuple[float, bool, bool, bool]:
    """Global mean loss, whether any rank wants to stop, whether any rank was asked to
    by a signal (train/stop.py), and whether any rank's clock says a checkpoint is due
    (``checkpoint.every_minutes``: each rank's clock started at its own moment, and a
    save only one rank begins waits for parts no other rank writes) - one all-reduce,
    the same answers on every rank."""
    if not ctx.distributed:
        return loss_value, out_of_time or signalled, signalled, checkpoint_due
    t = torch.tensor(
        [loss_value, float(out_of_time), float(signalled), float(checkpoint_due)],
        dtype=torch.float64,
        device=ctx.device,
    )  # NCCL: on the GPU
    dist.all_reduce(t, group=ctx.dense)
    return float(t[0]) / ctx.world_size, bool(t[1] > 0 or t[2] > 0), bool(t[2] > 0), bool(t[3] > 0)


@torch.no_grad()
def predict(
    module: nn.Module, batches: Iterable[Batch], ctx: DistContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """All predictions and labels of the eval set, on every rank (each scores its slice
    of every batch; the slices are all-gathered)."""
    was_training = module.training
    module.eval()
    try:
        return _predict(module, batches, ctx)
    finally:
        module.train(was_training)


def _predict(module, batches, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    w, r = ctx.world_size, ctx.rank
    logits, labels = [], []
    for b in batches:
        n = -(-b.batch_size // w)  # ceil: the last rank's slice is padded
        lo, hi = min(r * n, b.batch_size), min((r + 1) * n, b.batch_size)
        local = b.slice(lo, hi).pad(n).to(ctx.device) if w > 1 else b.to(ctx.device)
        out = module(local).float()
        if w > 1:
            gathered = [torch.empty_like(out) for _ in range(w)]
            dist.all_gather(gathered, out, group=ctx.dense)
            out = torch.cat(gathered)
        logits.append(out.cpu()[: b.batch_size])
        labels.append(b.labels.cpu())
    return torch.cat(logits), torch.cat(labels)


def score(
    module: nn.Module, batches: Iterable[Batch], ctx: DistContext, precision: str = "fp32"
) -> dict[str, float]:
    """Exact metrics over every batch (every rank scores its slice; see ``predict``)."""
    with autocast(precision, ctx.device):
        return binary_metrics(*predict(module, batches, ctx))


def evaluate(
    model: DLRM, batches: Iterable[Batch], device: torch.device, precision: str = "fp32"
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """Score a model in this process (``recscale eval``), in ``precision`` as the run's
    own evaluations are (``train.precision``): the metrics, and the fp32 logits and the
    labels they came from, one a sample in the batches' order."""
    with autocast(precision, device):
        logits, labels = predict(model, batches, DistContext(device=device))
    return binary_metrics(logits, labels), logits, labels
