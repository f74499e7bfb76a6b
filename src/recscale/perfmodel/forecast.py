"""Forecast a training step on a device this process does not have, from the device's
public figures (``devices.py``): a pure function of (config, device, world size,
precision, system), no torch, no GPU.

Each stage is a list of kernels; a kernel takes the longer of its arithmetic and its
memory traffic, plus a fixed cost (a GPU's launch gap and tail, a CPU op's dispatch).
The step on the slowest rank::

    mlp_gemm           every GEMM of the MLPs (and DCNv2's cross layers): forward, data
                       and weight gradients - by tiles and waves (NeuSight): a unit (SM /
                       core) computes one output tile at a time, a GEMM takes
                       ceil(tiles x split / units) waves of one tile's time at the
                       device's GEMM rate, or its bytes at the memory rate if longer;
                       too few tiles split the reduction (split-K)
    mlp_elementwise    bias / ReLU passes the GEMM epilogue does not fuse, forward and back
    interaction        dot: the batched products and the triangle gather (or one fused
                       kernel each way); dcnv2: the x0 * y + x passes
    embedding_forward  the plan's ids on this rank: rows gathered at the random-access
                       rate (whole sectors / cache lines), ids read, pooled vectors written
    embedding_update   the ids sorted, per-id gradients read, rows and optimizer state
                       read and written back at the random-access rate
    all_to_all         ids in, pooled vectors out and their gradients back (alpha-beta over
                       NVLink / the node's links, the network beyond a node), less what the
                       system overlaps with compute
    all_reduce         the dense gradients (+ replicated tables'), ring, alpha-beta
    dense_optimizer    the MLP parameters' update, streamed
    loss               the logits' loss forward and backward
    host               host time a step the device does not hide (an eager framework's
                       Python and synchronisations; 0 for a captured graph)

The efficiency terms (``Efficiency``) are this model's assumptions for a device kind,
not device figures: the share of peak a full wave of GEMM tiles reaches, the share of
the memory rate a streaming kernel and a random row gather reach, a kernel's fixed
cost, a collective's share of its link. ``System`` says what a framework does that
changes the step (fused epilogues, fused interaction, overlap, bytes of tables and of
what travels, host time); ``RECSCALE`` is this project's own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.modules.interaction import PAD_MULTIPLE
from recscale.perfmodel.devices import DeviceSpec
from recscale.perfmodel.systems import RECSCALE, System
from recscale.planner.costs import ALL_TO_ALL_CALLS, ID_BYTES, CostLaws, placement_work
from recscale.planner.from_config import plan_for, table_infos
from recscale.planner.types import ShardingPlan

STAGES = (
    "mlp_gemm",
    "mlp_elementwise",
    "interaction",
    "embedding_forward",
    "embedding_update",
    "all_to_all",
    "all_reduce",
    "dense_optimizer",
    "loss",
    "host",
)
# bytes a parameter moves in the dense optimizer's step (read w, g, state; write w, state)
OPT_BYTES = {"sgd": 12, "adagrad": 20, "adam": 28}
OPT_STATE_BYTES = {"sgd": 0, "adagrad": 4, "adam": 8}  # kept a parameter
# optimizer state per table row: (bytes per row, bytes per column)
ROW_STATE = {"sgd": (0, 0), "rowwise_adagrad": (4, 0), "adam": (0, 8)}
SORT_PASSES = 4  # radix sort of (id, position) pairs: passes over ids x 12 bytes
MEMORY_SHARE = 0.9  # of a device's memory the forecast lets a plan use (runtime, fragments)


@dataclass(frozen=True)
class Efficiency:
    gemm: float  # share of the peak a full wave of tiles reaches (cuBLAS / oneDNN)
    tile: tuple[int, int]  # the output tile one unit computes at a time
    stream: float  # share of the memory rate a streaming kernel reaches
    granule: int  # bytes the memory serves at least per random access (sector / line)
    gather: float  # share of the streaming rate random rows reach (of the bytes fetched)
    cache_speedup: float  # rows of a table that fits in L2 / last-level cache: x faster
    kernel_s: float  # added to every kernel: GPU launch gap and tail, CPU op dispatch
    link: float  # share of a link a collective reaches (NCCL bus bandwidth / peak)
    latency_s: float  # a collective's fixed cost within a node
    network_latency_s: float


# Sources of the GPU terms: cuBLAS reaches ~0.7-0.8 of the dense tensor-core peak on
# large GEMMs (NVIDIA's published cuBLAS figures; 0.7 taken); HBM streams at ~0.85-0.9
# of its peak (STREAM-like kernels) and random 128-512 byte rows at ~0.6-0.7 of it
# (FBGEMM's TBE benchmarks report that range); a kernel boundary (launch gap + the tail
# of the last wave) costs a few microseconds. CPU terms: oneDNN ~0.65 of the FMA peak,
# STREAM ~0.75 of the DDR peak, random rows ~0.6 of that, ~10 us an eager op's dispatch.
GPU = Efficiency(0.70, (128, 128), 0.85, 32, 0.75, 2.0, 2e-6, 0.80, 15e-6, 30e-6)
CPU = Efficiency(0.65, (64, 64), 0.75, 64, 0.60, 2.0, 10e-6, 0.70, 40e-6, 60e-6)
EFFICIENCY = {"gpu": GPU, "cpu": CPU}


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

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "world_size": self.world_size,
            "precision": self.precision,
            "system": self.system,
            "predicted_stage_ms": self.stage_ms,
            "predicted_step_ms": self.step_ms,
            "predicted_samples_per_s": self.samples_per_s,
            "predicted_memory_bytes_per_device": self.memory_bytes,
            "predicted_table_bytes_per_device": self.table_bytes,
            "kernels_per_step": self.kernels,
            "slowest_rank": self.slowest_rank,
        }


class _Step:
    """Kernels of one rank's step, stage by stage."""

    def __init__(self, dev: DeviceSpec, eff: Efficiency, precision: str) -> None:
        self.dev, self.eff = dev, eff
        self.gemm_precision = "fp32" if dev.kind == "cpu" and precision == "tf32" else precision
        self.act = 2 if precision in ("bf16", "fp16", "fp8") else 4  # activation bytes
        self.bw = dev.memory_gbps * 1e9
        self.stages: dict[str, float] = {s: 0.0 for s in STAGES}
        self.kernels = 0
        self.a2a = self.ar = 0.0  # bytes this rank sends: all-to-all, all-reduce (tables)

    def kernel(self, stage: str, seconds: float) -> None:
        self.stages[stage] += seconds + self.eff.kernel_s
        self.kernels += 1

    def stream(self, stage: str, nbytes: float) -> None:
        self.kernel(stage, nbytes / (self.bw * self.eff.stream))

    def gemm(self, stage: str, m: int, n: int, k: int) -> None:
        """One GEMM C[m, n] = A[m, k] B[k, n] by tiles and waves."""
        e, units = self.eff, self.dev.units
        tm, tn = e.tile
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        split = 1
        if tiles < units:  # split the reduction over idle units, >= 128 deep a part
            split = max(1, min(units // tiles, k // 128))
        waves = math.ceil(tiles * split / units)
        per_unit = self.dev.peak_flops(self.gemm_precision) * e.gemm / units
        compute = waves * 2.0 * tm * tn * math.ceil(k / split) / per_unit
        nbytes = (m * k + k * n) * self.act + m * n * self.act * (1 if split == 1 else 3)
        self.kernel(stage, max(compute, nbytes / (self.bw * e.stream)))

    def batched(self, stage: str, flops: float, nbytes: float) -> None:
        """A batched small-matrix product (the dot interaction): its bytes or its flops
        at half the GEMM rate (small tiles fill a tensor core / vector unit poorly)."""
        rate = self.dev.peak_flops(self.gemm_precision) * self.eff.gemm * 0.5
        self.kernel(stage, max(flops / rate, nbytes / (self.bw * self.eff.stream)))

    def gather(self, stage: str, rows: float, row_bytes: float, cached: float = 0.0) -> None:
        """``rows`` random rows of ``row_bytes`` (``cached`` of them from a table that
        fits in the last-level cache), fetched in whole granules."""
        g = self.eff.granule
        fetched = math.ceil(row_bytes / g) * g
        rate = self.bw * self.eff.stream * self.eff.gather
        t = (rows - cached) * fetched / rate + cached * fetched / (rate * self.eff.cache_speedup)
        self.kernel(stage, t)


def _mlp(
    s: _Step, sysm: System, b: int, k: int, widths: list[int], first_dgrad: bool, relu=True
) -> int:
    """An MLP's kernels (with ``relu``: a ReLU after every layer but a last width-1 one,
    the logit); its parameters."""
    params = 0
    for i, n in enumerate(widths):
        act = relu and not (i == len(widths) - 1 and n == 1)
        s.gemm("mlp_gemm", b, n, k)
        if act and not sysm.fused_epilogue:
            s.stream("mlp_elementwise", 2 * b * n * s.act)  # ReLU: read, write
        if i > 0 or first_dgrad:
            s.gemm("mlp_gemm", b, k, n)  # data gradient
        s.gemm("mlp_gemm", k, n, b)  # weight gradient
        if not sysm.fused_epilogue:
            if act:
                s.stream("mlp_elementwise", 3 * b * n * s.act)  # dReLU: read 2, write 1
            s.stream("mlp_elementwise", b * n * s.act)  # bias gradient: a reduction
        params += k * n + n
        k = n
    return params


def _dense_side(s: _Step, cfg: Config, sysm: System, b: int, dims: list[int]) -> tuple[int, int]:
    """MLPs, interaction, loss of a rank's B samples; (parameters, activation values)."""
    m = cfg.model
    f = len(dims)
    params = 0
    dense = m.bottom_mlp[-1] if m.num_dense_features and m.bottom_mlp else 0
    if m.num_dense_features:
        params += _mlp(s, sysm, b, m.num_dense_features, m.bottom_mlp, False)
    emb = sum(dims)
    acts = sum(m.bottom_mlp) + sum(m.top_mlp)
    if m.interaction == "dot":
        d = dims[0]
        k = f + (1 if dense else 0)
        pairs = k * (k - 1) // 2 + (k if m.interaction_self else 0)
        width = -(-(pairs + (d if dense else 0)) // PAD_MULTIPLE) * PAD_MULTIPLE
        x, z = b * k * d * s.act, b * k * k * s.act
        if sysm.fused_interaction:
            s.batched("interaction", 2.0 * b * k * k * d, x + b * width * s.act)
            s.batched("interaction", 4.0 * b * k * k * d, 2 * x + b * width * s.act)
        else:
            s.stream("interaction", 2 * x)  # stack the features
            s.batched("interaction", 2.0 * b * k * k * d, x + z)
            s.stream("interaction", z + 2 * b * width * s.act)  # triangle gather + concat
            s.stream("interaction", z + b * width * s.act)  # its gradient scattered
            s.batched("interaction", 4.0 * b * k * k * d, 2 * (x + z))  # two bmm's back
            s.stream("interaction", 2 * x)  # split the features' gradients
        acts += k * d + k * k + width
    elif m.interaction == "dcnv2":
        width = emb + dense
        s.stream("interaction", 2 * b * width * s.act)  # the concatenation
        for _ in range(m.dcn_layers):
            # a cross layer's two low-rank products, no activation between them
            params += _mlp(s, sysm, b, width, [m.dcn_rank], True, relu=False)
            params += _mlp(s, sysm, b, m.dcn_rank, [width], True, relu=False)
            passes = 4 if sysm.fused_epilogue else 12  # x0 * y + x and its gradients
            s.stream("interaction", passes * b * width * s.act)
            acts += 2 * width + m.dcn_rank
        acts += width
    else:
        width = emb + dense
        s.stream("interaction", 4 * b * width * s.act)
        acts += width
    params += _mlp(s, sysm, b, width, m.top_mlp, True)
    for _ in range(3):  # sigmoid BCE forward, backward, mean
        s.stream("loss", 4 * b * 4)
    return params, acts


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
    dense = _Step(dev, eff, precision)
    params, acts = _dense_side(dense, cfg, system, b, dims)
    opt = cfg.optimizer.name
    dense.stream("dense_optimizer", params * OPT_BYTES[opt])
    # fp32 weights and gradients, the optimizer's state, bf16/fp16 copies of the weights
    dense_state = params * (8 + OPT_STATE_BYTES[opt] + (2 if dense.act == 2 else 0))
    act_bytes = b * (2 * acts * dense.act + 2 * sum(dims) * 4)
    if plan is None:
        budget = int(dev.memory_gb * 1e9 * MEMORY_SHARE) - dense_state - act_bytes
        laws = device_laws(dev, w, system, dense.act)
        plan = plan_for(cfg, w, max(budget, 0), laws=laws)

    best = None
    for r, emb in enumerate(_embedding_ranks(cfg, dev, eff, system, plan, tables, precision)):
        _collectives(emb, dev, eff, system, w, params)
        total = sum(emb.stages.values())
        if best is None or total > best[0]:
            best = (total, r, emb)
    _, slowest, emb = best
    stages = {k: dense.stages[k] + emb.stages[k] for k in STAGES}
    if dev.kind == "gpu":
        stages["host"] = system.host_ms * 1e-3
    step = sum(stages.values())
    table_mem = max(plan.memory_per_rank) if any(plan.memory_per_rank) else 0
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
        dense.kernels + emb.kernels,
        slowest,
        plan,
    )


def _check_world(cfg: Config, dev: DeviceSpec, w: int) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ConfigError("--world-size", f"a whole number >= 1, got {w!r}")
    if cfg.train.batch_size < w:
        raise ConfigError(
            "train.batch_size",
            f"{cfg.train.batch_size} samples cannot be split over {w} {dev.name} devices",
        )
    return w


def _embedding_ranks(cfg, dev, eff, system, plan, tables, precision):
    """Each rank's embedding kernels under ``plan``."""
    by_name = {t.name: t for t in tables}
    w, batch = plan.world_size, cfg.train.batch_size
    state_row, state_col = ROW_STATE[cfg.embedding.optimizer]
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
        s = _Step(dev, eff, precision)
        s.a2a, s.ar = acc["a2a"], acc["ar"]
        ids = acc["ids"]
        if ids:
            col = acc["values"] / ids  # mean columns a lookup reads on this rank
            row = col * system.table_bytes
            cached_ids = acc["cached"] / col
            s.stream("embedding_forward", ids * ID_BYTES)
            s.gather("embedding_forward", ids, row, cached_ids)
            s.stream("embedding_forward", acc["out"] * 4)
            s.stream("embedding_update", ids * 12 * SORT_PASSES)  # sort (id, position)
            s.stream("embedding_update", acc["values"] * 4)  # each id's bag gradient
            state = state_row + col * state_col
            s.gather("embedding_update", 2 * ids, row + state, 2 * cached_ids)  # read, write
        out.append(s)
    return out


def _link(dev: DeviceSpec, eff: Efficiency, w: int) -> tuple[float, float]:
    """(bytes/s, latency) of a collective over ``w`` devices: the node's links within
    a node, the network (each device's own share of it) beyond one."""
    if w <= dev.devices_per_node:
        return dev.intra_node_gbps * 1e9 * eff.link, eff.latency_s
    return min(dev.intra_node_gbps, dev.network_gbps) * 1e9 * eff.link, eff.network_latency_s


def _collectives(s: _Step, dev, eff, system, w: int, params: int) -> None:
    if w == 1:
        return
    bw, lat = _link(dev, eff, w)
    wire = system.wire_bytes or s.act
    a2a = s.a2a * wire / 4
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
