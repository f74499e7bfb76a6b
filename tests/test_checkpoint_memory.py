"""A checkpoint's memory: a save whose copy of the rows would not fit beside training,
and the final save (synchronous), stream the rows from the tables instead of copying
them - config B's final save had copied its 13 GB of tables beside them, and the kernel
killed the run. The streamed checkpoints must hold exactly what the copied ones hold."""

import json
from pathlib import Path

import pytest

from recscale.checkpoint import manager, state
from recscale.checkpoint.manager import checkpoint_dirs
from recscale.config import load_config
from recscale.train.run import train
from recscale.units import size_text

RUN = [
    "--train.progress=false",
    "--data.eval_samples=2048",
    "--train.steps=30",
    "--checkpoint.every_steps=10",
    "--checkpoint.full_every=2",
    "--checkpoint.full_if_fraction=1.0",
    "--checkpoint.keep=10",
]


def _parts(run_dir: Path) -> dict[str, dict]:
    """checkpoint name -> its kind and its table files' sizes and checksums."""
    out = {}
    for d in checkpoint_dirs(run_dir / "checkpoints"):
        m = json.loads((d / "manifest.json").read_text())
        files = {k: v for k, v in m["files"].items() if k.startswith("parts/")}
        out[d.name] = {"kind": m["kind"], "files": files}
    return out


@pytest.fixture
def streamed_saves(monkeypatch):
    """Records, for each write, whether every part of its snapshot was streamed."""
    seen: list[bool] = []
    write = state.write_part

    def spy(snap, w):
        seen.append(all(p.streamed for p in snap.parts))
        write(snap, w)

    monkeypatch.setattr(manager, "write_part", spy)
    return seen


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_a_copy_that_does_not_fit_is_streamed_and_writes_the_same_checkpoints(
    tmp_path, monkeypatch, streamed_saves, optimizer
):
    over = [*RUN, f"--embedding.optimizer={optimizer}"]
    train(load_config("debug", over), tmp_path / "copied", echo=lambda _m: None)
    assert streamed_saves[:3] == [False] * 3  # the periodic saves copied (the final one: 30)
    streamed_saves.clear()
    said: list[str] = []
    monkeypatch.setattr(manager, "mem_available", lambda: 1000)  # 1 kB free
    train(load_config("debug", over), tmp_path / "streamed", echo=said.append)
    assert streamed_saves == [True] * 3
    copied, streamed = _parts(tmp_path / "copied"), _parts(tmp_path / "streamed")
    assert [c["kind"] for c in streamed.values()] == ["full", "incremental", "full"]
    assert streamed == copied
    notes = [m for m in said if "copy of the tables" in m]
    assert len(notes) == 1 and f"({size_text(1000)} of host memory available)" in notes[0], said


def test_the_final_save_streams_its_rows(tmp_path, streamed_saves):
    over = ["--train.progress=false", "--data.eval_samples=2048", "--train.steps=20"]
    train(load_config("debug", over), tmp_path, echo=lambda _m: None)
    assert streamed_saves == [True]
    (final,) = checkpoint_dirs(tmp_path / "checkpoints")
    assert json.loads((final / "manifest.json").read_text())["kind"] == "full"
