"""The performance model: a training step's time, stage by stage, from a config and a
calibration (``calibrate.py``) - a pure function, no model is built or run.

For each rank of ``world_size`` (batch B = global batch / W; CPU, fp32), the step of
the slowest rank (the collectives make every rank wait for it)::

    lookup       law(ids, ids x width) over the rows this rank's shards serve under
                 the plan (the planner's, by default; ``planner/costs.py`` counts them)
    bottom MLP   sum over layers of mlp_forward(M=B, K, N)
    interaction  dot: the calibrated dot law (forward + backward, counted in forward);
                 cat: the element-wise law (the concatenation); dcnv2: two GEMMs a
                 cross layer as MLP layers + the element-wise law per layer
    top MLP      sum over layers of mlp_forward(M=B, K, N)
    backward     sum over MLP layers of mlp_backward (the first bottom layer: wgrad only)
    sparse       update law (fused backward + optimizer), the same counts
    all_to_all   W > 1: law(bytes) over the ids in and the pooled vectors out and back,
                 + the per-call latency x 5 collectives
    all_reduce   W > 1: law(ring bytes) of the dense gradients (+ replicated tables')
    dense_opt    dense optimizer law over the MLP parameters
    overhead     the calibrated per-step constant (every stage above is first scaled by
                 the calibrated ``step_scale``)

The ids per sample of a table are the data's (``planner.from_config.ids_per_sample``):
a dataset's bag sizes (one for a one-hot dataset); synthetic data's ``data.bag_sizes``
when set, else the mean pooling factor ((min + max ids per feature) / 2). Memory per
rank: the plan's table bytes + the dense parameters with their gradients and Adam state
+ the activations kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recscale.config.errors import ConfigError
from recscale.config.schema import Config
from recscale.embedding.sizing import row_bytes
from recscale.modules.interaction_padding import PAD_MULTIPLE
from recscale.perfmodel.calibration import Calibration, Law, find_calibration, mlp_features
from recscale.planner.costs import (
    ALL_REDUCE_CALLS,
    ALL_TO_ALL_CALLS,
    VALUE_BYTES,
    CostLaws,
    rank_work,
    ring_bytes,
)
from recscale.planner.from_config import plan_for, table_infos
from recscale.planner.layout import build_layout, table_bytes_per_rank
from recscale.planner.types import ShardingPlan, Topology

# No measured collective (a calibration of one process): 100 Gb/s, 20 us a call.
DEFAULT_TOPOLOGY = Topology(1, 0)
DEFAULT_LATENCY = DEFAULT_TOPOLOGY.latency


@dataclass
class Prediction:
    step_seconds: float
    samples_per_s: float
    stages_ms: dict[str, float] = field(default_factory=dict)
    embedding_bytes: int = 0  # tables + optimizer state on the slowest rank
    memory_bytes: int = 0  # the largest rank: tables + dense state + activations
    slowest_rank: int = 0


def _coef(law: Law, feature: str) -> float:
    return law.coef[law.features.index(feature)] if feature in law.features else 0.0


def planner_laws(cal: Calibration) -> CostLaws:
    """The planner's per-unit costs from a calibration: the lookup and update laws per
    id x column and per id, the collectives' per byte (the topology's defaults where the
    calibration measured none) - the same numbers ``predict`` uses."""
    lk, up, s = cal.laws["lookup"], cal.laws["update"], cal.step_scale
    a2a, ar = cal.laws.get("all_to_all"), cal.laws.get("all_reduce")
    dflt = CostLaws.from_topology(DEFAULT_TOPOLOGY)
    return CostLaws(
        per_value=s * (_coef(lk, "ids_d") + _coef(up, "ids_d")),
        per_id=s * (_coef(lk, "ids") + _coef(up, "ids")),
        all_to_all_per_byte=_coef(a2a, "bytes") if a2a else dflt.all_to_all_per_byte,
        all_reduce_per_byte=_coef(ar, "bytes") if ar else dflt.all_reduce_per_byte,
        embedding_per_call=s * (_coef(lk, "one") + _coef(up, "one")),
        all_to_all_per_call=_coef(a2a, "one") if a2a else DEFAULT_LATENCY,
        all_reduce_per_call=_coef(ar, "one") if ar else DEFAULT_LATENCY,
        source=cal.machine,
    )


def calibrated_laws(cfg: Config) -> CostLaws | None:
    """The planner's costs from ``distributed.calibration`` (None: the defaults)."""
    try:
        cal = find_calibration(cfg.distributed.calibration)
    except ConfigError:  # the file is not one to read (a FIFO, a device...): it says so
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("distributed.calibration", str(e)) from e
    return planner_laws(cal) if cal is not None else None


def default_plan(cfg: Config, cal: Calibration, world_size: int) -> ShardingPlan:
    """The plan a job of ``cfg`` makes on ``world_size`` ranks of ample memory (a plan
    file or one sharding kind when the config names them; else the planner's, costed by
    this calibration's laws)."""
    return plan_for(cfg, world_size, 1 << 62, laws=planner_laws(cal))


def _mlp(cal: Calibration, m: int, widths: list[int], k: int, first_needs_dgrad: bool):
    fwd = bwd = 0.0
    params = 0
    for i, n in enumerate(widths):
        x = mlp_features(m, k, n)
        fwd += cal.laws["mlp_forward"](**x)
        b = cal.laws["mlp_backward"](**x)
        if i == 0 and not first_needs_dgrad:  # no input gradient: one GEMM of two
            b *= 0.5
        bwd += b
        params += k * n + n
        k = n
    return fwd, bwd, params, k


def predict(
    cfg: Config, cal: Calibration, world_size: int = 1, plan: ShardingPlan | None = None
) -> Prediction:
    """The step time of ``cfg`` on ``world_size`` ranks under ``plan`` (default: the
    planner's, costed by ``cal``)."""
    m = cfg.model
    w = world_size
    b = max(1, cfg.train.batch_size // w)
    f = len(m.table_sizes)
    dims = m.dims()
    d = dims[0]
    st: dict[str, float] = {}
    dense_dim = 0
    bwd = 0.0
    params = 0
    if m.num_dense_features:
        fw, bw, p, dense_dim = _mlp(cal, b, m.bottom_mlp, m.num_dense_features, False)
        st["bottom_mlp"], bwd, params = fw, bw, p
    else:
        st["bottom_mlp"] = 0.0
    emb_out = sum(dims)
    if m.interaction == "dot":
        k = f + (1 if dense_dim else 0)
        pairs = k * (k - 1) // 2 + (k if m.interaction_self else 0)
        width = pairs + (d if dense_dim else 0)
        inter_out = -(-width // PAD_MULTIPLE) * PAD_MULTIPLE
        st["interaction"] = cal.laws["interaction"](
            bkkd=float(b * k * k * d), bkk=float(b * k * k), one=1.0
        )
    elif m.interaction == "dcnv2":
        width = emb_out + dense_dim
        ew = cal.laws["elementwise"] if "elementwise" in cal.laws else None
        # the concatenation, then per layer x0 * y + x (as element-wise passes)
        fw = ew(bw=float(b * width), one=1.0) * (1 + m.dcn_layers) if ew else 0.0
        bw_ = 0.0
        for _ in range(m.dcn_layers):
            a = _mlp(cal, b, [m.dcn_rank], width, True)
            c = _mlp(cal, b, [width], m.dcn_rank, True)
            fw += a[0] + c[0]
            bw_ += a[1] + c[1]
            params += a[2] + c[2]
        st["interaction"], bwd = fw, bwd + bw_
        inter_out = width
    else:
        inter_out = emb_out + dense_dim
        ew = cal.laws.get("elementwise")
        st["interaction"] = ew(bw=float(b * inter_out), one=1.0) if ew else 0.0
    activations = sum(m.bottom_mlp) + sum(m.top_mlp) + inter_out
    if m.interaction == "dcnv2":
        activations += m.dcn_layers * (inter_out + m.dcn_rank)
    fw, bw, p, _ = _mlp(cal, b, m.top_mlp, inter_out, True)
    st["top_mlp"], bwd, params = fw, bwd + bw, params + p
    st["backward"] = bwd
    st["dense_opt"] = cal.laws["dense_opt"](params=float(params), one=1.0)
    st = {k: v * cal.step_scale for k, v in st.items()}

    # The embedding side, rank by rank: the slowest rank sets the step.
    tables = table_infos(cfg)
    plan = plan if plan is not None else default_plan(cfg, cal, w)
    laws = planner_laws(cal)
    best: tuple[float, int, dict[str, float]] = (-1.0, 0, {})
    for r, work in enumerate(rank_work(tables, plan, cfg.train.batch_size)):
        lk = cal.laws["lookup"](ids_d=work.values, ids=work.ids, one=1.0) * cal.step_scale
        up = cal.laws["update"](ids_d=work.values, ids=work.ids, one=1.0) * cal.step_scale
        emb = {"lookup": lk, "sparse": up}
        if w > 1:
            emb["all_to_all"] = (
                work.all_to_all_bytes * laws.all_to_all_per_byte
                + ALL_TO_ALL_CALLS * laws.all_to_all_per_call
            )
            dense_bytes = ring_bytes(params * VALUE_BYTES, w)
            emb["all_reduce"] = (
                dense_bytes + work.all_reduce_bytes
            ) * laws.all_reduce_per_byte + ALL_REDUCE_CALLS * laws.all_reduce_per_call
        if sum(emb.values()) > best[0]:
            best = (sum(emb.values()), r, emb)
    _, slowest, emb = best
    st = {
        "lookup": emb["lookup"],
        **st,
        "sparse": emb["sparse"],
        **{k: v for k, v in emb.items() if k not in ("lookup", "sparse")},
    }
    st["overhead"] = cal.step_overhead
    total = sum(st.values())
    # memory: tables + state (plan), dense fp32 params + grads + Adam's two moments, and
    # the activations autograd keeps (each layer's output, B x width fp32)
    table_mem = _table_bytes(cfg, plan)
    act = b * VALUE_BYTES * (activations + sum(dims))
    mem = max(table_mem) + 4 * params * VALUE_BYTES + act
    return Prediction(
        total,
        cfg.train.batch_size / total,
        {k: v * 1e3 for k, v in st.items()},
        table_mem[slowest],
        int(mem),
        slowest,
    )


def _table_bytes(cfg: Config, plan: ShardingPlan) -> list[int]:
    """Bytes of tables + optimizer state on each rank under ``plan``: the planner's
    count when it made the plan (tiers included), else the plan's shards counted."""
    if any(plan.memory_per_rank):
        return list(plan.memory_per_rank)
    m = cfg.model
    names = [f"C{i + 1}" for i in range(len(m.table_sizes))]
    layout = build_layout(names, list(m.table_sizes), m.dims(), plan)
    return table_bytes_per_rank(layout, lambda w: row_bytes(cfg.embedding, w))


def standard_stages(stages_ms: dict[str, float]) -> dict[str, float]:
    """The model's stages under the forecast's names (``perfmodel/forecast.py``):
    mlp_gemm = both MLPs forward and every layer's backward."""
    g = stages_ms.get
    return {
        "mlp_gemm": g("bottom_mlp", 0.0) + g("top_mlp", 0.0) + g("backward", 0.0),
        "interaction": g("interaction", 0.0),
        "embedding_forward": g("lookup", 0.0),
        "embedding_update": g("sparse", 0.0),
        "all_to_all": g("all_to_all", 0.0),
        "all_reduce": g("all_reduce", 0.0),
        "dense_optimizer": g("dense_opt", 0.0),
        "host": g("overhead", 0.0),
    }
