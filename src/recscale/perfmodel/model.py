"""The performance model: a training step's time, stage by stage, from a config and a
calibration (``calibrate.py``) - a pure function, no model is built or run.

For one rank of ``world_size`` (batch B = global batch / W; CPU, fp32)::

    lookup       law(ids = B x sum_f pooling_f, D)
    bottom MLP   sum over layers of mlp_forward(M=B, K, N)
    interaction  dot: the calibrated dot law (forward + backward, counted in forward);
                 cat: the element-wise law (the concatenation); dcnv2: two GEMMs a
                 cross layer as MLP layers + the element-wise law per layer
    top MLP      sum over layers of mlp_forward(M=B, K, N)
    backward     sum over MLP layers of mlp_backward (the first bottom layer: wgrad only)
    sparse       update law (fused backward + optimizer)
    dense_opt    dense optimizer law over the MLP parameters
    overhead     the calibrated per-step constant (every stage above is first scaled by
                 the calibrated ``step_scale``)

``ids_per_sample`` defaults to the synthetic data's mean pooling factor per feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recscale.config.schema import Config
from recscale.perfmodel.calibrate import Calibration


@dataclass
class Prediction:
    step_seconds: float
    samples_per_s: float
    stages_ms: dict[str, float] = field(default_factory=dict)
    embedding_bytes: int = 0  # tables + optimizer state on this rank


def _mlp(cal: Calibration, m: int, widths: list[int], k: int, first_needs_dgrad: bool):
    fwd = bwd = 0.0
    params = 0
    for i, n in enumerate(widths):
        x = {"flops2": 2.0 * m * k * n, "flops4": 4.0 * m * k * n, "mn": float(m * n),
             "mk": float(m * k), "kn": float(k * n), "one": 1.0}  # fmt: skip
        fwd += cal.laws["mlp_forward"](**x)
        b = cal.laws["mlp_backward"](**x)
        if i == 0 and not first_needs_dgrad:  # no input gradient: one GEMM of two
            b *= 0.5
        bwd += b
        params += k * n + n
        k = n
    return fwd, bwd, params, k


def predict(cfg: Config, cal: Calibration, world_size: int = 1,
            ids_per_sample: float | None = None) -> Prediction:  # fmt: skip
    from recscale.embedding.placement import row_bytes
    from recscale.modules.interaction import PAD_MULTIPLE

    m = cfg.model
    b = max(1, cfg.train.batch_size // world_size)
    f = len(m.table_sizes)
    dims = m.dims()
    d = dims[0]
    pooling = ids_per_sample if ids_per_sample is not None else f * (
        cfg.data.min_ids_per_feature + cfg.data.max_ids_per_feature) / 2  # fmt: skip
    ids = b * pooling
    st: dict[str, float] = {}
    st["lookup"] = cal.laws["lookup"](ids_d=ids * d, ids=ids, one=1.0)
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
    fw, bw, p, _ = _mlp(cal, b, m.top_mlp, inter_out, True)
    st["top_mlp"], bwd, params = fw, bwd + bw, params + p
    st["backward"] = bwd
    st["sparse"] = cal.laws["update"](ids_d=ids * d, ids=ids, one=1.0)
    st["dense_opt"] = cal.laws["dense_opt"](params=float(params), one=1.0)
    st = {k: v * cal.step_scale for k, v in st.items()}
    st["overhead"] = cal.step_overhead
    total = sum(st.values())
    rows = sum(m.table_sizes) / world_size
    emb_bytes = int(rows * row_bytes(cfg.embedding, d))
    return Prediction(total, cfg.train.batch_size / total,
                      {k: v * 1e3 for k, v in st.items()}, emb_bytes)  # fmt: skip
