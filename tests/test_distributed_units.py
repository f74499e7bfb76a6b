"""The pieces of distributed/ that need no process group: layout, plans, batch slicing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import error_line, random_jagged

from recscale.config import ConfigError, load_config
from recscale.data.batch import Batch
from recscale.distributed import build_layout, plan_for, table_infos, uniform_plan
from recscale.planner import ShardingPlan, TablePlacement
from recscale.planner.layout import row_blocks


def test_row_blocks_cover_the_table_in_order():
    assert row_blocks(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert row_blocks(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]  # an empty last shard


def _plan(placements, w):
    return ShardingPlan(w, placements, [0] * w, [0.0] * w)


def test_layout_places_every_row_and_column_once():
    names, rows, dims = ["a", "b", "c", "d"], [10, 7, 5, 4], [8, 8, 4, 8]
    plan = _plan(
        [
            TablePlacement("a", "row_wise", [0, 1, 2], {}, {}),
            TablePlacement("b", "column_wise", [2, 0], {}, {}, [3, 5]),
            TablePlacement("c", "table_wise", [1], {}, {}),
            TablePlacement("d", "data_parallel", [0, 1, 2], {}, {}),
        ],
        3,
    )
    layout = build_layout(names, rows, dims, plan)
    assert layout.dp_features == [3]
    for f in range(3):
        cover = torch.zeros(rows[f], dims[f], dtype=torch.int64)
        for s in layout.shards:
            if s.feature == f:
                cover[s.row_lo : s.row_hi, s.col_lo : s.col_hi] += 1
        assert bool((cover == 1).all())
    for r, rs in enumerate(layout.per_rank):
        assert all(s.owner == r for s in rs.shards)
        # wire order: every rank's shards in global shard order
        assert [s.index for s in rs.shards] == sorted(s.index for s in rs.shards)
    assert not layout.is_identity
    one = build_layout(
        names, rows, dims, _plan([TablePlacement(n, "table_wise", [0], {}, {}) for n in names], 1)
    )
    assert one.is_identity


@pytest.mark.parametrize(
    "placement, message",
    [
        (TablePlacement("a", "table_wise", [0, 1], {}, {}), "exactly one rank"),
        (
            TablePlacement("a", "column_wise", [0, 1], {}, {}, [4, 5]),
            "adding up to the table dim 8",
        ),
        (TablePlacement("a", "row_wise", [0, 5], {}, {}), "outside world size 2"),
        (TablePlacement("a", "diagonal", [0], {}, {}), "unknown sharding kind"),
    ],
)
def test_layout_rejects_bad_placements(placement, message):
    with pytest.raises(ValueError, match=message):
        build_layout(["a"], [10], [8], _plan([placement], 2))


def test_plan_for_reads_a_plan_file_and_checks_its_world_size(tmp_path):
    cfg = load_config("debug")
    plan = uniform_plan(table_infos(cfg), 2, "table_wise")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    cfg.distributed.plan = str(path)
    assert plan_for(cfg, 2, 1 << 30).to_dict() == plan.to_dict()
    with pytest.raises(ConfigError, match="distributed.plan.*for 2 ranks but the job has 4"):
        plan_for(cfg, 4, 1 << 30)
    cfg.distributed.plan = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="distributed.plan"):
        plan_for(cfg, 2, 1 << 30)


def test_unknown_sharding_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="distributed.sharding"):
        load_config("debug", ["--distributed.sharding=diagonal"])


def test_batch_slices_and_padding_keep_each_sample():
    batch = random_jagged([5, 9, 4], batch_size=7, max_len=3, weighted=True, seed=3)
    parts = [batch.slice(lo, hi) for lo, hi in [(0, 2), (2, 5), (5, 7)]]
    for part, lo in zip(parts, [0, 2, 5]):
        for f in range(3):
            for b in range(part.batch_size):
                want = batch.offsets[f * 7 + lo + b : f * 7 + lo + b + 2]
                got = part.offsets[f * part.batch_size + b : f * part.batch_size + b + 2]
                assert torch.equal(part.values[got[0] : got[1]], batch.values[want[0] : want[1]])
                assert torch.equal(part.weights[got[0] : got[1]], batch.weights[want[0] : want[1]])
        assert torch.equal(part.labels, batch.labels[lo : lo + part.batch_size])
    padded = parts[2].pad(4)
    padded.check(13, 3)
    assert padded.batch_size == 4 and int(padded.lengths().view(3, 4)[:, 2:].sum()) == 0
    assert torch.equal(padded.values, parts[2].values)


def test_batch_slice_of_from_lists():
    b = Batch.from_lists([[0.0]] * 3, [[[1], [], [2, 3]], [[4], [5], [6]]], [0.0, 1.0, 0.0])
    s = b.slice(1, 3)
    assert s.values.tolist() == [2, 3, 5, 6] and s.offsets.tolist() == [0, 0, 2, 3, 4]


def test_shard_applies_the_plans_tiers(tmp_path):
    """The planner's host/ssd choice for a table is applied, not advisory: its shards
    live in a cached storage with the plan's cache; the others stay in device memory."""
    from recscale.distributed import DistContext, shard
    from recscale.embedding.placement import storage_factory
    from recscale.models.dlrm import build_model

    # a plan of its own places the tables (a distributed.plan file's, as here): the tier
    # keys act under placement=device
    cfg = load_config("debug", [f"--embedding.ssd_dir={tmp_path}", "--distributed.plan=p.json"])
    names = [t.name for t in table_infos(cfg)]
    plan = _plan(
        [
            TablePlacement(
                n,
                "table_wise",
                [0],
                {},
                {},
                placement="ssd" if i == 2 else "device",
                cache_bytes=4000 if i == 2 else 0,
            )
            for i, n in enumerate(names)
        ],
        1,
    )
    model = build_model(cfg.model, cfg.embedding, materialize_embeddings=False)
    shard(model, plan, DistContext(), storage_factory(cfg.embedding, None, "auto"))
    tiers = sorted(s.tier for s in model.embeddings.storages())
    assert tiers == ["device", "ssd"]
    (cached,) = [s for s in model.embeddings.storages() if s.tier == "ssd"]
    assert cached.num_rows == cfg.model.table_sizes[2] and cached.cache_rows < cached.num_rows
    assert model.embeddings.layout.is_identity  # one rank, whole tables: no dist stages


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_the_plan_decides_each_tables_kernel_and_the_storages_take_it(kernels):
    """One place decides a table's tier and kernel: the plan (train.parallel.build); the
    storages are built with what it says, and their per-call choice agrees with it."""
    from recscale.config import load_config
    from recscale.distributed import DistContext
    from recscale.embedding import kernels as kmod
    from recscale.train.parallel import build

    cfg = load_config("debug", [f"--model.kernels={kernels}"])
    model, _module, plan = build(cfg, DistContext(device=torch.device("cpu")), lambda _m: None)
    chosen = {p.table: p.kernel for p in plan.placements}
    assert all(chosen.values())
    if kernels == "torch":
        assert set(chosen.values()) == {"torch"}
    ebc = model.embeddings.compute
    for g in ebc.groups:
        names = {ebc.tables[f].name for f in g.features}
        assert {chosen[n] for n in names} == {g.storage.kernel}
        if g.storage.kernel != "torch":
            w = g.storage.weight
            assert kmod.choose_once(g.storage, g.storage.kernel, "backward", w, g.storage.dim) == (
                g.storage.kernel
            )


@pytest.mark.parametrize(
    "env, named",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1'"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ],
)
def test_a_malformed_launch_environment_names_the_variable(monkeypatch, env, named):
    from recscale.launch_env import JobLaunchError, launch_env

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(JobLaunchError, match=named.replace("(", r"\(")):
        launch_env()


@pytest.mark.parametrize(
    "env, named",
    [
        ({}, "MASTER_ADDR is not set"),  # torch's ValueError traceback
        ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT=''"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"}, "MASTER_PORT='abc'"),  # same
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),  # same
    ],
)
def test_a_rendezvous_environment_that_cannot_work_is_one_line(
    tmp_path, monkeypatch, capsys, env, named
):
    from recscale.cli.main import main

    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    assert main(["train", "--config", "debug", "--train.steps=1", f"--run-dir={run}"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("recscale: error: ") and named in line, line
    assert not run.exists()


def test_launch_env_reads_torchruns_variables(monkeypatch):
    from recscale.launch_env import launch_env

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert launch_env() == (1, 0, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_env() == (4, 3, 1)


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_malformed_local_world_size_is_named_before_the_model(
    tmp_path, monkeypatch, capsys, value
):
    """``LOCAL_WORLD_SIZE`` (the ranks sharing this host's cores and memory) was read with
    a bare ``int()``: "abc" was a ValueError traceback and "0" a ZeroDivisionError."""
    from recscale.cli.main import main
    from recscale.launch_env import JobLaunchError, local_world_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(JobLaunchError, match=f"LOCAL_WORLD_SIZE='{value}'"):
        local_world_size()
    rc = main(["train", "--config", "debug", "--run-dir", str(tmp_path / "run")])
    line = error_line(capsys.readouterr().err)
    assert rc == 1 and f"LOCAL_WORLD_SIZE='{value}': a whole number >= 1" in line
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size() == 2


def test_a_rank_started_alone_stops_in_one_line_after_the_timeout(tmp_path):
    """WORLD_SIZE=2 and only rank 0 started: after distributed.timeout_s, one line saying
    the job could not form and what to check (it was torch's store traceback)."""
    import os
    import socket

    from helpers import error_line, forked_cli

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    run = tmp_path / "run"
    r = forked_cli(
        "train",
        "--config",
        "debug",
        f"--run-dir={run}",
        "--distributed.timeout_s=2",
        env=env,
        timeout=120,
    )
    line = error_line(r.stderr)
    assert r.returncode == 1 and "could not form the job" in line and "WORLD_SIZE=2" in line
