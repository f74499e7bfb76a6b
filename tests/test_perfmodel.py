"""The performance model: each stage against a hand count of FLOPs and ids, plan's output."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

from recscale.config import load_config
from recscale.perfmodel import Calibration, Law, predict


def _unit_calibration(**rates) -> Calibration:
    """Laws that charge exactly 1 ns per FLOP (MLPs), per B*K*K*D (interaction), per
    id x dim (embeddings), per parameter (dense optimizer); nothing else."""
    z = lambda names, on: Law(names, [1e-9 if n == on else 0.0 for n in names])  # noqa: E731
    mlp = ["flops2", "mn", "mk", "kn", "one"]
    laws = {
        "mlp_forward": z(mlp, "flops2"),
        "mlp_backward": z(["flops4", "mn", "mk", "kn", "one"], "flops4"),
        "interaction": z(["bkkd", "bkk", "one"], "bkkd"),
        "lookup": z(["ids_d", "ids", "one"], "ids_d"),
        "update": z(["ids_d", "ids", "one"], "ids_d"),
        "dense_opt": z(["params", "one"], "params"),
    }
    return Calibration("test", 1, laws, **rates)


def test_each_stage_is_its_hand_count():
    cfg = load_config("debug", ["--train.batch_size=256", "--data.max_ids_per_feature=3"])
    m, b = cfg.model, 256
    p = predict(cfg, _unit_calibration())
    ms = p.stages_ms
    dims = [m.num_dense_features, *m.bottom_mlp]
    bottom = sum(2 * b * k * n for k, n in zip(dims, dims[1:]))
    assert ms["bottom_mlp"] == pytest.approx(bottom * 1e-6)  # 1 ns per FLOP, in ms
    f, d = len(m.table_sizes), m.embedding_dim
    k = f + 1
    assert ms["interaction"] == pytest.approx(b * k * k * d * 1e-6)
    ids = b * f * (1 + 3) / 2  # the synthetic data's mean ids per feature
    assert ms["lookup"] == pytest.approx(ids * d * 1e-6) == pytest.approx(ms["sparse"])
    top_in = -(-(k * (k - 1) // 2 + d) // 8) * 8  # pairs + dense, padded to 8
    tops = [top_in, *m.top_mlp]
    top = sum(2 * b * a * c for a, c in zip(tops, tops[1:]))
    assert ms["top_mlp"] == pytest.approx(top * 1e-6)
    # backward: 4 MKN a layer, the first bottom layer only its weight gradient (half)
    back = 2 * top + 2 * bottom - 0.5 * (4 * b * dims[0] * dims[1])
    assert ms["backward"] == pytest.approx(back * 1e-6)
    params = sum(a * c + c for a, c in zip(dims, dims[1:])) + sum(
        a * c + c for a, c in zip(tops, tops[1:])
    )
    assert ms["dense_opt"] == pytest.approx(params * 1e-6)
    assert p.step_seconds == pytest.approx(sum(ms.values()) / 1e3)
    assert p.samples_per_s == pytest.approx(b / p.step_seconds)


def test_step_fit_scales_and_adds():
    cfg = load_config("debug")
    base = predict(cfg, _unit_calibration())
    fitted = predict(cfg, _unit_calibration(step_scale=1.5, step_overhead=0.002))
    assert fitted.step_seconds == pytest.approx(1.5 * base.step_seconds + 0.002)


def test_calibration_round_trip_and_plan_prints_the_prediction(tmp_path):
    path = tmp_path / "cal.json"
    _unit_calibration(step_overhead=0.001).save(path)
    assert Calibration.load(path).laws["lookup"].coef[0] == 1e-9
    r = run_cli(
        "plan", "--config", "debug", "--world-size", "1", "--calibration", str(path), "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = predict(load_config("debug"), Calibration.load(path))
    assert out["predicted_step_ms"] == pytest.approx(want.step_seconds * 1e3)
    assert out["predicted_samples_per_s"] == pytest.approx(want.samples_per_s)


def _with_collectives(cal: Calibration, per_byte: float = 1e-9, per_call: float = 0.0):
    for name in ("all_to_all", "all_reduce"):
        cal.laws[name] = Law(["bytes", "one"], [per_byte, per_call])
    return cal


def test_several_ranks_count_each_ranks_rows_and_bytes():
    """W = 2, every table row-wise: each rank looks up half the ids; the all-to-all moves
    B p 8 / W id bytes + 2 B D 4 (W-1)/W vector bytes a table; the all-reduce the ring
    bytes of the dense parameters; 1 ns a byte, 1 ns an id x column."""
    from recscale.planner.from_config import table_infos, uniform_plan

    cfg = load_config("debug", ["--train.batch_size=256", "--data.max_ids_per_feature=3"])
    w, b = 2, 256
    cal = _with_collectives(_unit_calibration(), per_call=1e-6)
    tables = table_infos(cfg)
    one = predict(cfg, cal, world_size=1).stages_ms
    two = predict(cfg, cal, world_size=w, plan=uniform_plan(tables, w, "row_wise")).stages_ms
    f, d, p = len(tables), cfg.model.embedding_dim, 2.0
    assert (
        two["lookup"] == pytest.approx(b * f * p * d / w * 1e-6) == pytest.approx(one["lookup"] / 2)
    )
    a2a = f * (b * p * 8 / w + 2 * b * d * 4 * (w - 1) / w) * 1e-9 + 5 * 1e-6
    assert two["all_to_all"] == pytest.approx(a2a * 1e3)
    # the dense parameters: the unit law charges 1 ns each in dense_opt
    params = one["dense_opt"] * 1e6
    assert two["all_reduce"] == pytest.approx((2 * (w - 1) / w * params * 4 * 1e-9 + 1e-6) * 1e3)
    assert two["bottom_mlp"] == pytest.approx(one["bottom_mlp"] / 2)  # half the batch a rank
    assert "all_to_all" not in one


def test_table_wise_slowest_rank_sets_the_step_and_memory_is_per_rank():
    from recscale.planner import ShardingPlan, TablePlacement
    from recscale.planner.from_config import table_infos

    cfg = load_config("debug")
    tables = table_infos(cfg)
    # every table on rank 1: rank 0 has no embedding work
    plan = ShardingPlan(
        2, [TablePlacement(t.name, "table_wise", [1], {}, {}) for t in tables], [0, 0], [0.0, 0.0]
    )
    p = predict(cfg, _with_collectives(_unit_calibration()), world_size=2, plan=plan)
    assert p.slowest_rank == 1
    assert p.embedding_bytes == sum(t.bytes for t in tables)
    assert p.memory_bytes > p.embedding_bytes


@pytest.mark.parametrize("per_byte", [1e-12, 1e-9, 1e-7])
def test_planner_choice_is_predicted_no_slower_than_any_uniform_plan(per_byte):
    """The planner minimises the predicted step: whatever the collectives cost, its plan
    is predicted at least as fast (within its 2% tie band) as one kind for every table."""
    from recscale.perfmodel.model import default_plan
    from recscale.planner.from_config import table_infos, uniform_plan

    cfg = load_config("default", ["--train.batch_size=4096"])
    cal = _with_collectives(_unit_calibration(), per_byte=per_byte, per_call=1e-5)
    tables = table_infos(cfg)
    for w in (2, 4):
        chosen = predict(cfg, cal, w, default_plan(cfg, cal, w)).step_seconds
        for kind in ("table_wise", "row_wise", "column_wise", "data_parallel"):
            other = predict(cfg, cal, w, uniform_plan(tables, w, kind)).step_seconds
            assert chosen <= other * 1.02, (w, kind, chosen, other)


def test_plan_uses_the_calibrations_costs(tmp_path):
    """With a calibration, `recscale plan` plans with its laws: on a slow network the
    large tables go whole to one rank each (table_wise: no partial sums of every sample
    from every rank to send back, as row_wise has), on a fast one they split by rows."""
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    _with_collectives(_unit_calibration(), per_byte=1e-13).save(fast)
    _with_collectives(_unit_calibration(), per_byte=1e-6).save(slow)

    def plan(path):
        r = run_cli(
            "plan",
            "--config",
            "default",
            "--world-size",
            "4",
            "--train.batch_size=4096",
            "--calibration",
            str(path),
            "--json",
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    a, b = plan(fast), plan(slow)
    assert a["costs"] == b["costs"] == "test"
    assert a["predicted_step_ms"] < b["predicted_step_ms"]
    assert b["predicted_stage_ms"]["all_to_all"] > a["predicted_stage_ms"]["all_to_all"]
    assert "predicted_memory_bytes" in a
    kinds = lambda out: {p["kind"] for p in out["placements"]}  # noqa: E731
    assert "table_wise" in kinds(b) and "table_wise" not in kinds(a)
