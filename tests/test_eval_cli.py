"""``recscale eval`` on a trained run: its metrics reproduce the run's, and
``--predictions`` writes each scored row's probability (docs/checkpoints.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import error_line, run_cli, train_then_eval

from recscale.data.dataset import BatchLoader, BinaryDataset


def test_cli_preprocess_train_eval(tmp_path, medium_dataset):
    m, scored = train_then_eval(medium_dataset, tmp_path / "run", steps=20)
    assert m["count"] == 5000 and m["steps"] == 20
    assert scored["auc"] == pytest.approx(m["auc"])


def test_eval_writes_each_rows_probability_in_the_splits_order(tmp_path, medium_dataset):
    """``recscale eval --predictions``: one probability a row, in the split's row order,
    equal to the trained model's own forward over those rows; its brute-force AUC is the
    metrics' AUC; a path of no format or inside the dataset is refused, nothing written."""
    from recscale.checkpoint.manager import resolve_chain
    from recscale.checkpoint.state import restore
    from recscale.config import load_config
    from recscale.models.dlrm import build_model

    run = tmp_path / "run"
    args = ["--data.path", str(medium_dataset), "--train.progress=false", "--data.eval_split=train"]
    r = run_cli("train", "--config", "debug", *args, "--train.steps=20", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    npy, csv = tmp_path / "p.npy", tmp_path / "p.csv"
    for out in (npy, csv):
        r = run_cli("eval", "--model", str(run), "--split", "train", "--predictions", str(out))
        assert r.returncode == 0, r.stderr
        assert f"5,000 predictions -> {out}" in r.stdout
    metrics = json.loads((run / "eval_train.json").read_text())
    assert metrics["predictions"] == str(csv)
    probs = np.load(npy)
    assert probs.dtype == np.float32 and probs.shape == (5000,)
    lines = csv.read_text().splitlines()
    assert lines[0] == "label,probability" and len(lines) == 5001
    labels = np.array([int(x.split(",")[0]) for x in lines[1:]])
    np.testing.assert_allclose([float(x.split(",")[1]) for x in lines[1:]], probs, rtol=1e-6)
    ds = BinaryDataset(medium_dataset, "train")
    batch = next(iter(BatchLoader(ds, 5000, shuffle=False, drop_last=False, epochs=1)))
    np.testing.assert_array_equal(labels, batch.labels.numpy())
    cfg = load_config(str(run / "config.toml"))
    model = build_model(cfg.model, cfg.embedding, init_rows=False)
    restore(model, None, resolve_chain(run))  # the run's final checkpoint
    with torch.no_grad():
        want = torch.sigmoid(model.eval()(batch).double()).numpy()
    np.testing.assert_allclose(probs, want, rtol=1e-5, atol=1e-7)
    pos, neg = probs[labels == 1], probs[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert pairs / (pos.size * neg.size) == pytest.approx(metrics["auc"], abs=1e-6)
    for bad in (tmp_path / "p.txt", medium_dataset / "p.npy", run / "checkpoints" / "p.csv"):
        r = run_cli("eval", "--model", str(run), "--split", "train", "--predictions", str(bad))
        assert r.returncode == 2 and "--predictions" in error_line(r.stderr), r.stderr
        assert not bad.exists()


def test_eval_split_is_checked_in_place_of_the_runs_own(tmp_path, capsys):
    """``eval --data.path OTHER --split train`` of a run whose config scores 'test' (and
    'val' during training) was refused for OTHER's lack of those splits; the split named
    is the one checked (and one OTHER lacks is named under ``--split``)."""
    from recscale.cli.main import main
    from recscale.dataprep.criteo_tsv import synthetic_lines
    from recscale.dataprep.preprocess import PreprocessOptions, preprocess

    src = tmp_path / "in.tsv"
    src.write_text("\n".join(synthetic_lines(700, seed=3)) + "\n")
    for name, split in (("kaggle", "kaggle"), ("other", "none")):
        opts = PreprocessOptions(inputs=[src], out=tmp_path / name, hash_sizes=[50], split=split)
        preprocess(opts, echo=lambda s: None)
    run = tmp_path / "run"
    argv = ["train", "--config", "debug", f"--data.path={tmp_path / 'kaggle'}", "--run-dir"]
    steps = ["--train.steps=4", "--train.batch_size=64", "--train.eval_every=2"]
    assert main([*argv, str(run), *steps]) == 0
    capsys.readouterr()
    other = f"--data.path={tmp_path / 'other'}"
    assert main(["eval", "--model", str(run), other, "--split", "train", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 700
    assert main(["eval", "--model", str(run), other, "--split", "test"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "'--split'" in line and "no split 'test'" in line, line


def test_eval_refuses_keys_only_training_reads_and_takes_its_threads(tmp_path, capsys):
    """``eval --train.steps=5`` (or a learning rate, a checkpoint interval, the shuffle)
    ran and changed nothing, without a word; such a key is refused, named. The keys eval
    reads still go: its eval batch, and train.threads (torch's own count before)."""
    from recscale.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--config", "debug", "--run-dir", str(run), "--train.steps=2"]) == 0
    capsys.readouterr()
    for key in ("train.steps", "optimizer.lr", "checkpoint.keep", "embedding.lr", "data.shuffle"):
        assert main(["eval", "--model", str(run), f"--{key}=1"]) == 2
        line = error_line(capsys.readouterr().err)
        assert f"'{key}'" in line and "acts in training only" in line, line
    before = torch.get_num_threads()
    try:
        argv = ["eval", "--model", str(run), "--train.eval_batch_size=100", "--train.threads=1"]
        assert main([*argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["count"] > 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
