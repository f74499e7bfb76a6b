"""Checkpoints: bitwise resume, incremental chains, corruption, kill -9 mid-save, quantization."""

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import error_line, make_dataset, run_cli

from recscale.checkpoint.format import CheckpointError, verify
from recscale.checkpoint.manager import checkpoint_dirs, resolve_chain
from recscale.checkpoint.state import restore
from recscale.checkpoint.stored_rows import dequantize_int8, quantize_int8
from recscale.config import load_config
from recscale.distributed.spawn import process_context
from recscale.models.dlrm import build_model
from recscale.train.optimizers import build_dense_optimizer
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)
BASE = [
    "--train.progress=false",
    "--train.log_every=5",
    "--data.eval_samples=2048",
    "--checkpoint.every_steps=20",
    "--checkpoint.full_every=2",
    "--checkpoint.full_if_fraction=1.0",
    "--checkpoint.keep=10",
]


def _state(run_dir: Path) -> dict:
    """The trained model's state: its final checkpoint loaded into a plain model."""
    cfg = load_config(str(run_dir / "config.toml"))
    model = build_model(cfg.model, cfg.embedding, seed=123)  # every value must come from disk
    restore(model, None, resolve_chain(run_dir, echo=lambda _m: None))
    return model.state_dict()


def _losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())
    }


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("ckds"), 3000, seed=4, hash_size=500)


@pytest.mark.parametrize("source", ["synthetic", "dataset"])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_resume_is_bitwise_identical(tmp_path, source, optimizer, small_dataset):
    extra = [f"--embedding.optimizer={optimizer}", "--optimizer.name=adam"]
    if optimizer == "adam":
        extra.append("--embedding.lr=0.01")
    if source == "dataset":  # 3000 rows / 256 = 11 batches per epoch: resume lands mid-epoch
        extra += [
            f"--data.path={small_dataset}",
            "--data.eval_split=train",
            "--data.block_rows=700",
        ]
    full = load_config("debug", [*BASE, *extra, "--train.steps=60"])
    train(full, tmp_path / "a", **QUIET)
    part = load_config("debug", [*BASE, *extra, "--train.steps=40"])
    train(part, tmp_path / "b", **QUIET)
    kinds = [
        json.loads((d / "manifest.json").read_text())["kind"]
        for d in checkpoint_dirs(tmp_path / "b/checkpoints")
    ]
    assert kinds == ["full", "incremental"]  # the restored state comes from a chain
    cont = load_config("debug", [*BASE, *extra, "--train.steps=60"])
    m = train(cont, tmp_path / "b", resume=tmp_path / "b", **QUIET)
    assert m["resumed_from_step"] == 40 and m["steps"] == 60
    a, b = _state(tmp_path / "a"), _state(tmp_path / "b")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert all(la[s] == lb[s] for s in range(45, 61, 5))


def test_resuming_a_dataset_run_at_another_batch_says_what_it_rereads(tmp_path, small_dataset):
    """A dataset's position is the step times the batch: resumed at half the batch, the
    run read half the checkpoint's samples again, without a word. It is said where the
    run resumes (and not at the same batch, nor on synthetic data, drawn by step)."""
    data = [f"--data.path={small_dataset}", "--data.eval_split=train"]
    over = [*BASE, "--train.batch_size=128", "--checkpoint.every_steps=4"]
    train(load_config("debug", [*over, *data, "--train.steps=4"]), tmp_path / "d", **QUIET)
    train(load_config("debug", [*over, "--train.steps=4"]), tmp_path / "s", **QUIET)
    for i, (run, extra, said) in enumerate(
        [
            (
                "d",
                [*data, "--train.batch_size=64"],
                "reads from sample 256 of its stream where "
                "the checkpoint had read 512 (256 samples read again",
            ),
            ("d", [*data, "--train.batch_size=512"], "(1,536 samples skipped"),
            ("d", data, None),
            ("s", ["--train.batch_size=64"], None),
        ]
    ):
        lines: list[str] = []
        cfg = load_config("debug", [*over, *extra, "--train.steps=5"])
        train(cfg, tmp_path / f"{run}{i}", resume=tmp_path / run, echo=lines.append)
        notes = [line for line in lines if "where the checkpoint trained at 128" in line]
        assert (notes == []) if said is None else (said in notes[0]), (extra, lines)


def test_incremental_chain_restores_the_full_state(tmp_path):
    cfg = load_config("debug", [*BASE, "--train.steps=60", "--checkpoint.full_every=3"])
    train(cfg, tmp_path, **QUIET)
    newest = checkpoint_dirs(tmp_path / "checkpoints")[-1]
    chain = resolve_chain(tmp_path, **QUIET)
    assert len(chain) >= 2 and chain[0].name == "step_00000020"
    assert json.loads((newest / "manifest.json").read_text())["kind"] == "incremental"
    incr = sum(
        t["stored_rows"] for t in json.loads((newest / "manifest.json").read_text())["tables"]
    )
    assert 0 < incr < sum(cfg.model.table_sizes)  # only touched rows were written
    model = build_model(
        cfg.model, cfg.embedding, seed=99
    )  # different init: everything must come from disk
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    assert restore(model, opt, chain)["step"] == 60
    saved = _state(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_corruption_is_detected_and_resume_falls_back(tmp_path):
    cfg = load_config("debug", [*BASE, "--train.steps=40", "--checkpoint.full_every=1"])
    train(cfg, tmp_path, **QUIET)
    newest = checkpoint_dirs(tmp_path / "checkpoints")[-1]
    victim = next((newest / "parts").rglob("C3.*.weight.f32"))  # parts/rank00000/C3.r0-N.c0-D...
    data = bytearray(victim.read_bytes())
    data[5] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"C3\.r0-\d+\.c0-\d+\.weight\.f32: checksum mismatch"
    ):
        verify(newest)
    messages = []
    chain = resolve_chain(tmp_path, echo=messages.append)
    assert chain[-1].name == "step_00000020" and "step_00000040" in messages[0]
    next((newest / "parts").rglob("C4.*.weight.f32")).write_bytes(b"short")  # truncated file
    with pytest.raises(CheckpointError, match=r"C4\.r0-\d+\.c0-\d+\.weight\.f32: 5 bytes"):
        verify(newest, checksums=False)
    r = run_cli("checkpoint", "inspect", str(tmp_path), "--json")
    assert r.returncode == 1
    infos = json.loads(r.stdout)
    assert [i["valid"] for i in infos] == [True, False]


CRASH_TABLES = ["--model.table_sizes=" + ",".join(["30000"] * 26)]


def save_forever(root: str, saved) -> None:
    """Fill every table with the step's value and save a full checkpoint, step after
    step, until killed; ``saved`` is set once the first save completed."""
    from recscale.checkpoint.manager import CheckpointManager

    cfg = load_config(
        "debug",
        [
            *CRASH_TABLES,
            "--checkpoint.every_steps=1",
            "--checkpoint.async_write=false",
            "--checkpoint.keep=2",
            "--checkpoint.full_every=1",
        ],
    )
    model = build_model(cfg.model, cfg.embedding)
    opt = build_dense_optimizer(cfg.optimizer, model.dense_parameters())
    mgr = CheckpointManager(cfg.checkpoint, Path(root), model, opt)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for g in model.embeddings.groups:
                g.storage.weight.fill_(float(step))
        mgr.save(step, {"step": step})
        saved.set()


def test_sigkill_during_save_never_loses_the_last_good_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    rng = random.Random(0)
    cfg = load_config("debug", CRASH_TABLES)
    ctx = process_context()  # a fork of a server that imported torch: no 2-3 s import a trial
    # restarts re-save steps 1, 2, ... over older checkpoints of the same steps
    for trial in range(8):
        saved = ctx.Event()
        proc = ctx.Process(target=save_forever, args=(str(root), saved))
        proc.start()
        assert saved.wait(timeout=120)  # at least one checkpoint completed in this process
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        chain = resolve_chain(root, **QUIET)
        model = build_model(cfg.model, cfg.embedding)
        step = restore(model, None, chain)["step"]
        # The restored tables hold exactly the value written at that step: a complete checkpoint.
        w = model.embeddings.groups[0].storage.weight
        assert float(w.min()) == float(w.max()) == float(step), trial


def test_int8_and_fp16_round_trip_bounds():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, size=(1000, 16)).astype(np.float32)
    w[3] = 0.25  # a constant row
    q, qp = quantize_int8(w)
    back = dequantize_int8(q, qp)
    step = (w.max(axis=1) - w.min(axis=1)) / 255
    assert np.all(np.abs(back - w) <= step[:, None] / 2 + 1e-7)
    np.testing.assert_array_equal(back[3], w[3])
    # one byte per value + an fp32 scale and bias per row
    assert q.nbytes + qp.nbytes == 1000 * (16 + 8)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_quantized_checkpoint_resumes_with_quality(tmp_path, precision):
    base = [*BASE, "--train.steps=300", "--checkpoint.every_steps=150", "--data.eval_samples=8192"]
    ref = train(load_config("debug", base), tmp_path / "ref", **QUIET)
    train(
        load_config(
            "debug",
            [
                *base[:-3],
                "--train.steps=150",
                "--checkpoint.every_steps=150",
                f"--checkpoint.precision={precision}",
            ],
        ),
        tmp_path / "q",
        **QUIET,
    )
    m = train(load_config("debug", base), tmp_path / "q", resume=tmp_path / "q", **QUIET)
    assert abs(m["auc"] - ref["auc"]) < 0.01
    manifest = json.loads(
        (checkpoint_dirs(tmp_path / "q/checkpoints")[0] / "manifest.json").read_text()
    )
    assert manifest["precision"] == precision
    fp32 = json.loads(
        (checkpoint_dirs(tmp_path / "ref/checkpoints")[0] / "manifest.json").read_text()
    )

    def row_bytes(m):
        return sum(f["bytes"] for n, f in m["files"].items() if ".weight." in n or ".qparams." in n)

    rows, dim = sum(t["num_rows"] for t in fp32["tables"]), fp32["tables"][0]["dim"]
    assert row_bytes(fp32) == rows * dim * 4
    assert row_bytes(manifest) == rows * (dim * 2 if precision == "fp16" else dim + 8)


def test_keep_last_k(tmp_path):
    cfg = load_config(
        "debug", [*BASE, "--train.steps=100", "--checkpoint.keep=2", "--checkpoint.full_every=1"]
    )
    train(cfg, tmp_path, **QUIET)
    assert [p.name for p in checkpoint_dirs(tmp_path / "checkpoints")] == [
        "step_00000080",
        "step_00000100",
    ]


def test_cli_resume_from_run_dir(tmp_path):
    run = tmp_path / "run"
    r = run_cli(
        "train",
        "--config",
        "debug",
        "--train.steps=40",
        "--checkpoint.every_steps=20",
        "--train.progress=false",
        "--run-dir",
        str(run),
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("train", "--resume", str(run), "--train.steps=60", "--train.progress=false")
    assert r.returncode == 0, r.stderr
    assert (
        "resumed from" in r.stdout and json.loads((run / "metrics.json").read_text())["steps"] == 60
    )


def test_crash_between_replacement_renames_recovers_the_old_checkpoint(tmp_path):
    cfg = load_config("debug", [*BASE, "--train.steps=20", "--checkpoint.full_every=1"])
    train(cfg, tmp_path, **QUIET)
    root = tmp_path / "checkpoints"
    # The state a kill leaves after "move the old step_20 aside" and before "rename the new one in".
    os.rename(root / "step_00000020", root / ".step_00000020.old-12345")
    (root / ".step_00000020.tmp-12345").mkdir()
    chain = resolve_chain(tmp_path, **QUIET)
    assert [p.name for p in chain] == ["step_00000020"]
    assert not list(root.glob(".step_00000020.old-*"))


def test_eval_from_newest_checkpoint_without_model_file(tmp_path):
    cfg = load_config("debug", [*BASE, "--train.steps=40", "--train.save_model=false"])
    m = train(cfg, tmp_path, **QUIET)
    assert not (tmp_path / "model.pt").exists()
    r = run_cli("eval", "--model", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    assert "step_00000040" in r.stderr and json.loads(r.stdout)["auc"] == pytest.approx(m["auc"])


def test_eval_scores_the_checkpoint_it_is_given(tmp_path):
    """``eval --model RUN/checkpoints/step_N`` scores that checkpoint (an earlier one than
    the final model): its metrics are those of a run trained for N steps alone, written
    beside the final model's; ``RUN/checkpoints`` scores the newest; a checkpoint with no
    run above it is one line."""
    run = tmp_path / "run"
    train(
        load_config("debug", [*BASE, "--train.steps=40", "--checkpoint.every_steps=20"]),
        run,
        **QUIET,
    )
    short = train(load_config("debug", [*BASE, "--train.steps=20"]), tmp_path / "short", **QUIET)
    r = run_cli("eval", "--model", str(run / "checkpoints" / "step_00000020"), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["auc"] == short["auc"] and got["logloss"] == short["logloss"]
    assert json.loads((run / "eval_synthetic-eval_step_00000020.json").read_text()) == got
    final = json.loads((run / "metrics.json").read_text())
    r = run_cli("eval", "--model", str(run / "checkpoints"), "--json")
    assert r.returncode == 0 and "step_00000040" in r.stderr, r.stderr
    assert json.loads(r.stdout)["auc"] == final["auc"] != got["auc"]
    lone = tmp_path / "lone"
    lone.mkdir()
    os.rename(run / "checkpoints" / "step_00000020", lone / "step_00000020")
    r = run_cli("eval", "--model", str(lone / "step_00000020"))
    assert r.returncode == 1 and "above the checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_eval_scores_in_the_precision_the_run_trained_in(tmp_path):
    """A bf16 run's evaluations run under bf16 autocast; ``recscale eval`` scored it in
    fp32 (its calibration 1.087 against the run's 1.086). It scores in the run's
    ``train.precision`` - the run's own metrics, bit for bit - and an override of it
    applies and is recorded."""
    cfg = load_config("debug", [*BASE, "--train.steps=30", "--train.precision=bf16"])
    m = train(cfg, tmp_path, **QUIET)
    r = run_cli("eval", "--model", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["precision"] == "bf16"
    assert [got[k] for k in ("auc", "logloss", "calibration")] == [
        m[k] for k in ("auc", "logloss", "calibration")
    ]
    r = run_cli("eval", "--model", str(tmp_path), "--json", "--train.precision=fp32")
    fp32 = json.loads(r.stdout)
    assert fp32["precision"] == "fp32" and fp32["logloss"] != m["logloss"]
    assert fp32["logloss"] == pytest.approx(m["logloss"], rel=1e-2)


@pytest.mark.parametrize(
    "override, says",
    [
        ("--embedding.optimizer=adam", "resume with the embedding.optimizer"),
        ("--model.top_mlp=64,1", "differ from the checkpoint's (resume with the model.bottom_mlp"),
    ],
)
def test_a_config_that_fits_no_checkpoint_is_said_once(tmp_path, override, says):
    """A resume under a config no checkpoint of the run fits (another embedding
    optimizer, another MLP) printed "skipping checkpoint ..." for each checkpoint in
    turn, as if each were damaged, and then the newest one's reason again; a changed
    MLP named only state keys ('top.layers.4.bias'). It is one error naming the config
    keys, and nothing is skipped (a damaged newest checkpoint is still passed over:
    test_hostile_files.py)."""
    from recscale.checkpoint.format import CheckpointError

    run = tmp_path / "run"
    train(load_config("debug", [*BASE, "--train.steps=20", "--checkpoint.every_steps=10"]), run)
    lines: list[str] = []
    cfg = load_config("debug", [*BASE, "--train.steps=30", override])
    with pytest.raises(CheckpointError, match="checkpoints/step_") as err:
        train(cfg, run, resume=run, echo=lines.append)
    assert says in str(err.value)
    assert not [x for x in lines if "skipping" in x], lines


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_record(tmp_path):
    """`train --resume RUN` on a run that finished at or past train.steps used to train 0
    steps and overwrite metrics.json (its throughput 0, its checkpoint history gone): it
    now says so and leaves the run as it is; a larger train.steps continues it."""
    run = tmp_path / "run"
    base = ["--train.progress=false", "--data.eval_samples=1024"]
    r = run_cli("train", "--config", "debug", "--train.steps=8", *base, f"--run-dir={run}")
    assert r.returncode == 0, r.stderr
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for extra in ([], ["--train.steps=5"]):
        r = run_cli("train", "--resume", str(run), *extra)
        assert r.returncode == 0 and "finished at step 8" in r.stderr, r.stderr
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    # an earlier checkpoint of the run, named: its branch needs a directory of its own
    (ckpt,) = (run / "checkpoints").iterdir()
    r = run_cli("train", "--resume", str(ckpt), "--train.steps=5")
    assert r.returncode == 0 and f"to train on from {ckpt}, give it a --run-dir" in r.stderr
    r = run_cli("train", "--resume", str(run), "--train.steps=10", *base)
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "metrics.json").read_text())["steps"] == 10


def test_a_run_written_before_a_key_rule_still_evaluates_and_resumes(tmp_path, capsys):
    """A key refused where it cannot act (an ssd tier's keys with the tables in memory)
    was accepted before that rule: a run trained so keeps it in its config.toml, and
    eval and --resume read that file back. They still run (the value, which never
    acted, goes back to its default); the same key given to them now is refused."""
    from recscale.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--config", "debug", "--run-dir", str(run), "--train.steps=4"]) == 0
    toml = run / "config.toml"
    toml.write_text(
        toml.read_text()
        .replace('ssd_dir = ""', 'ssd_dir = "/tmp/old"')
        .replace("cache_bytes = 0", "cache_bytes = 100000")
    )
    assert 'ssd_dir = "/tmp/old"' in toml.read_text()
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] > 0
    assert main(["train", "--resume", str(run), "--train.steps=6"]) == 0
    assert json.loads((run / "metrics.json").read_text())["steps"] == 6
    assert 'ssd_dir = ""' in toml.read_text() and "cache_bytes = 0" in toml.read_text()
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--embedding.ssd_dir=/tmp/new"]) == 2
    assert "'embedding.ssd_dir'" in error_line(capsys.readouterr().err)
