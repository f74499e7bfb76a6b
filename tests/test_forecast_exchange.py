"""A system whose tables shard rows by id modulo the ranks and exchange partial sums
(``System.exchange = "partials"``, Intel's MLPerf embedding) and whose input runs on
the training thread (``System.input_*``): the traffic against ids counted one by one,
and the forecast's stages against that arithmetic."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import run_cli

from recscale.config import load_config
from recscale.perfmodel.devices import device_spec
from recscale.perfmodel.exchange import INDEX_BYTES, partial_rows, partials_exchange_bytes
from recscale.perfmodel.forecast import forecast
from recscale.perfmodel.step_kernels import EFFICIENCY
from recscale.perfmodel.systems import IPEX, RECSCALE, System
from recscale.planner.from_config import table_infos


def _owned_pairs(ids: np.ndarray, w: int) -> np.ndarray:
    """ids [batch, tables, hotness]: for each rank, the (sample, table) pairs holding at
    least one id that rank owns (id % w)."""
    owner = ids % w
    return np.array([(owner == r).any(axis=2).sum() for r in range(w)])


@pytest.mark.parametrize("w", [2, 8])
def test_partial_rows_match_ids_counted_one_by_one(w):
    rng = np.random.default_rng(0)
    batch, hotness = 4096, [1, 3, 12]
    counted = np.zeros(w)
    for h in hotness:
        ids = rng.integers(0, 10_000_000, size=(batch, 1, h))
        counted += _owned_pairs(ids, w)
    expected = sum(partial_rows(batch, h, w) for h in hotness)
    assert counted.mean() == pytest.approx(expected, rel=0.01)
    assert counted.min() == pytest.approx(expected, rel=0.05)  # every rank alike


def test_exchange_bytes_count_rows_and_indices_sent_off_the_rank():
    rng = np.random.default_rng(1)
    w, batch, dims, hotness, wire = 4, 2048, [16, 32], [2, 5], 2
    fwd, bwd = partials_exchange_bytes(batch, hotness, dims, w, wire)
    # rank 0: forward, one partial row for each owned pair of the global batch, sent to
    # the sample's rank (samples [r B/w, (r+1) B/w) belong to rank r) unless it is rank 0
    sent_f = sent_b = 0
    for h, d in zip(hotness, dims):
        ids = rng.integers(0, 1_000_000, size=(batch, h))
        row = d * wire + INDEX_BYTES
        owned = (ids % w == 0).any(axis=1)
        to_other = np.arange(batch) >= batch // w
        sent_f += int((owned & to_other).sum()) * row
        mine = ids[: batch // w]  # rank 0's samples: each id's gradient to its owner
        sent_b += int((mine % w != 0).sum()) * row
    assert sent_f == pytest.approx(fwd, rel=0.03)
    assert sent_b == pytest.approx(bwd, rel=0.03)


def test_the_forecast_carries_the_partials_over_the_network_and_the_input_on_the_host():
    cfg = load_config("criteo_multihot_dcnv2", ["--train.batch_size=65536"])
    dev = replace(device_spec("spr-8480"), network_gbps=6.25)
    f = forecast(cfg, dev, 8, "bf16", IPEX)
    pooling = [float(h) for h in cfg.data.bag_sizes]
    dims = [cfg.model.embedding_dim] * len(pooling)
    eff = EFFICIENCY["cpu"]
    sent = sum(partials_exchange_bytes(65536, pooling, dims, 8, 2))
    wire_s = sent / (6.25e9 * eff.link)
    assert wire_s * 1e3 < f.stage_ms["all_to_all"] < wire_s * 1e3 + 1.0  # + latencies
    serial = IPEX.input_serial_s_per_id * 65536 * len(pooling)
    spread = IPEX.input_parallel_s_per_id * 65536 * sum(pooling) / dev.units
    assert f.stage_ms["host"] == pytest.approx((serial + spread) * 1e3)
    # the same step with the plan's pooled exchange and no input: less traffic, no host
    pooled = forecast(cfg, dev, 8, "bf16", replace(IPEX, exchange="pooled"))
    plain = replace(IPEX, exchange="pooled", input_serial_s_per_id=0, input_parallel_s_per_id=0)
    assert pooled.stage_ms["all_to_all"] < f.stage_ms["all_to_all"] / 3
    assert forecast(cfg, dev, 8, "bf16", plain).stage_ms["host"] == 0.0
    # recscale's own step is untouched by either
    assert RECSCALE.exchange == "pooled" and not RECSCALE.input_serial_s_per_id


def test_an_unknown_exchange_names_the_field():
    with pytest.raises(ValueError, match="System.exchange: 'gossip' is not one of pooled"):
        System("x", exchange="gossip")


def test_plan_says_how_the_system_runs_the_tables():
    args = ["plan", "--config", "criteo_multihot_dcnv2", "--device", "spr-8480"]
    r = run_cli(*args, "--world-size", "8", "--system", "ipex", "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    assert "system: Intel Extension for PyTorch" in r.stdout
    assert "every table's rows over the 8 devices by id modulo 8" in r.stdout
    own = run_cli(*args, "--world-size", "8")
    assert own.returncode == 0 and "system:" not in own.stdout and "modulo" not in own.stdout


def test_intels_variants_change_one_term_each():
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        from forecast_validation import evaluate, intel_variants
    finally:
        sys.path.remove(benchmarks)
    steps = dict(intel_variants())
    checked = next(r for r in evaluate() if r["system"] == "ipex")
    assert steps["as checked"] == pytest.approx(checked["step_ms"])
    # less traffic or less work: each variant's step is shorter than the checked one
    assert all(ms < checked["step_ms"] for name, ms in steps.items() if name != "as checked")


def test_the_partials_system_runs_every_table_row_wise_with_its_own_state():
    cfg = load_config("criteo_multihot_dcnv2", ["--train.batch_size=65536"])
    dev = replace(device_spec("spr-8480"), network_gbps=6.25)
    f = forecast(cfg, dev, 8, "bf16", IPEX)
    assert {p.kind for p in f.plan.placements} == {"row_wise"}
    assert all(p.ranks == list(range(8)) for p in f.plan.placements)
    # fp32 rows and a bf16 sum a value (element-wise Adagrad): 6 bytes a value
    values = sum(t.rows * t.dim for t in table_infos(cfg))
    assert f.table_bytes == pytest.approx(values * 6 / 8, rel=1e-6)
    rowwise = forecast(cfg, dev, 8, "bf16", replace(IPEX, table_state_bytes=None))
    assert rowwise.table_bytes < f.table_bytes
    assert rowwise.stage_ms["embedding_update"] < f.stage_ms["embedding_update"]
