"""The sharding planner: a pure function, tested with synthetic topologies (no process group)."""

import json
import time

import pytest
import torch

from recscale.config import load_config
from recscale.planner import (
    Constraints,
    PlanError,
    ShardingPlan,
    TableInfo,
    Topology,
    plan_sharding,
)
from recscale.planner.from_config import table_infos

GB = 10**9


def _check_memory(plan: ShardingPlan, topo: Topology) -> None:
    per_rank = [0] * topo.world_size
    for p in plan.placements:
        for r, m in p.memory_per_rank.items():
            per_rank[r] += m
    assert per_rank == plan.memory_per_rank
    assert max(per_rank) <= topo.memory_per_rank


def test_respects_memory_and_balances_equal_tables():
    tables = [TableInfo(f"T{i}", 2_000_000, 64) for i in range(16)]  # 0.52 GB each
    topo = Topology(4, 3 * GB)
    plan = plan_sharding(tables, topo, Constraints(batch_size=8192, data_parallel_max_bytes=0))
    _check_memory(plan, topo)
    assert plan.imbalance < 1.05
    assert [p.table for p in plan.placements] == [t.name for t in tables]


def test_tiny_tables_replicated_and_oversized_tables_row_wise():
    tables = [
        TableInfo("tiny", 4, 128),
        TableInfo("huge", 50_000_000, 128),
        TableInfo("mid", 100_000, 128),
    ]
    topo = Topology(8, 10 * GB)  # huge is 25.8 GB: larger than one rank
    plan = plan_sharding(tables, topo, Constraints(batch_size=16384))
    kinds = {p.table: p.kind for p in plan.placements}
    assert kinds["tiny"] == "data_parallel" and kinds["huge"] == "row_wise"
    huge = next(p for p in plan.placements if p.table == "huge")
    assert sum(huge.memory_per_rank.values()) == tables[1].bytes and len(huge.ranks) == 8
    _check_memory(plan, topo)


def test_column_wise_shards_cover_the_dim():
    tables = [TableInfo(f"W{i}", 1_000_000, 256, pooling=20.0) for i in range(2)]
    plan = plan_sharding(
        tables, Topology(8, 8 * GB), Constraints(batch_size=65536, data_parallel_max_bytes=0)
    )
    for p in plan.placements:
        if p.kind == "column_wise":
            assert sum(p.dims) == 256 and len(p.dims) == len(p.ranks)
    assert {p.kind for p in plan.placements} <= {"table_wise", "column_wise", "row_wise"}


def test_deterministic_and_serialisable():
    cfg = load_config("criteo_terabyte")
    tables = [TableInfo(f"C{i + 1}", n, 128) for i, n in enumerate(cfg.model.table_sizes)]
    topo, cons = Topology(64, 16 * GB), Constraints(batch_size=65536)
    a, b = plan_sharding(tables, topo, cons), plan_sharding(tables, topo, cons)
    assert a.to_dict() == b.to_dict()
    back = ShardingPlan.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back.to_dict() == a.to_dict()


def test_impossible_plan_says_how_much_is_missing():
    tables = [TableInfo("a", 10_000_000, 128), TableInfo("b", 10_000_000, 128)]  # 5.16 GB each
    with pytest.raises(
        PlanError,
        match=r"need 10\.32 GB .* 2 ranks x 4\.00 GB = 8\.00 GB are available: 2\.32 GB missing",
    ):
        plan_sharding(tables, Topology(2, 4 * GB), Constraints(batch_size=1024))


def test_terabyte_plans_in_seconds():
    cfg = load_config("criteo_terabyte")
    tables = [TableInfo(f"C{i + 1}", n, 128) for i, n in enumerate(cfg.model.table_sizes)]
    for w in (8, 64, 512):
        t = time.perf_counter()
        plan = plan_sharding(tables, Topology(w, 80 * GB), Constraints(batch_size=2048 * w))
        assert time.perf_counter() - t < 5
        _check_memory(plan, Topology(w, 80 * GB))


def test_cli_plan_json_and_error():
    from helpers import run_cli

    cmd = ["plan", "--config", "criteo_terabyte"]
    r = run_cli(*cmd, "--world-size", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["placements"]) == 26
    r = run_cli(*cmd, "--world-size", "2", "--memory-per-rank", "10")
    assert r.returncode == 1 and "GB missing" in r.stderr


def test_ssd_tier_takes_the_largest_tables_when_memory_is_short():
    tables = [
        TableInfo("big", 40_000_000, 128),
        TableInfo("mid", 2_000_000, 128),
        TableInfo("small", 1000, 128),
    ]
    topo = Topology(1, 16 * GB, ssd_per_rank=200 * GB)  # big is 20.6 GB
    plan = plan_sharding(tables, topo, Constraints(batch_size=2048, ssd_cache_fraction=0.1))
    where = {p.table: p for p in plan.placements}
    assert where["big"].placement == "ssd" and where["big"].ssd_bytes == tables[0].bytes
    assert where["big"].cache_bytes == int(tables[0].bytes * 0.1)
    assert where["mid"].placement == where["small"].placement == "device"
    assert plan.memory_per_rank[0] <= topo.memory_per_rank
    assert (
        ShardingPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).to_dict() == plan.to_dict()
    )
    # Enough memory: nothing goes to ssd.
    roomy = plan_sharding(
        tables, Topology(1, 200 * GB, ssd_per_rank=200 * GB), Constraints(batch_size=2048)
    )
    assert all(p.placement == "device" for p in roomy.placements)
    # Not even the ssd tier is enough: the error says how much is missing.
    with pytest.raises(PlanError, match="missing"):
        plan_sharding(
            tables, Topology(1, 1 * GB, ssd_per_rank=10 * GB), Constraints(batch_size=2048)
        )


def test_a_slow_tiers_cache_holds_at_least_the_batches_in_flight(tmp_path, capsys):
    """A table moved to ssd had a cache of ``ssd_cache_fraction`` of its bytes even where
    that held fewer rows than its batches in flight: ``embedding.placement=auto`` on the
    debug preset's small tables planned 550 cache rows for 800 a step needed, and the
    run stopped at its first step (the benchmark with a traceback). The cache is at
    least ``TableInfo.min_cache_bytes`` (``in_flight_cache_bytes``' share, at most the
    table), and where memory cannot hold that the plan is refused before any run."""
    from recscale.cli.main import main
    from recscale.config.loader import load_config
    from recscale.planner.from_config import IN_FLIGHT_BATCHES, table_infos

    t = TableInfo("t", 1_000_000, 16, min_cache_bytes=20_000_000)
    topo = Topology(1, 40 * 10**6, ssd_per_rank=200 * GB)
    plan = plan_sharding([t], topo, Constraints(batch_size=2048, ssd_cache_fraction=0.1))
    assert plan.placements[0].placement == "ssd"
    assert plan.placements[0].cache_bytes == 20_000_000 > int(t.bytes * 0.1)
    cfg = load_config("debug", ["--train.batch_size=64"])
    for info, rows in zip(table_infos(cfg), cfg.model.table_sizes):
        assert info.min_cache_bytes == min(rows, IN_FLIGHT_BATCHES * 64) * (8 * 4 + 4)
    run = tmp_path / "run"
    argv = ["train", "--config", "debug", "--train.steps=3", "--run-dir", str(run)]
    argv += ["--embedding.placement=auto", "--embedding.memory_budget_gb=1e-4"]
    assert main(argv) == 2
    assert "'embedding.memory_budget_gb'" in capsys.readouterr().err
    assert not run.exists()  # nor its ssd tier's directory


def test_gpu_runs_use_host_memory_before_ssd():
    tables = [
        TableInfo("big", 40_000_000, 128),
        TableInfo("big2", 39_000_000, 128),
        TableInfo("mid", 2_000_000, 128),
    ]
    topo = Topology(1, 16 * GB, ssd_per_rank=200 * GB, host_per_rank=25 * GB)
    plan = plan_sharding(tables, topo, Constraints(batch_size=2048))
    where = {p.table: p.placement for p in plan.placements}
    # 41 GB of tables on a 16 GB device: the biggest goes to host memory (25 GB holds
    # one), the next to SSD; the rest stays on the device.
    assert where == {"big": "host", "big2": "ssd", "mid": "device"}
    assert plan.memory_per_rank[0] <= topo.memory_per_rank


def test_a_tables_hit_curve_sets_its_tier_cost():
    flat = TableInfo("t", 40_000_000, 128)
    steep = TableInfo("t", 40_000_000, 128, hit_curve=((0.01, 0.6), (0.1, 0.95)))
    assert flat.hit_rate(0.1, 0.9) == 0.9  # no curve: the constraint's constant
    assert steep.hit_rate(0.1, 0.9) == pytest.approx(0.95)
    assert steep.hit_rate(0.055, 0.9) == pytest.approx(0.775)  # between two points
    assert steep.hit_rate(0.55, 0.9) == pytest.approx(0.975)  # toward (1, 1)
    assert steep.hit_rate(0.0, 0.9) == 0.0 and steep.hit_rate(2.0, 0.9) == 1.0
    topo = Topology(1, 16 * GB, ssd_per_rank=200 * GB)
    cons = Constraints(batch_size=2048, ssd_cache_fraction=0.1)
    cost = {}
    for t in (flat, steep):
        p = plan_sharding([t], topo, cons).placements[0]
        assert p.placement == "ssd"
        cost[t.hit_curve != ()] = (p.hit_rate, p.cost_per_rank[0])
    assert cost[True][0] == pytest.approx(0.95) and cost[False][0] == 0.9
    assert cost[True][1] < cost[False][1]  # fewer misses, less traffic


def test_hit_curves_follow_the_synthetic_law_and_a_datasets_profile(tmp_path):
    import numpy as np

    from recscale.planner.from_config import hit_curves
    from recscale.train.data_source import make_synthetic

    cfg = load_config("debug", ["--data.zipf_alpha=1.05"])
    curves = hit_curves(cfg)
    data = make_synthetic(cfg)
    f = int(np.argmax(cfg.model.table_sizes))
    n = cfg.model.table_sizes[f]
    ids = np.concatenate([data.batch(i, 1024).feature_values(f).numpy() for i in range(40)])
    ranks = make_synthetic(cfg).rank_of_id(f)[ids]
    for frac, share in curves[f]:  # the law's share of the top rows = the drawn share
        assert abs((ranks < frac * n).mean() - share) < 0.02
    meta = {
        "id_frequency_train": {
            "C1": {"distinct": 500, "top_1pct_share": 0.3, "top_10pct_share": 0.7},
            "C2": {"distinct": "many"},  # foreign: no curve, the planner's default
        }
    }
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    cfg = load_config("debug", [f"--data.path={tmp_path}", "--model.table_sizes=1000,1000"])
    got = hit_curves(cfg)
    assert got[0] == ((0.005, 0.3), (0.05, 0.7), (0.5, 1.0)) and got[1] == ()


def test_cli_plan_shows_the_expected_hit_rate():
    from helpers import run_cli

    r = run_cli(
        "plan",
        "--config",
        "criteo_terabyte",
        "--world-size",
        "1",
        "--memory-per-rank",
        "24",
        "--ssd-per-rank",
        "200",
    )
    assert r.returncode == 0, r.stderr
    assert "ssd, cache" in r.stdout and "expected hit rate" in r.stdout


def test_the_default_ssd_cache_takes_its_share_of_free_memory_less_its_bookkeeping():
    from recscale.embedding.sizing import ROW_INDEX_BYTES, SLOT_OVERHEAD_BYTES
    from recscale.planner.from_config import SSD_CACHE_SHARE, default_ssd_cache

    said: list[str] = []
    rows, row = 500_000_000, 68
    free = 24e9
    got = default_ssd_cache(rows * row, rows, int(free), said.append)
    room = SSD_CACHE_SHARE * free - ROW_INDEX_BYTES * rows
    assert got == pytest.approx(room * row / (row + SLOT_OVERHEAD_BYTES), rel=1e-6)
    # rows + slot bookkeeping + the row indices stay within the share
    assert got + got / row * SLOT_OVERHEAD_BYTES + rows * ROW_INDEX_BYTES <= SSD_CACHE_SHARE * free
    assert f"{SSD_CACHE_SHARE:.0%} of the 24.00 GB" in said[0]
    # never more than the tables, never under 1% of them
    assert default_ssd_cache(10**6, 10**4, int(free), said.append) == 10**6
    assert default_ssd_cache(10**12, 10**9, 10**9, said.append) == 10**10


def test_an_explicit_ssd_cache_the_memory_cannot_hold_is_a_config_error(monkeypatch):
    """cache_bytes past the memory available (with bookkeeping, row indices and the
    largest table's initial draw) names the key before anything is allocated; past
    SSD_CACHE_WARN_SHARE of it, a warning; within it, nothing said."""
    from recscale.config.errors import ConfigError
    from recscale.config.loader import load_config
    from recscale.embedding.sizing import ROW_INDEX_BYTES, SLOT_OVERHEAD_BYTES
    from recscale.planner import job_plan

    rows, dim = [4_000_000, 1_000_000], 8  # the debug preset's dim
    row = dim * 4 + 4  # row-wise Adagrad: one fp32 of state a row
    tables = sum(rows) * row
    draw = rows[0] * dim * 4
    index = ROW_INDEX_BYTES * sum(rows)

    def tiers(cache: int, free: int):
        monkeypatch.setattr(job_plan, "available_memory", lambda _device: free)
        cfg = load_config(
            "debug",
            [
                "--model.table_sizes=" + ",".join(map(str, rows)),
                "--embedding.placement=ssd",
                "--embedding.optimizer=rowwise_adagrad",
                f"--embedding.cache_bytes={cache}",
            ],
        )
        said: list[str] = []
        return job_plan.configured_tiers(cfg, said.append, torch.device("cpu"), 1), said

    cache = tables // 5
    need = cache + SLOT_OVERHEAD_BYTES * cache / row + index + draw
    got, said = tiers(cache, int(need * 2))
    assert sum(c for _t, c in got) == pytest.approx(cache, abs=2) and not said
    _, said = tiers(cache, int(need / 0.9))  # fits, but past the warning's share
    assert len(said) == 1 and "warning: embedding.cache_bytes" in said[0]
    with pytest.raises(ConfigError) as err:
        tiers(cache, int(need * 0.95))
    assert err.value.key == "embedding.cache_bytes" and "at most" in str(err.value)
    # the suggested size fits
    most = int(str(err.value).split("at most ")[1].split(" fits")[0].replace(",", ""))
    assert most < cache
    tiers(most, int(need * 0.95))


def test_replicas_never_starve_a_later_table():
    """Largest first, each table taking its cheapest placement: small tables replicated
    on every rank had left a 3-row table no room just under the roomy plan's memory.
    Now every budget with 2% to spare over the tables' bytes gets a plan that fits,
    replicating fewer tables as the budget shrinks; with memory to spare, as before."""
    tables = table_infos(load_config("debug"))
    need = sum(t.bytes for t in tables)
    cons = Constraints(batch_size=256)
    roomy = plan_sharding(tables, Topology(2, 10**9), cons)
    replicated = lambda plan: sum(p.kind == "data_parallel" for p in plan.placements)  # noqa: E731
    assert replicated(roomy) > 10
    top = max(roomy.memory_per_rank)
    assert plan_sharding(tables, Topology(2, top), cons).to_dict() == roomy.to_dict()
    for cap in range(top - 1, int(need / 2 * 1.02), -1500):
        tight = plan_sharding(tables, Topology(2, cap), cons)
        assert {p.table for p in tight.placements} == {t.name for t in tables}
        assert max(tight.memory_per_rank) <= cap, cap
        assert replicated(tight) < replicated(roomy)
    with pytest.raises(
        PlanError, match=r"2 ranks x 100\.00 kB = 200\.00 kB are available: \d+\.\d\d kB missing"
    ):
        plan_sharding(tables, Topology(2, 100_000), cons)


def test_plan_shows_the_plan_file_or_sharding_a_job_would_run(tmp_path, capsys):
    """``recscale plan --distributed.plan=FILE`` (or ``--distributed.sharding=KIND``)
    printed the planner's own plan: the file - even one that was not there, or for
    another world size - was never read. It shows and checks the plan a job of that
    config runs."""
    from recscale.cli.main import main
    from recscale.planner.from_config import uniform_plan

    plan = uniform_plan(table_infos(load_config("debug")), 2, "table_wise").to_dict()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    argv = ["plan", "--config", "debug", f"--distributed.plan={path}", "--json"]
    assert main([*argv, "--world-size", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [p["ranks"] for p in shown["placements"]] == [p["ranks"] for p in plan["placements"]]
    assert main([*argv, "--world-size", "4"]) == 2
    assert "a plan for 2 ranks but the job has 4" in capsys.readouterr().err
    assert main([*argv[:3], f"--distributed.plan={tmp_path / 'none.json'}"]) == 2
    capsys.readouterr()
    assert main([*argv[:3], "--world-size", "2", "--distributed.sharding=row_wise", "--json"]) == 0
    kinds = {p["kind"] for p in json.loads(capsys.readouterr().out)["placements"]}
    assert kinds == {"row_wise"}
