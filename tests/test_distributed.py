"""Sharded training equals single-process training (2 and 4 gloo ranks on loopback).

For each sharding kind and a mixed plan: K steps at world size W on the W slices of
the same global batches give the predictions, dense weights, embedding rows and
optimizer state of the plain single-device model (world size 1) within float
tolerance (summation order differs).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from dist_workers import (
    die_mid_training,
    global_batches,
    parity_config,
    reference,
    replicated_rows,
    sharded_run,
    train_and_report,
    train_and_report_group,
    train_into_own_run_dir,
    train_with_rank_memory,
    train_with_rank_overrides,
)

from recscale.config import load_config
from recscale.distributed.spawn import run_ranks
from recscale.models.dlrm import build_model
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.run import train

STEPS, BATCH = 4, 64
KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]
# Adam divides by sqrt(second moment): for rows with tiny gradients the summation-order
# differences of the reduction are magnified, so it gets a looser bound.
ATOL = {"sgd": 1e-5, "rowwise_adagrad": 1e-5, "adam": 3e-4}


def _check(case, results, world_size):
    plan, optimizer, pooling = case
    ref_preds, ref_dense, ref_tables = reference(optimizer, pooling, STEPS, BATCH)
    atol = ATOL[optimizer]
    preds = torch.cat([r[0] for r in results])
    torch.testing.assert_close(preds, ref_preds, atol=atol, rtol=1e-4, msg=lambda m: f"{case}: {m}")
    for rank_result in results:
        for k, v in ref_dense.items():
            torch.testing.assert_close(rank_result[1][k], v, atol=atol, rtol=1e-4)
    covered = [torch.zeros(t[0].shape, dtype=torch.bool) for t in ref_tables]
    for rank_result in results:
        for s, weight, state in rank_result[2]:
            ref_w, ref_state = ref_tables[s.feature]
            rect = (slice(s.row_lo, s.row_hi), slice(s.col_lo, s.col_hi))
            where = f"{case} table {s.feature} ({s.kind})"
            torch.testing.assert_close(
                weight,
                ref_w[rect],
                atol=atol,
                rtol=1e-4,
                msg=lambda m, where=where: f"{where}: {m}",
            )
            for name, value in state.items():
                ref_value = ref_state[name][rect[0]]
                if value.dim() == 2:
                    ref_value = ref_value[:, rect[1]]
                torch.testing.assert_close(value, ref_value, atol=atol, rtol=1e-4)
            covered[s.feature][rect] = True
    assert all(bool(c.all()) for c in covered), f"{case}: some table rows are held by no rank"


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_training_matches_single_process(world_size):
    optimizers = ["sgd", "rowwise_adagrad"] if world_size == 2 else ["adam", "rowwise_adagrad"]
    cases = []
    for i, kind in enumerate(KINDS):
        for opt in optimizers:
            # Row-wise Adagrad keeps one accumulator per row *per column shard* (as FBGEMM
            # does), so column_wise equals the unsharded model only for element-wise optimizers.
            if opt == "rowwise_adagrad" and kind in ("column_wise", "mixed"):
                continue
            cases.append((kind, opt, "mean" if i % 2 else "sum"))
    cases.append(("mixed", "sgd", "mean"))
    results = run_ranks(sharded_run, world_size, cases, STEPS, BATCH, timeout=240)
    for i, case in enumerate(cases):
        _check(case, [results[r][i] for r in range(world_size)], world_size)


@pytest.mark.parametrize("precision", ["split_bf16", "fp16"])
def test_replicated_tables_keep_the_row_precision(precision):
    """A data_parallel table is stored at ``embedding.row_precision`` on every rank (its
    replicas were fp32 whatever the run asked, so a split_bf16 or fp16 run trained its
    small tables otherwise at 2 ranks than at 1). split_bf16 is exact fp32 arithmetic:
    its rows match the single-process run's within the reduction's summation order."""
    steps = 3
    results = run_ranks(replicated_rows, 2, precision, steps, BATCH, timeout=120)
    for kinds, _rows in results:
        assert kinds and all(
            k == ("AllReducedLowPrecisionStorage", _DTYPE[precision]) for k in kinds
        )
    assert all(torch.equal(results[0][1][f], results[1][1][f]) for f in results[0][1])  # replicas
    if precision != "split_bf16":
        return  # 16-bit rows round stochastically by storage row: not comparable across plans
    cfg = parity_config("rowwise_adagrad")
    cfg.embedding.row_precision = precision
    batches, eval_batch = global_batches(cfg, steps, BATCH)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.embedding, seed=0)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    train_and_report(model, model, opt, batches, eval_batch)
    ebc = model.embeddings
    for f, rows in results[0][1].items():
        g = ebc.groups[int(ebc.group_of_feature[f])]
        lo = int(ebc.feature_row_offset[f])
        ref = g.storage.read_rows(torch.arange(lo, lo + ebc.tables[f].num_rows))
        torch.testing.assert_close(rows, ref, atol=1e-5, rtol=1e-4)


_DTYPE = {"split_bf16": "torch.bfloat16", "fp16": "torch.float16"}


def test_a_finished_run_destroys_the_process_group_it_made():
    """A rank that exits with its gloo groups alive can abort in the interpreter's
    teardown after its work is done ("terminate called without an active exception")."""
    assert run_ranks(train_and_report_group, 2, 4, timeout=120) == [False, False]


def test_dead_rank_fails_the_others_fast():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_ranks(die_mid_training, 2, 1, 5, timeout=120)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "exited with codes [17]" in msg
    assert "rank 0:" in msg and "failed after" in msg, msg  # the survivor raised, not hung
    assert elapsed < 60, f"took {elapsed:.0f}s"


def test_every_rank_writes_into_rank_0s_run_directory(tmp_path):
    """Each rank names a default run directory from its own clock (and rank 1, seeing
    rank 0's new directory, took `-2`): its checkpoint parts went elsewhere while rank 0
    waited for them until the timeout. Rank 0's directory is now every rank's."""
    dirs = run_ranks(train_into_own_run_dir, 2, str(tmp_path), timeout=120)
    assert dirs == [str(tmp_path / "rank0")] * 2
    assert not (tmp_path / "rank1").exists()
    ckpt = sorted((tmp_path / "rank0" / "checkpoints").glob("step_*"))[-1]
    assert {p.name for p in (ckpt / "parts").iterdir() if p.is_dir()} == {"rank00000", "rank00001"}


@pytest.mark.parametrize(
    "overrides, key, theirs, ours",
    [
        # measured before the check: trained to the end without a word
        (["--embedding.optimizer=sgd"], "embedding.optimizer", "'sgd'", "'rowwise_adagrad'"),
        # hung until distributed.timeout_s
        (["--train.steps=6"], "train.steps", "6", "4"),
    ],
)
def test_ranks_running_different_configs_all_stop_naming_the_key(
    tmp_path, overrides, key, theirs, ours
):
    """torchrun gives each rank its own command line, and each node reads its own copy
    of a config file: a key that differs from rank 0's stops every rank at once."""
    start = time.monotonic()
    got = run_ranks(train_with_rank_overrides, 2, str(tmp_path), {1: overrides}, timeout=120)
    assert time.monotonic() - start < 25  # not distributed.timeout_s (30 s)
    want = f"ConfigError: config key '{key}': rank 1 runs {theirs} where rank 0 runs {ours}"
    assert all(g.startswith(want) for g in got), got
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_rank_local_keys_may_differ_and_a_rank_that_cannot_start_stops_the_others(tmp_path):
    local = ["--train.threads=1", "--train.host_memory=system", "--data.prefetch_batches=3"]
    got = run_ranks(train_with_rank_overrides, 2, str(tmp_path / "a"), {1: local}, timeout=120)
    assert got == ["ok", "ok"]
    start = time.monotonic()
    missing = ["--data.path=" + str(tmp_path / "nowhere")]
    got = run_ranks(train_with_rank_overrides, 2, str(tmp_path / "b"), {1: missing}, timeout=120)
    assert time.monotonic() - start < 25  # rank 0 is told, not left waiting for rank 1
    assert got[1].startswith("DatasetError: ") and "nowhere" in got[1], got
    assert got[0].startswith("RankFailed: rank 1 could not set up its run: DatasetError: "), got


def test_ranks_on_nodes_of_different_memory_plan_alike(tmp_path):
    """Each rank sizes the planner's budget from its own node: given 1 GB and 150 kB
    a rank, the debug model's tables were replicated on one rank and split by rows on
    the other (a failed or silently wrong exchange). Every rank plans with the smallest
    budget: the run equals one where both ranks have 150 kB."""
    small = 150_000
    mixed = run_ranks(train_with_rank_memory, 2, str(tmp_path / "a"), {0: 10**9, 1: small})
    even = run_ranks(train_with_rank_memory, 2, str(tmp_path / "b"), {0: small, 1: small})
    assert mixed[0] == mixed[1] == even[0]


def test_checkpoints_by_the_clock_are_taken_by_every_rank_at_one_step(tmp_path):
    """``checkpoint.every_minutes`` reads each rank's own clock, started at its own
    moment: at the step where rank 0's said "due" and rank 1's not yet, rank 0 began a
    save and waited for rank 1's part. Any rank's clock now decides for all."""
    every = ["--checkpoint.every_minutes=0.0005", "--train.steps=20"]  # every 30 ms
    got = run_ranks(train_with_rank_overrides, 2, str(tmp_path), {0: every, 1: every}, timeout=120)
    assert got == ["ok", "ok"]
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved  # several by the clock, the last ones kept
    for ckpt in saved:
        parts = {p.name for p in (ckpt / "parts").iterdir() if p.is_dir()}
        assert parts == {"rank00000", "rank00001"}, ckpt


def test_two_ranks_on_the_ssd_tier_train_like_one(tmp_path):
    """Tiers under sharding: each rank's shards on a file and a cache of its own, the
    same AUC as one process with the same placement."""
    tier = [
        "--embedding.placement=ssd",
        "--embedding.cache_bytes=150000",
        "--train.steps=60",
        "--data.max_ids_per_feature=2",
    ]
    ranks = [*tier, f"--embedding.ssd_dir={tmp_path / 'ssd'}"]
    got = run_ranks(train_with_rank_overrides, 2, str(tmp_path), {0: ranks, 1: ranks}, timeout=120)
    assert got == ["ok", "ok"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["embedding_cache"]["lookups"] > 0
    assert metrics["embedding_cache"]["hit_rate"] < 1.0  # the cache is smaller than the tables
    assert sorted(p.name for p in (tmp_path / "ssd").iterdir()) == ["rank00000", "rank00001"]
    one = [*tier, f"--embedding.ssd_dir={tmp_path / 'ssd1'}", "--train.progress=false"]
    cfg = load_config("debug", [*one, "--train.save_model=false", "--train.device=cpu"])
    single = train(cfg, None, echo=lambda _m: None)
    assert metrics["auc"] == pytest.approx(single["auc"], abs=1e-4)
    assert metrics["logloss"] == pytest.approx(single["logloss"], abs=1e-4)
