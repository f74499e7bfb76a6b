"""Files an attacker or an accident plants where recscale reads and writes: every file is
confined to its run / checkpoint / ssd directory, no link is followed, only regular
files are opened, and a forged or damaged manifest is checked like data and falls back
to the previous good checkpoint (docs/reliability.md lists each guarantee)."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import error_line, forked_cli, run_cli

from recscale.checkpoint.format import CheckpointError, manifest_crc, verify
from recscale.checkpoint.manager import checkpoint_dirs, resolve_chain
from recscale.config import load_config
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)
BASE = ["--train.progress=false", "--data.eval_samples=2048", "--train.steps=20"]
CKPT = ["--checkpoint.every_steps=10", "--checkpoint.full_every=1"]


def _train_on_ssd(ssd: Path, run: Path) -> subprocess.CompletedProcess:
    args = ["--embedding.placement=ssd", f"--embedding.ssd_dir={ssd}", "--run-dir", str(run)]
    return forked_cli("train", "--config", "debug", *BASE, *args, timeout=60)


@pytest.fixture(scope="module")
def run_with_two_checkpoints(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ck") / "run"
    train(load_config("debug", [*BASE, *CKPT]), run, **QUIET)
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == [
        "step_00000010",
        "step_00000020",
    ]
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    subprocess.run(["cp", "-a", str(run), str(dst)], check=True)
    return dst


def _forge(ck: Path, edit) -> None:
    """Edit the manifest as a forger would: the file CRCs and the manifest's own CRC
    recomputed, so only the checks on what the manifest says can catch it."""
    m = json.loads((ck / "manifest.json").read_text())
    edit(m)
    m["manifest_crc32"] = manifest_crc(m)
    (ck / "manifest.json").write_text(json.dumps(m))


def _first_weight_file(m: dict) -> str:
    return next(n for n in m["files"] if n.endswith(".weight.f32"))


def _forge_file(ck: Path, name: str, values: np.ndarray) -> None:
    """Rewrite part file ``name`` with ``values``, its CRC recomputed in a forged manifest."""
    values.tofile(ck / name)
    data = (ck / name).read_bytes()

    def files(m):
        m["files"][name]["crc32"] = zlib.crc32(data)

    _forge(ck, files)


def _resumes_past(run: Path, skipped_name: str, why: str, extra: tuple[str, ...] = ()) -> None:
    """Resuming ``run`` skips checkpoint ``skipped_name`` in one line naming ``why`` and
    continues from step 10."""
    lines: list[str] = []
    cfg = load_config("debug", [*BASE, *extra, "--train.steps=30"])
    m = train(cfg, run, resume=run, echo=lines.append)
    assert m["resumed_from_step"] == 10
    skipped = [x for x in lines if f"skipping checkpoint {skipped_name}:" in x]
    assert len(skipped) == 1 and why in skipped[0] and "\n" not in skipped[0], lines


# -- the ssd tier's file --------------------------------------------------------------


def test_a_planted_symlink_in_the_ssd_dir_is_not_written_through(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    (ssd / "tables_dim8.f32").symlink_to(victim)
    r = _train_on_ssd(ssd, tmp_path / "run")
    assert r.returncode == 1 and "symbolic link" in error_line(r.stderr)
    assert victim.read_text() == "keep me"


def test_a_fifo_in_the_ssd_dir_is_refused_not_opened(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    os.mkfifo(ssd / "tables_dim8.f32")
    r = _train_on_ssd(ssd, tmp_path / "run")
    assert r.returncode == 1 and "not a regular file" in error_line(r.stderr)


# -- checkpoints: confinement ------------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_manifest_cannot_make_a_restore_read_outside_the_checkpoint(
    run_with_two_checkpoints, tmp_path, how
):
    run = _copy(run_with_two_checkpoints, tmp_path)
    ck = run / "checkpoints" / "step_00000020"
    m = json.loads((ck / "manifest.json").read_text())
    name = _first_weight_file(m)
    outside = tmp_path / "outside.weight.f32"
    outside.write_bytes((ck / name).read_bytes())  # same size and CRC: only the path differs
    if how == "symlink":
        (ck / name).unlink()
        (ck / name).symlink_to(outside)
    else:
        target = str(outside) if how == "absolute" else "../../../outside.weight.f32"

        def edit(m):
            m["files"][target] = m["files"].pop(name)
            for t in m["tables"]:
                for p in t["parts"]:
                    if name.startswith(p["prefix"] + "."):
                        p["prefix"] = target[: -len(".weight.f32")]

        _forge(ck, edit)
    with pytest.raises(CheckpointError, match="outside (it|the checkpoint)|symbolic link"):
        verify(ck)
    messages: list[str] = []
    assert resolve_chain(run, messages.append)[-1].name == "step_00000010"
    assert len(messages) == 1 and "step_00000020" in messages[0]
    r = run_cli("checkpoint", "inspect", str(ck))
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout


def test_a_fifo_named_in_a_manifest_does_not_hang_inspect_or_resume(
    run_with_two_checkpoints, tmp_path
):
    run = _copy(run_with_two_checkpoints, tmp_path)
    ck = run / "checkpoints" / "step_00000020"
    (ck / "trainer.json").unlink()
    os.mkfifo(ck / "trainer.json")
    r = forked_cli("checkpoint", "inspect", str(ck), timeout=60)
    assert r.returncode == 1 and "not a regular file" in r.stdout + r.stderr
    r = forked_cli("train", "--resume", str(run), "--train.steps=30", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "skipping checkpoint step_00000020" in out and "not a regular file" in out
    assert "resumed from" in out and "step_00000010" in out


# -- checkpoints: the manifest checked like the data ----------------------------------------


def test_an_edited_manifest_fails_its_own_checksum(run_with_two_checkpoints, tmp_path):
    run = _copy(run_with_two_checkpoints, tmp_path)
    ck = run / "checkpoints" / "step_00000020"
    m = json.loads((ck / "manifest.json").read_text())
    m["step"] = 19  # edited without recomputing the CRC (a damaged disk does this)
    (ck / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="checksum"):
        verify(ck)


def _drop_table(m):
    dropped = m["tables"].pop(0)
    for p in dropped["parts"]:
        for n in [n for n in m["files"] if n.startswith(p["prefix"] + ".")]:
            del m["files"][n]


def _shift_rows(m):
    p = m["tables"][0]["parts"][0]
    p["row_lo"], p["row_hi"] = p["row_lo"] + 1, p["row_hi"] + 1


def _overlap(m):
    t = next(t for t in m["tables"] if t["num_rows"] > 2)
    t["parts"][0]["row_hi"] -= 1
    t["parts"][0]["stored_rows"] -= 1


def _bad_shape(m):
    name = _first_weight_file(m)
    m["files"][name]["bytes"] += 4


@pytest.mark.parametrize("edit", [_drop_table, _shift_rows, _overlap, _bad_shape])
def test_a_forged_manifest_falls_back_to_the_previous_checkpoint(
    run_with_two_checkpoints, tmp_path, edit
):
    run = _copy(run_with_two_checkpoints, tmp_path)
    _forge(run / "checkpoints" / "step_00000020", edit)
    _resumes_past(run, "step_00000020", "")


def test_checkpoints_of_the_previous_format_still_load(run_with_two_checkpoints, tmp_path):
    """Format 2 had no manifest CRC: such a checkpoint verifies and resumes."""
    run = _copy(run_with_two_checkpoints, tmp_path)
    for ck in checkpoint_dirs(run / "checkpoints"):
        m = json.loads((ck / "manifest.json").read_text())
        del m["manifest_crc32"]
        m["format_version"] = 2
        (ck / "manifest.json").write_text(json.dumps(m))
    m = train(load_config("debug", [*BASE, "--train.steps=30"]), run, resume=run, **QUIET)
    assert m["resumed_from_step"] == 20


@pytest.mark.parametrize(
    "text, why",
    [
        ("[]", "step None"),
        ('{"step": "abc"}', "step 'abc'"),
        ('{"step": -5}', "step -5"),
        ('{"step": 19}', "step 19"),  # another step than the manifest's 20
        ('{"step": 20, "torch_rng": "!!!"}', "not base64"),
        ('{"step": 20, "torch_rng": "AAAA"}', "not a generator state"),
        ("not json", "not JSON"),
    ],
)
def test_a_forged_trainer_state_falls_back_to_the_previous_checkpoint(
    run_with_two_checkpoints, tmp_path, text, why
):
    """``trainer.json`` with its CRCs recomputed: a list or a text step was a traceback, a
    step of -5 (or one the manifest does not say) resumed there, a generator state that
    is none a traceback from torch."""
    run = _copy(run_with_two_checkpoints, tmp_path)
    ck = run / "checkpoints" / "step_00000020"
    (ck / "trainer.json").write_text(text)

    def edit(m):
        m["files"]["trainer.json"] = {
            "bytes": len(text.encode()),
            "crc32": zlib.crc32(text.encode()),
        }

    _forge(ck, edit)
    r = run_cli("checkpoint", "inspect", str(ck))
    assert r.returncode == 1 and "INVALID" in r.stdout and why in r.stdout, r.stdout + r.stderr
    _resumes_past(run, "step_00000020", why)


def _dense_empty(d):
    return {}


def _dense_list(d):
    return [1, 2]


def _dense_no_layer(d):
    d["model"].pop("bottom.layers.0.weight")
    return d


def _dense_shape(d):
    d["model"]["bottom.layers.0.weight"] = torch.zeros(3, 3)
    return d


def _dense_nan(d):
    d["model"]["top.layers.0.weight"] = torch.full_like(d["model"]["top.layers.0.weight"], 1e400)
    return d


@pytest.mark.parametrize(
    "edit, why",
    [
        (_dense_empty, "no dense weights"),
        (_dense_list, "no dense weights"),
        (_dense_no_layer, "lacks ['bottom.layers.0.weight']"),  # had kept the initial layer
        (_dense_shape, "is (3, 3)"),
        (_dense_nan, "NaN or infinite"),  # trained on, a dead layer behind fused ReLUs
    ],
)
def test_forged_dense_weights_fall_back_to_the_previous_checkpoint(
    run_with_two_checkpoints, tmp_path, edit, why
):
    run = _copy(run_with_two_checkpoints, tmp_path)
    ck = run / "checkpoints" / "step_00000020"
    buf = io.BytesIO()
    torch.save(edit(torch.load(ck / "dense.pt", weights_only=True)), buf)
    data = buf.getvalue()
    (ck / "dense.pt").write_bytes(data)

    def files(m):
        m["files"]["dense.pt"] = {"bytes": len(data), "crc32": zlib.crc32(data)}

    _forge(ck, files)
    _resumes_past(run, "step_00000020", why)


def test_a_checkpoint_with_nan_rows_falls_back_to_the_previous_one(
    run_with_two_checkpoints, tmp_path
):
    """NaN rows (CRCs recomputed) had resumed, and the run stopped at its first step
    advising lower learning rates."""
    run = _copy(run_with_two_checkpoints, tmp_path)
    ck = run / "checkpoints" / "step_00000020"
    m = json.loads((ck / "manifest.json").read_text())
    name = _first_weight_file(m)
    rows = np.fromfile(ck / name, np.float32)
    rows[3] = np.nan
    _forge_file(ck, name, rows)
    _resumes_past(run, "step_00000020", "NaN or infinite")


@pytest.fixture(scope="module")
def run_with_an_increment(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("inc") / "run"
    ckpt = ["--checkpoint.every_steps=10", "--checkpoint.full_every=2"]
    ckpt += ["--checkpoint.full_if_fraction=1.0"]  # the debug tables are small
    train(load_config("debug", [*BASE, *ckpt]), run, **QUIET)
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == [
        "step_00000010",
        "step_00000020.inc",
    ]
    return run


def _row_out_of_part(rows, hi):
    rows[0] = hi + 7


def _negative_row(rows, hi):
    rows[-1] = -5


def _repeated_row(rows, hi):
    rows[1] = rows[0]


@pytest.mark.parametrize(
    "edit, why",
    [
        (_row_out_of_part, "outside its part's rows"),  # had been dropped without a word
        (_negative_row, "names row -5"),
        (_repeated_row, "not strictly increasing"),  # one row restored twice
    ],
)
def test_an_increment_naming_rows_outside_its_part_falls_back(
    run_with_an_increment, tmp_path, edit, why
):
    """An increment's ``.rows.i64`` (its CRCs recomputed) names each row it stores: ids
    outside the part, or one twice, are a damaged checkpoint, not rows to skip."""
    run = _copy(run_with_an_increment, tmp_path)
    ck = run / "checkpoints" / "step_00000020.inc"
    m = json.loads((ck / "manifest.json").read_text())
    table = next(t for t in m["tables"] if t["parts"][0]["stored_rows"] >= 2)
    part = table["parts"][0]
    name = part["prefix"] + ".rows.i64"
    rows = np.fromfile(ck / name, np.int64)
    edit(rows, part["row_hi"])
    _forge_file(ck, name, rows)
    _resumes_past(run, "step_00000020.inc", why)


QR = ["--embedding.compression=qr", "--embedding.compress_min_rows=100"]


def test_forged_factors_fall_back_to_the_previous_checkpoint(tmp_path):
    """A compressed table's ``factors.pt`` (CRCs recomputed): a list, or a tensor where a
    table's state belongs, was a traceback; NaN factors resumed and stopped the run."""
    source = tmp_path / "source"
    train(load_config("debug", [*BASE, *CKPT, *QR]), source, **QUIET)
    name = "parts/rank00000/factors.pt"

    def nan_factors(d):
        table = next(iter(d))
        key = next(k for k, v in d[table].items() if torch.is_tensor(v) and v.is_floating_point())
        d[table][key] = torch.full_like(d[table][key], float("nan"))
        return d

    forgeries = [
        (lambda d: [1], "not a table -> factor state mapping"),
        (lambda d: {k: torch.zeros(3) for k in d}, "not a table -> factor state mapping"),
        (nan_factors, "NaN or infinite"),
    ]
    for i, (edit, why) in enumerate(forgeries):
        run = tmp_path / f"run{i}"
        subprocess.run(["cp", "-a", str(source), str(run)], check=True)
        ck = run / "checkpoints" / "step_00000020"
        buf = io.BytesIO()
        torch.save(edit(torch.load(ck / name, weights_only=True)), buf)
        data = buf.getvalue()
        (ck / name).write_bytes(data)
        entry = {"bytes": len(data), "crc32": zlib.crc32(data)}
        _forge(ck, lambda m, entry=entry: m["files"].update({name: entry}))
        _resumes_past(run, "step_00000020", why, tuple(QR))


def _model_state(run: Path) -> dict:
    from recscale.models.dlrm import build_model

    cfg = load_config(str(run / "config.toml"), [])
    return build_model(cfg.model, cfg.embedding, device=torch.device("cpu")).state_dict()


WEIGHT = "embeddings.groups.0.storage.weight"
LAYER = "bottom.layers.0.weight"


@pytest.mark.parametrize(
    "forge, says",
    [
        (lambda sd, p: torch.save({}, p), "not this run's model (14 of its tensors missing"),
        (lambda sd, p: torch.save([1, 2], p), "not a model's state"),
        (lambda sd, p: torch.save({**sd, "evil": torch.zeros(1)}, p), "1 others, e.g. evil"),
        (
            lambda sd, p: torch.save({**sd, LAYER: torch.zeros(3)}, p),
            f"{LAYER} is torch.float32 [3]",
        ),
        (lambda sd, p: torch.save({**sd, LAYER: sd[LAYER].double()}, p), "torch.float64"),
        (lambda sd, p: torch.save({**sd, WEIGHT: sd[WEIGHT][:5].clone()}, p), "[5, 8]"),
        (
            lambda sd, p: torch.save({**sd, LAYER: torch.full_like(sd[LAYER], math.nan)}, p),
            f"{LAYER} holds NaN",
        ),
        (lambda sd, p: p.write_bytes(b"hello"), "not a plain tensor file"),
        (lambda sd, p: os.mkfifo(p), "not a regular file"),
        (lambda sd, p: os.symlink("/dev/zero", p), "symbolic link"),
    ],
)
def test_a_forged_model_file_is_one_line_not_a_traceback_or_another_model(
    run_with_two_checkpoints, tmp_path, capsys, forge, says
):
    """``eval`` reads a run's ``model.pt`` (what older versions wrote) before its
    checkpoints: a FIFO there hung it, a link to /dev/zero or a file of another shape
    was a traceback, and NaN weights, a table's rows cut short or float64 / int weights
    were evaluated without a word. Each is now one line naming the file and the tensor."""
    from recscale.cli.main import main

    run = _copy(run_with_two_checkpoints, tmp_path)
    sd = _model_state(run)
    torch.save(sd, run / "model.pt")
    assert main(["eval", "--model", str(run)]) == 0  # a sound model file is read
    capsys.readouterr()
    (run / "model.pt").unlink()
    forge(sd, run / "model.pt")
    assert main(["eval", "--model", str(run)]) == 1
    line = error_line(capsys.readouterr().err)
    assert "model.pt" in line and says in line, line
