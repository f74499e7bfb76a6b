"""Slipstream on the ssd/host tiers: a hot row that stopped moving has its update
skipped for one interval (exactly the update of the batch without its ids), is trained
again the interval after, and the skips are counted and reported."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli

from recscale.config import load_config
from recscale.config.errors import ConfigError
from recscale.embedding.cached_storage import CachedStorage
from recscale.embedding.optimizers import SparseRowwiseAdagrad, SparseSGD


def _host_storage(optimizer, pin=40):
    st = CachedStorage(100, 4, optimizer, None, 50, kernel="torch")
    st.write_rows(
        torch.arange(100), torch.randn(100, 4, generator=torch.Generator().manual_seed(0))
    )
    st.warm(torch.arange(50), pin=pin)
    return st


def _update(st, rows: list[int], grads: torch.Tensor, features: int = 2):
    """One update of ``rows`` (one id a bag, split into ``features`` segments)."""
    r = torch.tensor(rows, dtype=torch.int64)
    n = len(rows)
    seg = torch.linspace(0, n, features + 1).long()
    st.apply_pooled_gradients(r, seg, torch.arange(n), None, grads)


@pytest.mark.parametrize("make_opt", [lambda: SparseSGD(0.1), lambda: SparseRowwiseAdagrad(0.1)])
def test_stale_rows_skip_one_interval_exactly_as_the_batch_without_them(make_opt):
    slip, ref = _host_storage(make_opt()), _host_storage(make_opt())
    slip.enable_slipstream(threshold=0.01, interval=2)
    moving, resting = list(range(10)), list(range(10, 20))
    g = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    zero_rest = torch.cat([g[:10], torch.zeros(10, 4)])
    for _ in range(2):  # rows 10-19 get zero gradients: they do not move
        _update(slip, moving + resting, zero_rest)
        _update(ref, moving + resting, zero_rest)
    assert torch.equal(slip.read_rows(torch.arange(100)), ref.read_rows(torch.arange(100)))
    # step 3: 10-19 are stale - skipped; the reference is given the batch without them
    _update(slip, moving + resting, g)
    _update(ref, moving, g[:10])
    assert slip.stats.skipped == 10 and slip.stats.id_updates == 60
    assert torch.equal(slip.read_rows(torch.arange(100)), ref.read_rows(torch.arange(100)))
    every = torch.arange(100)
    for name in slip.state_names:  # Adagrad's sums: skipped rows' state untouched too
        assert torch.equal(slip.read_state(every)[name], ref.read_state(every)[name])
    _update(slip, moving + resting, g)  # step 4: still stale; then measured again
    _update(ref, moving, g[:10])
    # step 5: the stale rows train again (a row is skipped at most every other interval)
    _update(slip, moving + resting, g)
    _update(ref, moving + resting, g)
    assert slip.stats.skipped == 20
    assert torch.equal(slip.read_rows(torch.arange(100)), ref.read_rows(torch.arange(100)))


def test_only_trained_hot_rows_are_judged_and_a_skipped_row_is_not_written_back():
    st = _host_storage(SparseSGD(0.1), pin=5)  # rows 0-4 pinned: the hot set
    st.enable_slipstream(threshold=0.5, interval=1)
    assert st.slipstream.hot.numel() == 5
    # rows 0-2 and 5-9 updated without moving; 3-4 not updated at all: of the hot rows
    # only 0-2 become stale (an untrained row has not converged)
    _update(st, [0, 1, 2, 5, 6, 7, 8, 9], torch.zeros(8, 4))
    st.cache_dirty.zero_()
    _update(st, list(range(10)), torch.ones(10, 4))
    assert st.stats.skipped == 3
    hot_slots = st.slot_of_row[torch.arange(3)].long()
    cold_slots = st.slot_of_row[torch.arange(3, 10)].long()
    assert not st.cache_dirty[hot_slots].any() and st.cache_dirty[cold_slots].all()


def test_slipstream_config_is_checked_and_the_run_reports_its_skips(tmp_path):
    with pytest.raises(ConfigError, match="embedding.slipstream"):
        load_config("debug", ["--embedding.slipstream=true"])  # tables in device memory
    with pytest.raises(ConfigError, match="slipstream_threshold"):
        load_config("debug", ["--embedding.placement=ssd", "--embedding.slipstream_threshold=2"])
    r = run_cli(
        "train",
        "--config",
        "debug",
        "--train.steps=120",
        "--embedding.placement=ssd",
        f"--embedding.ssd_dir={tmp_path / 'ssd'}",
        "--embedding.slipstream=true",
        "--embedding.slipstream_interval=10",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "hot rows watched" in out and "slipstream skipped" in out
    cache = json.loads((tmp_path / "run" / "metrics.json").read_text())["embedding_cache"]
    assert 0 < cache["skipped_updates"] < cache["id_updates"]
