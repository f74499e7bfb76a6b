"""Checkpoints are plan-independent: written at world size N, loaded at M under another plan.

1 -> 2 -> 4 ranks: a single-process checkpoint is restored on 2 row_wise ranks, which
train on and save; that is restored on 4 ranks under a mixed plan and saved again.
The 2-rank continuation equals uninterrupted single-process training, and the
4-rank hop changes nothing. The 2-rank run writes a full checkpoint and then an
increment, so the chain restored at 4 ranks is sharded full + sharded increment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_workers import checkpoint_hop, checkpoint_memory, global_batches, parity_config

from recscale.checkpoint.manager import CheckpointManager, checkpoint_dirs, resolve_chain
from recscale.checkpoint.state import restore
from recscale.cli.main import main
from recscale.config import CheckpointConfig
from recscale.distributed.spawn import run_ranks
from recscale.models.dlrm import build_model
from recscale.train.optimizers import build_dense_optimizer

K, B = 3, 64


def _single(steps: int, save_to: Path | None = None):
    cfg = parity_config("rowwise_adagrad")
    model = build_model(cfg.model, cfg.embedding, seed=0)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    batches, _ = global_batches(cfg, steps, B)
    for b in batches:
        loss = F.binary_cross_entropy_with_logits(model(b), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if save_to is not None:
        mgr = CheckpointManager(
            CheckpointConfig(every_steps=1, async_write=False), save_to, model, opt
        )
        mgr.save(steps, {"step": steps})
        mgr.wait()
    return model, opt


def _load(path: Path, table_sizes: list[int] | None = None):
    cfg = parity_config("rowwise_adagrad")
    if table_sizes is not None:
        cfg.model.table_sizes = table_sizes
    model = build_model(cfg.model, cfg.embedding, seed=1)  # other init: all must come from disk
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    restore(model, opt, resolve_chain(path, echo=lambda _m: None))
    return model


def _tensors(model):
    return {k: v for k, v in model.state_dict().items()}


def test_reshard_1_to_2_to_4(tmp_path: Path, capsys):
    _single(K, tmp_path / "w1")
    c1 = ",".join(str(p) for p in resolve_chain(tmp_path / "w1"))
    run_ranks(checkpoint_hop, 2, "row_wise", c1, str(tmp_path / "w2"), K, K, B, timeout=180)
    chain2 = resolve_chain(tmp_path / "w2")
    assert [p.name for p in chain2] == [f"step_{K + 1:08d}", f"step_{2 * K:08d}.inc"]
    c2 = ",".join(str(p) for p in chain2)
    run_ranks(checkpoint_hop, 4, "mixed", c2, str(tmp_path / "w4"), 2 * K, 0, B, timeout=180)

    assert main(["checkpoint", "inspect", str(tmp_path / "w4")]) == 0
    out = capsys.readouterr().out
    assert "written by 4 ranks" in out and "column_wise" in out and "; valid" in out

    uninterrupted = _tensors(_single(2 * K)[0])
    after_2 = _tensors(_load(tmp_path / "w2"))
    after_4 = _tensors(_load(tmp_path / "w4"))
    for k, v in uninterrupted.items():
        torch.testing.assert_close(
            after_2[k], v, atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}"
        )
        assert torch.equal(after_4[k], after_2[k]), k


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_two_rank_checkpoint_writes_one_part_per_rank_without_gathering(tmp_path: Path):
    """Each rank writes its own parts; rank 0's memory does not grow with rank 1's table
    (4M rows x 8 + row-wise state = 144 MB there)."""
    big = 4_000_000
    results = run_ranks(checkpoint_memory, 2, str(tmp_path / "ck"), big, timeout=240)
    (ck,) = checkpoint_dirs(tmp_path / "ck")
    parts = sorted(p.name for p in (ck / "parts").iterdir() if p.is_dir())
    assert parts == ["rank00000", "rank00001"]
    big_files = [p for p in (ck / "parts" / "rank00001").iterdir() if p.name.startswith("C1.")]
    assert sum(p.stat().st_size for p in big_files) == big * (8 + 1) * 4
    assert not any((ck / "parts" / "rank00000").glob("C1.*"))
    growth0 = next(r["growth"] for r in results if r["rank"] == 0)
    assert growth0 < 40e6, f"rank 0 grew by {growth0 / 1e6:.0f} MB during the save"
    # and it restores into one process, every row from rank 1's part
    model = _load(tmp_path / "ck", table_sizes=[big] + parity_config("sgd").model.table_sizes[1:])
    assert model.embeddings.groups[0].storage.weight.shape[0] > big
