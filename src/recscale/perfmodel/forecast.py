"""Forecast a training step on a device this process does not have, from the device's
public figures (``devices.py``): a pure function of (config, device, world size,
precision, system), no torch, no GPU.

Each stage is a list of kernels (``step_kernels.py``); a kernel takes the longer of its
arithmetic and its memory traffic, plus a fixed cost (a GPU's launch gap and tail, a
CPU op's dispatch). Each rank's kernels under the plan; the step is the slowest rank's
compute, then each collective at its slowest member's time, then the host time the
device does not hide::

    mlp_gemm           every GEMM of the MLPs (and DCNv2's cross layers): forward, data
                       and weight gradients - by tiles and waves (NeuSight): a unit (SM /
                       core) computes one output tile at a time, a GEMM takes
                       ceil(tiles x split / units) waves of one tile's time at the
                       device's GEMM rate (or its operands' bytes at the memory rate if
                       longer), then stores its output; too few tiles split the
                       reduction (split-K)
    mlp_elementwise    bias / ReLU passes the GEMM epilogue does not fuse, forward and back
    interaction        dot: the batched products and the triangle gather (or one fused
                       kernel each way); dcnv2: the x0 * y + x passes
    embedding_forward  the plan's ids on this rank: rows gathered at the random-access
                       rate (whole sectors / cache lines), ids read, pooled vectors written
    embedding_update   fused: the ids sorted, per-id gradients read, rows and optimizer
                       state read and written back at the random-access rate; sparse_add:
                       an fp32 sparse gradient written, then added into the rows
    all_to_all         ids in, pooled vectors out and their gradients back (alpha-beta over
                       NVLink / the node's links, the network beyond a node), less what the
                       system overlaps with compute; a system sharding rows by id modulo
                       the ranks: partial rows forward, each id's gradient back (exchange.py)
    all_reduce         the dense gradients (+ replicated tables'), ring, alpha-beta
    dense_optimizer    the MLP parameters' update, streamed
    loss               the logits' loss forward and backward
    host               input work on the training thread (``System.input_*``), and host
                       time a step the device does not hide: the system's framework
                       ops a kernel x EAGER_OP_S, all of it when the step waits on the
                       device mid-step, what exceeds the device time when it does not,
                       none for a captured graph (``systems.py``)

The efficiency terms (``Efficiency``) are this model's assumptions for a device kind,
not device figures: the share of peak a full wave of GEMM tiles reaches, the share of
the memory rate a streaming kernel and a random row gather reach, a kernel's fixed
cost, a collective's share of its link. ``System`` says what a framework does that
changes the step (epilogues, interaction, the tables' update, overlap, bytes of tables
and of what travels, host ops and waits); ``RECSCALE`` is this project's own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.perfmodel.devices import DeviceSpec
from recscale.perfmodel.exchange import partials_exchange_bytes
from recscale.perfmodel.step_kernels import (
    COLLECTIVES,
    CPU,
    EFFICIENCY,
    GPU,
    STAGES,
    Efficiency,
    StepKernels,
    bottom_mlp,
    dense_side,
)
from recscale.perfmodel.systems import BENCH_STAGES, RECSCALE, System
from recscale.planner.costs import ALL_TO_ALL_CALLS, ID_BYTES, CostLaws, placement_work
from recscale.planner.from_config import plan_for, table_infos
from recscale.planner.plan import PlanError
from recscale.planner.types import ShardingPlan, TableInfo, TablePlacement

__all__ = [
    "BENCH_STAGES",
    "CPU",
    "EFFICIENCY",
    "GPU",
    "STAGES",
    "Forecast",
    "StepKernels",
    "device_laws",
    "forecast",
]

# bytes a parameter moves in the dense optimizer's step (read w, g, state; write w, state)
OPT_BYTES = {"sgd": 12, "adagrad": 20, "adam": 28}
# torch's Adagrad on a GPU (``_multi_tensor_adagrad``; no fused CUDA kernel): five foreach
# passes - the state's addcmul_ (read sum and g, write sum: 12 bytes), sqrt (8), + eps
# (8), g x -lr (8), and addcdiv_ into the weights (read w, the quotient's two operands,
# write w: 16)
FOREACH_ADAGRAD_BYTES = 12 + 8 + 8 + 8 + 16
OPT_STATE_BYTES = {"sgd": 0, "adagrad": 4, "adam": 8}  # kept a parameter
# optimizer state per table row: (bytes per row, bytes per column)
ROW_STATE = {"sgd": (0, 0), "rowwise_adagrad": (4, 0), "adam": (0, 8)}
SORT_PASSES = 4  # radix sort of (id, position) pairs: passes over ids x 12 bytes
MEMORY_SHARE = 0.9  # of a device's memory the forecast lets a plan use (runtime, fragments)
# Host time of one framework op of an eager PyTorch step on a GPU server's host (Python,
# autograd, dispatch, launch), learned from recscale's own run: config A at batch
# 16,384, TF32, on an H100 SXM (docs/gpu.md, 2026-11-24) took 4.98 ms a step for 197
# ops (benchmarks/count_host_ops.py), its device work (0.93 ms forecast for the code of
# that day, ``System.gram="autograd"``) hidden behind the host's in both parts of the
# step (``RECSCALE.wait_before``): 25.3 us an op. Config B on the same GPU is held out.
EAGER_OP_S = 25.3e-6
# a mid-step wait (System.wait_before) and the stages from it to the step's end, in the
# step's order: the tables' update, then the dense optimizer
WAIT_ORDER = ("embedding_update", "dense_optimizer")
AFTER_WAIT = {"embedding_update": WAIT_ORDER, "dense_optimizer": WAIT_ORDER[1:]}
BENCH_WAIT = {"embedding_update": "sparse", "dense_optimizer": "dense_opt"}


@dataclass
class Forecast:
    device: str
    world_size: int
    precision: str
    system: str
    stage_ms: dict[str, float]
    step_ms: float
    samples_per_s: float
    memory_bytes: int  # the largest rank: tables + dense state + activations
    table_bytes: int
    kernels: int  # kernels a step launches on the slowest rank
    slowest_rank: int
    plan: ShardingPlan | None = field(default=None, repr=False)
    host_ops: int = 0  # framework ops the host dispatches a step (GPU, eager systems)
    host_mode: str = ""  # how they meet the device's time (System.host)
    # what `recscale bench throughput` times on the device's stream, stage by stage
    # (BENCH_STAGES): device and host time through the step's waits (_bench_timeline)
    bench_stage_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "world_size": self.world_size,
            "precision": self.precision,
            "system": self.system,
            "predicted_stage_ms": self.stage_ms,
            "predicted_bench_stage_ms": self.bench_stage_ms,
            "predicted_step_ms": self.step_ms,
            "predicted_samples_per_s": self.samples_per_s,
            "predicted_memory_bytes_per_device": self.memory_bytes,
            "predicted_table_bytes_per_device": self.table_bytes,
            "kernels_per_step": self.kernels,
            "host_ops_per_step": self.host_ops,
            "slowest_rank": self.slowest_rank,
        }


def forecast(
    cfg: Config,
    dev: DeviceSpec,
    world_size: int = 1,
    precision: str | None = None,
    system: System | None = None,
    plan: ShardingPlan | None = None,
) -> Forecast:
    """The step of ``cfg`` on ``world_size`` devices ``dev`` at ``precision`` (default:
    the config's; ``tf32`` is fp32 on a CPU) as ``system`` runs it, under ``plan``
    (default: the planner's for this device, costed by this forecast)."""
    precision = precision or cfg.train.precision
    system = system or RECSCALE
    dev.peak_flops("fp32" if dev.kind == "cpu" and precision == "tf32" else precision)
    w = _check_world(cfg, dev, world_size)
    eff = EFFICIENCY[dev.kind]
    b = cfg.train.batch_size // w
    tables = table_infos(cfg)
    dims = [t.dim for t in tables]
    dense = StepKernels(dev, eff, precision)
    hybrid = system.bottom_on_one_rank and w > 1
    params, acts = dense_side(dense, cfg, system, b, dims, bottom=not hybrid)
    shared = params  # data parallel: all-reduced
    bottom = StepKernels(dev, eff, precision)  # hybrid: rank 0's bottom MLP, the global batch
    opt = cfg.optimizer.name
    opt_bytes = OPT_BYTES[opt]
    if dev.kind != "cpu" and system.dense_optimizer == "torch" and opt == "adagrad":
        # their bytes in one streamed kernel: the host prices torch.optim's step as one
        # (System.host_stage_weights learned it so), and the four more launches are ~us
        opt_bytes = FOREACH_ADAGRAD_BYTES
    if hybrid and cfg.model.num_dense_features:
        params += bottom_mlp(bottom, cfg, system, cfg.train.batch_size)
        bottom.a2a = 2 * cfg.train.batch_size * cfg.model.bottom_mlp[-1] * 4 * (w - 1) / w
        bottom.stream("dense_optimizer", (params - shared) * opt_bytes)
    dense.stream("dense_optimizer", shared * opt_bytes)
    # fp32 weights and gradients, the optimizer's state, bf16/fp16 copies of the weights
    dense_state = params * (8 + OPT_STATE_BYTES[opt] + (2 if dense.act == 2 else 0))
    act_bytes = b * (2 * acts * dense.act + 2 * sum(dims) * 4)
    if plan is None and (hybrid or system.exchange == "partials"):
        plan = hybrid_plan(tables, w) if hybrid else modulo_plan(tables, w, system, cfg)
        room = dev.memory_gb * 1e9 * MEMORY_SHARE - dense_state - act_bytes
        if max(plan.memory_per_rank) > room:
            r = max(range(w), key=plan.memory_per_rank.__getitem__)
            raise PlanError(
                f"{system.name} puts {plan.memory_per_rank[r] / 1e9:.2f} GB of tables on "
                f"rank {r} but a {dev.name} has {max(room, 0) / 1e9:.2f} GB for them: "
                f"{(plan.memory_per_rank[r] - room) / 1e9:.2f} GB missing"
            )
    elif plan is None:
        budget = int(dev.memory_gb * 1e9 * MEMORY_SHARE) - dense_state - act_bytes
        if budget <= 0:
            raise PlanError(
                f"the dense model's state ({dense_state / 1e9:,.2f} GB) and a batch's "
                f"activations ({act_bytes / 1e9:,.2f} GB) alone exceed the "
                f"{dev.memory_gb * MEMORY_SHARE:g} GB a {dev.name} gives them: fewer or "
                "narrower layers, or a smaller batch"
            )
        laws = device_laws(dev, w, system, dense.act)
        plan = plan_for(cfg, w, budget, laws=laws)

    ranks = list(_embedding_ranks(cfg, dev, eff, system, plan, tables, precision))
    if hybrid:
        ranks[0].absorb(bottom)
    if system.exchange == "partials":
        _partials(ranks, cfg, tables, system, w)
    for emb in ranks:
        _collectives(emb, dev, eff, system, w, shared)
    # A collective ends when its slowest member's part does: the step is the slowest
    # rank's compute, then each collective at its slowest rank's time.
    compute = [sum(v for k, v in e.stages.items() if k not in COLLECTIVES) for e in ranks]
    slowest = max(range(len(ranks)), key=compute.__getitem__)
    emb = ranks[slowest]
    stages = {k: dense.stages[k] + emb.stages[k] for k in STAGES}
    for k in COLLECTIVES:
        stages[k] = max(e.stages[k] for e in ranks)
    kernels = dense.kernels + emb.kernels
    host_ops = 0
    if dev.kind == "gpu" and system.host != "graph":
        stages["host"] = _exposed_host(dense, emb, stages, system, precision)
        host_ops = round(kernels * system.host_ops_per_kernel)
    stages["host"] += _input(cfg, dev, system, tables)
    step = sum(stages.values())
    table_mem = max(plan.memory_per_rank) if any(plan.memory_per_rank) else 0
    bench = _bench_timeline(dense, emb, stages, system, precision, dev.kind == "gpu")
    return Forecast(
        dev.name,
        w,
        precision,
        system.name,
        {k: v * 1e3 for k, v in stages.items()},
        step * 1e3,
        cfg.train.batch_size / step,
        int(table_mem + dense_state + act_bytes),
        int(table_mem),
        kernels,
        slowest,
        plan,
        host_ops,
        system.host if host_ops else "",
        {k: v * 1e3 for k, v in bench.items()},
    )


def _exposed_host(
    dense: StepKernels, emb: StepKernels, stages: dict, system: System, precision: str
) -> float:
    """Host time the device does not hide: all of it when the step waits on the device
    throughout (``serial``); else, in each part of the step between its waits, what the
    host takes beyond the device - the whole step with one wait a step, two parts split
    where the system reads back mid-step (``System.wait_before``; GradScaler's
    found_inf under fp16 before the optimizer's step)."""
    op = EAGER_OP_S if system.host_op_s is None else system.host_op_s
    op_s = system.host_ops_per_kernel * op
    kernels = {k: dense.stage_kernels[k] + emb.stage_kernels[k] for k in STAGES}
    host = (dense.kernels + emb.kernels) * op_s
    device = sum(stages.values())
    if system.host == "serial":
        return host
    waits = _mid_step_waits(system, precision)
    if not waits:
        return max(0.0, host - device)
    after = AFTER_WAIT[min(waits, key=WAIT_ORDER.index)]
    host_after = sum(kernels[k] for k in after) * op_s
    device_after = sum(stages[k] for k in after)
    return max(0.0, host - host_after - (device - device_after)) + max(
        0.0, host_after - device_after
    )


def _mid_step_waits(system: System, precision: str) -> list[str]:
    """The stages (of WAIT_ORDER) at whose start the step waits on the device: the
    system's read-back (``wait_before``), and under fp16 GradScaler's found_inf before
    the step's update of a sparse gradient or else the optimizer's."""
    waits = [system.wait_before] if system.wait_before else []
    if system.scaler_waits and precision == "fp16":
        waits.append(
            "embedding_update" if system.embedding_update == "sparse_add" else "dense_optimizer"
        )
    return waits


def _bench_timeline(
    dense: StepKernels, emb: StepKernels, stages: dict, system: System, precision: str, gpu: bool
) -> dict[str, float]:
    """The stage times ``recscale bench throughput`` reads from events on the device's
    stream (lookup, forward, backward, sparse, dense_opt), seconds.

    Each stage's device time is its kernels' (the all-to-all half in the lookup, half in
    the backward with the all-reduce); on a GPU an eager system's host issues a stage's
    kernels at its own pace - a kernel of stage ``s`` costs the host ``weight_s x``
    ``host_ops_per_kernel x`` the op time (``System.host_stage_weights``) - and the
    device reaches a stage's end event when both have done their part::

        e_s = max(e_{s-1} + device_s, host time when the host records it)

    At a wait (the step's start; ``System.wait_before``; GradScaler's under fp16) the
    host first waits for the device. A stage that reads values back after its first
    kernel (``System.serial_stages``: recscale's update, after the sort of its ids) has
    the host wait for that kernel before it launches the stage's last kernel; the
    device runs the rest while the host goes on. ``serial``: host and device time add;
    ``graph`` (or a CPU, whose host is the device): the device's times alone. Where the
    host binds (recscale's A and B on an H200) each stage is its host time; where the
    device does, its kernels'."""
    device = {k: dense.bench[k] + emb.bench[k] for k in BENCH_STAGES}
    device["lookup"] += stages["all_to_all"] / 2
    device["backward"] += stages["all_to_all"] / 2 + stages["all_reduce"]
    if not gpu or system.host == "graph" or not system.host_ops_per_kernel:
        return device
    op = EAGER_OP_S if system.host_op_s is None else system.host_op_s
    weights = dict(zip(BENCH_STAGES, system.host_stage_weights or (1.0,) * len(BENCH_STAGES)))
    kernels = {k: dense.bench_kernels[k] + emb.bench_kernels[k] for k in BENCH_STAGES}
    host = {k: kernels[k] * weights[k] * system.host_ops_per_kernel * op for k in BENCH_STAGES}
    waits = {BENCH_WAIT[k] for k in _mid_step_waits(system, precision)}
    out: dict[str, float] = {}
    h = e = 0.0  # the host's clock and the device's last stage event
    for k in BENCH_STAGES:
        if system.host == "serial":
            out[k] = device[k] + host[k]
            continue
        if k in waits:
            h = max(h, e)
        if k in system.serial_stages and kernels[k]:
            first = dense.bench_first[k] or emb.bench_first[k]
            last_launch = host[k] / kernels[k]
            read_back = max(h, e) + host[k] - last_launch + first
            h = read_back + last_launch
            end = max(h, read_back + device[k] - first)
        else:
            h += host[k]
            end = max(e + device[k], h)
        out[k], e = end - e, end
    return out


def hybrid_plan(tables: list[TableInfo], w: int) -> ShardingPlan:
    """DLE's device mapping: every table whole on one rank, the largest first into the
    bucket with the fewest bytes, at most ceil(tables / buckets) a bucket; beyond 4
    ranks rank 0 (the bottom MLP's) holds none."""
    first = 1 if w > 4 else 0
    n = w - first
    cap = -(-len(tables) // n)
    buckets: list[list[TableInfo]] = [[] for _ in range(n)]
    for t in sorted(tables, key=lambda t: -t.bytes):
        open_ = [i for i in range(n) if len(buckets[i]) < cap]
        i = min(open_, key=lambda i: (sum(x.bytes for x in buckets[i]), i))
        buckets[i].append(t)
    rank = {t.name: first + i for i, bucket in enumerate(buckets) for t in bucket}
    placements = [
        TablePlacement(t.name, "table_wise", [rank[t.name]], {rank[t.name]: t.bytes}, {})
        for t in tables
    ]
    memory = [sum(t.bytes for t in tables if rank[t.name] == r) for r in range(w)]
    return ShardingPlan(w, placements, memory, [0.0] * w)


def modulo_plan(tables: list[TableInfo], w: int, system: System, cfg: Config) -> ShardingPlan:
    """Every table's rows over all ``w`` ranks (``System.exchange = "partials"``: by id
    modulo the world - each rank a 1/w share of every table's rows and of its ids), each
    row and its optimizer state in the system's bytes."""
    state_row, state_col = _row_state(cfg, system)

    def share(t: TableInfo) -> int:
        return t.rows * (t.dim * (system.table_bytes + state_col) + state_row) // w

    ranks = list(range(w))
    placements = [
        TablePlacement(t.name, "row_wise", ranks, dict.fromkeys(ranks, share(t)), {})
        for t in tables
    ]
    return ShardingPlan(w, placements, [sum(map(share, tables))] * w, [0.0] * w)


def _check_world(cfg: Config, dev: DeviceSpec, w: int) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ConfigError("--world-size", f"a whole number >= 1, got {w!r}")
    if cfg.train.batch_size < w:
        raise ConfigError(
            "train.batch_size",
            f"{cfg.train.batch_size} samples cannot be split over {w} {dev.name} devices",
        )
    return w


def _row_state(cfg: Config, system: System) -> tuple[int, int]:
    """Optimizer state a table row keeps: (bytes a row, bytes a column) - the system's
    own where it keeps one (``System.table_state_bytes``), else the config's optimizer's."""
    if system.table_state_bytes is not None:
        return 0, system.table_state_bytes
    return ROW_STATE[cfg.embedding.optimizer]


def _embedding_ranks(cfg, dev, eff, system, plan, tables, precision):
    """Each rank's embedding kernels under ``plan``."""
    by_name = {t.name: t for t in tables}
    w, batch = plan.world_size, cfg.train.batch_size
    state_row, state_col = _row_state(cfg, system)
    llc = dev.l2_mb * 1e6 / 2  # a table within half the last-level cache stays there
    keys = ("ids", "values", "cached", "out", "a2a", "ar")
    per_rank = [dict.fromkeys(keys, 0.0) for _ in range(w)]
    for pl in plan.placements:
        t = by_name[pl.table]
        for i, r in enumerate(pl.ranks):
            width = pl.dims[i] if pl.dims else None
            work = placement_work(t, pl.kind, w, batch, width)
            acc = per_rank[r]
            acc["ids"] += work.ids
            acc["values"] += work.values
            if t.bytes / max(len(pl.ranks), 1) <= llc:  # ids x columns served from cache
                acc["cached"] += work.values
            acc["out"] += work.values / max(t.pooling, 1e-9)
            acc["a2a"] += work.all_to_all_bytes
            acc["ar"] += work.all_reduce_bytes
    out = []
    for acc in per_rank:
        s = StepKernels(dev, eff, precision)
        s.a2a, s.ar = acc["a2a"], acc["ar"]
        ids = acc["ids"]
        if ids:
            col = acc["values"] / ids  # mean columns a lookup reads on this rank
            row = col * system.table_bytes
            cached_ids = acc["cached"] / col
            s.stream("embedding_forward", ids * ID_BYTES)
            s.gather("embedding_forward", ids, row, cached_ids)
            pooled = s.act if system.pooled_in_act else 4
            s.stream("embedding_forward", acc["out"] * pooled)
            if system.embedding_update == "sparse_add":
                # the pooled gradient copied into an fp32 sparse gradient (one row a id)
                s.stream("embedding_update", acc["out"] * pooled + acc["values"] * 4)
                s.stream("embedding_update", ids * 2 * ID_BYTES)  # its indices
                if s.act == 2:  # GradScaler unscales the values in place
                    s.stream("embedding_update", acc["values"] * 8)
                s.stream("embedding_update", acc["values"] * 4)  # index_add_ reads them
                s.gather("embedding_update", 2 * ids, row, 2 * cached_ids)  # rows += values
            else:
                s.stream("embedding_update", ids * 12 * SORT_PASSES)  # sort (id, position)
                s.stream("embedding_update", acc["values"] * 4)  # each id's bag gradient
                state = state_row + col * state_col
                s.gather("embedding_update", 2 * ids, row + state, 2 * cached_ids)
        out.append(s)
    return out


def _link(dev: DeviceSpec, eff: Efficiency, w: int) -> tuple[float, float]:
    """(bytes/s, latency) of a collective over ``w`` devices: the node's links within
    a node, the network (each device's own share of it) beyond one."""
    if w <= dev.devices_per_node:
        return dev.intra_node_gbps * 1e9 * eff.link, eff.latency_s
    return min(dev.intra_node_gbps, dev.network_gbps) * 1e9 * eff.link, eff.network_latency_s


def _partials(ranks: list[StepKernels], cfg: Config, tables, system: System, w: int) -> None:
    """``System.exchange = "partials"``: every rank reads the global batch's ids, and its
    all-to-all carries partial rows forward and each id's gradient back
    (perfmodel/exchange.py) in place of the plan's pooled vectors."""
    batch = cfg.train.batch_size
    pooling = [t.pooling for t in tables]
    wire = system.wire_bytes or ranks[0].act
    sent = sum(partials_exchange_bytes(batch, pooling, [t.dim for t in tables], w, wire))
    for s in ranks:
        s.stream("embedding_forward", batch * sum(pooling) * ID_BYTES)
        s.a2a_bytes = sent


def _input(cfg: Config, dev: DeviceSpec, system: System, tables) -> float:
    """Seconds a step waits for its input on the training thread (``System.input_*``):
    the global batch's one-hot ids on one core, its multi-hot ids over the device's."""
    batch = cfg.train.batch_size
    serial = system.input_serial_s_per_id * batch * len(tables)
    spread = system.input_parallel_s_per_id * batch * sum(t.pooling for t in tables)
    return serial + spread / dev.units


def _collectives(s: StepKernels, dev, eff, system, w: int, params: int) -> None:
    if w == 1:
        return
    bw, lat = _link(dev, eff, w)
    wire = system.wire_bytes or s.act
    a2a = s.a2a * wire / 4 if s.a2a_bytes is None else s.a2a_bytes
    t = a2a / bw + ALL_TO_ALL_CALLS * lat
    s.stages["all_to_all"] += t * (1.0 - system.comm_overlap)
    ring = 2.0 * (w - 1) / w * (params * wire + s.ar)
    s.stages["all_reduce"] += ring / bw + lat * (1 + math.log2(w))


def device_laws(
    dev: DeviceSpec, world_size: int, system: System | None = None, act_bytes: int = 4
) -> CostLaws:
    """The planner's per-unit costs on ``world_size`` devices ``dev`` - the same terms
    the forecast charges, so the plan it makes is the one it forecasts fastest."""
    system = system or RECSCALE
    eff = EFFICIENCY[dev.kind]
    wire = system.wire_bytes or act_bytes
    rate = dev.memory_gbps * 1e9 * eff.stream
    gather = rate * eff.gather
    bw, lat = _link(dev, eff, world_size)
    return CostLaws(
        per_value=3 * system.table_bytes / gather + 4 / rate,
        per_id=(ID_BYTES + 12 * SORT_PASSES) / rate,
        all_to_all_per_byte=wire / 4 / bw,
        all_reduce_per_byte=1 / bw,
        embedding_per_call=8 * eff.kernel_s,
        all_to_all_per_call=lat,
        all_reduce_per_call=lat,
        source=f"forecast for {dev.name}",
    )
