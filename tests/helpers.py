"""Shared helpers for tests: random jagged batches and per-table references."""

from __future__ import annotations

import torch

from recscale.data.batch import Batch


def random_jagged(
    table_sizes: list[int],
    batch_size: int,
    max_len: int = 4,
    weighted: bool = False,
    seed: int = 0,
    hot_ids: bool = True,
) -> Batch:
    """A batch with bag lengths in [0, max_len] (empty bags included) and, with
    ``hot_ids``, ids drawn from a few values so rows repeat within and across bags."""
    g = torch.Generator().manual_seed(seed)
    num_f = len(table_sizes)
    lengths = torch.randint(0, max_len + 1, (num_f, batch_size), generator=g)
    values = []
    for f, n in enumerate(table_sizes):
        count = int(lengths[f].sum())
        hi = min(n, 3) if hot_ids else n
        values.append(torch.randint(0, hi, (count,), generator=g))
    offsets = torch.zeros(num_f * batch_size + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    vals = torch.cat(values)
    return Batch(
        dense=torch.randn(batch_size, 13, generator=g),
        values=vals,
        offsets=offsets,
        labels=torch.randint(0, 2, (batch_size,), generator=g).float(),
        weights=torch.rand(vals.shape[0], generator=g) if weighted else None,
    )


def per_feature_inputs(
    batch: Batch, f: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, offsets incl. last, weights) of feature f alone, for nn.EmbeddingBag."""
    b = batch.batch_size
    start, end = int(batch.offsets[f * b]), int(batch.offsets[(f + 1) * b])
    offs = batch.offsets[f * b : (f + 1) * b + 1] - start
    w = None if batch.weights is None else batch.weights[start:end]
    return batch.values[start:end], offs, w


def make_dataset(root, lines: int, seed: int, hash_size: int):
    """A small preprocessed dataset (split 'train' only) from synthetic Criteo lines."""
    from recscale.dataprep.criteo_tsv import synthetic_lines
    from recscale.dataprep.preprocess import PreprocessOptions, preprocess

    src = root / "in.tsv"
    src.write_text("\n".join(synthetic_lines(lines, seed=seed)) + "\n")
    opts = PreprocessOptions(inputs=[src], out=root / "ds", hash_sizes=[hash_size], split="none")
    preprocess(opts, echo=lambda s: None)
    return root / "ds"


RESUME_BASE = [
    "--train.progress=false",
    "--train.log_every=5",
    "--data.eval_samples=2048",
    "--checkpoint.every_steps=20",
    "--checkpoint.full_every=2",
    "--checkpoint.full_if_fraction=1.0",
]


def assert_resume_identical(tmp_path, extra: list[str]) -> None:
    """60 debug steps straight (run a) vs 40 steps, then resumed from their full +
    incremental chain to 60 (run b): the logged losses after the resume are equal."""
    import json

    from recscale.config import load_config
    from recscale.train.run import train

    base, quiet = [*RESUME_BASE, *extra], dict(echo=lambda *_: None)
    train(load_config("debug", [*base, "--train.steps=60"]), tmp_path / "a", **quiet)
    train(load_config("debug", [*base, "--train.steps=40"]), tmp_path / "b", **quiet)
    kinds = [
        json.loads(p.read_text())["kind"]
        for p in sorted((tmp_path / "b/checkpoints").glob("*/manifest.json"))
    ]
    assert kinds == ["full", "incremental"]
    m = train(
        load_config("debug", [*base, "--train.steps=60"]),
        tmp_path / "b",
        resume=tmp_path / "b",
        **quiet,
    )
    assert m["resumed_from_step"] == 40
    la, lb = (
        {
            r["step"]: r["loss"]
            for r in map(json.loads, (d / "train_log.jsonl").read_text().splitlines())
        }
        for d in (tmp_path / "a", tmp_path / "b")
    )
    assert all(la[s] == lb[s] for s in range(45, 61, 5))


def cli(*args: str, timeout: float = 180, **kw):
    """``python -m recscale ARGS`` in a subprocess: its CompletedProcess (text output)."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "recscale", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def standard_streams_to(out: str, err: str) -> None:
    """This process's fds 1 and 2 (and ``sys.stdout``/``sys.stderr`` on them) written to
    the files ``out`` and ``err``."""
    import os
    import sys

    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - fd 1 for this process's life
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def forked_main(argv: list[str], out: str, err: str, environ: dict, cwd: str) -> None:
    """``recscale ARGV`` with fds 1 and 2 on the files ``out`` and ``err``; exits with
    its exit code (an uncaught exception: its traceback and 1, as the interpreter)."""
    import os
    import sys
    import traceback

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    standard_streams_to(out, err)
    from recscale.cli.main import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    except Exception:  # noqa: BLE001 - what the interpreter would print and exit 1
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(rc)


def forked_cli(*args: str, timeout: float = 180, env: dict | None = None, cwd=None):
    """``recscale ARGS`` in a process of its own, as ``cli`` reports it (exit code, stdout,
    stderr; ``subprocess.TimeoutExpired`` past ``timeout``, the process killed), forked
    from the server that imported torch and recscale (the distributed tests' ranks'
    ``recscale.distributed.spawn.process_context``) instead of a fresh interpreter's
    3-4 s import: for what takes another process - a lock held by this one, a hang to
    time out, a rank of its own - but not what a fresh one reads at import (numba's
    environment) or a shell's redirections."""
    import os
    import subprocess
    import tempfile

    from recscale.distributed.spawn import process_context

    with tempfile.TemporaryDirectory(prefix="recscale-cli-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        environ = dict(os.environ if env is None else env)
        proc = process_context().Process(
            target=forked_main, args=(list(args), out, err, environ, str(cwd or os.getcwd()))
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["recscale", *args], timeout)
        return subprocess.CompletedProcess(
            ["recscale", *args], proc.exitcode, _read_or_empty(out), _read_or_empty(err)
        )


def _read_or_empty(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # the process died before it opened it
        return ""


def train_then_eval(data_path, run, steps: int) -> tuple[dict, dict]:
    """``recscale train --config debug`` on a dataset for ``steps`` (its 'train' split
    scored), then ``recscale eval --json`` of that split: the run's metrics.json and
    eval's JSON."""
    import json

    r = run_cli(
        "train",
        "--config",
        "debug",
        "--data.path",
        str(data_path),
        f"--train.steps={steps}",
        "--train.progress=false",
        "--data.eval_split=train",
        "--run-dir",
        str(run),
    )
    assert r.returncode == 0, r.stderr
    trained = json.loads((run / "metrics.json").read_text())
    r = run_cli("eval", "--model", str(run), "--split", "train", "--json")
    assert r.returncode == 0, r.stderr
    return trained, json.loads(r.stdout)


def run_cli(*args: str, env: dict | None = None, cwd=None):
    """``recscale ARGS`` run in this process, as ``cli`` reports it (exit code, stdout,
    stderr; an uncaught exception as its traceback on stderr and exit code 1), without
    the 3-4 s a fresh interpreter takes to import torch. ``env`` replaces the
    environment and ``cwd`` the directory for the call. For what only a fresh process
    shows - signals, a hang (no timeout here), import-time settings, locks held by
    another process - use ``cli``."""
    import contextlib
    import io
    import os
    import subprocess
    import traceback

    from recscale.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:  # noqa: BLE001 - what the interpreter would print and exit 1
                traceback.print_exc()
                rc = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["recscale", *args], rc, out.getvalue(), err.getvalue())


def error_line(err: str) -> str:
    """The one ``recscale: error:`` line of a CLI's stderr (and no traceback)."""
    assert "Traceback" not in err, err
    lines = [x for x in err.strip().splitlines() if x.startswith("recscale: error:")]
    assert len(lines) == 1, err
    return lines[0]


def wgrad_operands(batch: int, out: int, inp: int, strided: bool, dtype=torch.float32):
    """``g [batch, out]`` and ``x [batch, inp]`` for a weight-gradient kernel test, seeded
    by the shape; ``strided``: views into wider rows (row stride > width)."""
    gen = torch.Generator().manual_seed(batch + out + inp)
    pad = 3 if strided else 0
    g = torch.randn(batch, out + pad, generator=gen).to(dtype)[:, pad:]
    x = torch.randn(batch, inp + 2 * pad, generator=gen).to(dtype)[:, :inp]
    return g, x


def weight_grad_on_two_threads(g: torch.Tensor, x: torch.Tensor, bias_grad: bool):
    """``gemm.weight_grad(g, x)`` on two torch threads (the kernels' thread splits run
    on any host), the caller's thread count restored."""
    from recscale.modules import gemm

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return gemm.weight_grad(g, x, bias_grad=bias_grad)
    finally:
        torch.set_num_threads(threads)


def needs_amx() -> None:
    """Skip the calling test where the AMX kernels do not run (no AMX-BF16 or no grant)."""
    import pytest

    from recscale import native
    from recscale.modules import gemm_amx

    if not gemm_amx.ready():
        pytest.skip(f"no AMX tiles here: {native.status()}")
