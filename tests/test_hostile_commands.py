"""Commands given what they cannot use - a dataset to plan that is not there, a sweep or
calibration written where nothing can be written, a batch that does not divide across
the benchmark's ranks, a hash size beyond 32-bit ids, a reader that closes the pipe:
each is one line naming the flag or key, before the work (or, for the pipe, a quiet
exit), and no output file holds what standard JSON readers reject."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import error_line, make_dataset

from recscale.cli.main import main


def _fails(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, error_line(capsys.readouterr().err)


def test_plan_plans_the_tables_of_the_dataset_it_is_given(tmp_path, capsys):
    """``plan --data.path`` had planned the config's own table sizes (the debug preset's
    100, 200, ... rows), not the dataset's that training builds; a dataset that is not
    there was ignored without a word."""
    ds = make_dataset(tmp_path, 400, seed=1, hash_size=37)
    sizes = json.loads((ds / "metadata.json").read_text())["table_sizes"]
    assert main(["plan", "--config", "debug", f"--data.path={ds}", "--data.eval_split=train"]) == 0
    out = capsys.readouterr()
    assert "table sizes from" in out.err
    rows = [ln.split() for ln in out.out.splitlines() if ln.split()[:1] in (["C1"], ["C26"])]
    assert [int(r[1].replace(",", "")) for r in rows] == [sizes[0], sizes[25]]
    assert sizes[0] != 100  # the debug preset's own C1
    rc, line = _fails(capsys, "plan", "--config", "debug", f"--data.path={tmp_path / 'none'}")
    assert rc == 1 and "not a recscale dataset" in line


def test_benchmark_outputs_that_cannot_be_written_are_refused_before_measuring(tmp_path, capsys):
    """``bench calibrate --out`` under a path that cannot be written measured for minutes
    and then failed, and over a file not a calibration replaced it; ``bench sweep --out
    FILE`` said only "File exists"."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, line = _fails(capsys, "bench", "calibrate", "--out", str(blocker / "cal.json"))
    assert rc == 2 and "--out" in line and "cannot write" in line
    rc, line = _fails(capsys, "bench", "calibrate", "--out", str(tmp_path))
    assert rc == 2 and "is a directory" in line
    rc, line = _fails(
        capsys, "bench", "sweep", "--config", "debug", "--vary", "train.batch_size=64",
        "--out", str(blocker),
    )  # fmt: skip
    assert rc == 2 and "--out" in line and "is a file" in line
    rc, line = _fails(capsys, "bench", "calibrate", "--out", str(blocker))  # was overwritten
    assert rc == 2 and "exists and is not a calibration" in line
    assert blocker.read_text() == "x"
    older = tmp_path / "cal.json"  # a calibration, of any format, is replaced
    older.write_text(json.dumps({"machine": "m", "threads": 1, "laws": {}, "format": 0}))
    from recscale.cli.bench_cmd import _refuse_replacing_another_file

    _refuse_replacing_another_file(older)


def test_a_pipeline_benchmark_whose_batch_does_not_divide_is_one_line(capsys):
    """Three ranks of a batch of 256 had each rank fail with a traceback after the spawn."""
    rc, line = _fails(
        capsys, "bench", "pipeline", "--config", "debug", "--steps", "1", "--world-size", "3"
    )
    assert rc == 2 and "train.batch_size" in line and "3 ranks" in line


def test_a_hash_size_beyond_32_bit_ids_is_refused(tmp_path, capsys):
    """--hash-size 99999999999 wrote a dataset whose ids wrapped and that no run could open."""
    src = tmp_path / "in.tsv"
    assert main(["data", "synth-tsv", "--lines", "50", "--out", str(src)]) == 0
    capsys.readouterr()
    for size in ("99999999999", f"{2**31 + 1}"):
        rc, line = _fails(
            capsys, "data", "preprocess", "--input", str(src), "--out", str(tmp_path / "ds"),
            "--hash-size", size,
        )  # fmt: skip
        assert rc == 1 and "--hash-size" in line and "32-bit" in line
    assert not (tmp_path / "ds").exists()


def test_synth_tsv_names_a_directory_out_and_a_negative_seed_before_writing(tmp_path, capsys):
    """A directory as --out failed at the final rename ("ds.partial: Is a directory") after
    writing everything, leaving its .optimum.json; --seed -1 was numpy's "expected
    non-negative integer", naming no flag."""
    (tmp_path / "d").mkdir()
    rc, line = _fails(capsys, "data", "synth-tsv", "--lines", "10", "--out", str(tmp_path / "d"))
    assert rc == 1 and "is a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    out = tmp_path / "x.tsv"
    rc, line = _fails(
        capsys, "data", "synth-tsv", "--lines", "10", "--out", str(out), "--seed", "-1"
    )
    assert rc == 1 and "--seed" in line and not out.exists()


def test_outputs_that_are_fifos_or_devices_are_refused_not_replaced(tmp_path, capsys):
    """synth-tsv renamed its finished file over --out: run as root with ``--out
    /dev/null`` it left a regular file where the device was (and wrote
    ``/dev/null.optimum.json``). Every whole-file replacement (calibrate --out, sweep
    plots, run files) refuses a FIFO, device or socket at its name; a symbolic link is
    replaced, its target untouched."""
    from recscale.config.small_files import write_text_atomic

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rc, line = _fails(capsys, "data", "synth-tsv", "--lines", "10", "--out", str(fifo))
    assert rc == 1 and "it is a FIFO; refused" in line and "--out" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no .optimum.json
    os.mkfifo(tmp_path / "x.tsv.optimum.json")  # the side file too, before any writing
    rc, line = _fails(
        capsys, "data", "synth-tsv", "--lines", "10", "--out", str(tmp_path / "x.tsv")
    )
    assert rc == 1 and "x.tsv.optimum.json: it is a FIFO" in line
    assert not (tmp_path / "x.tsv").exists()
    with pytest.raises(OSError, match="it is a FIFO; refused"):
        write_text_atomic(fifo, "{}")
    assert os.path.exists(fifo) and not os.path.isfile(fifo)
    target = tmp_path / "target.json"
    target.write_text("kept")
    (tmp_path / "link.json").symlink_to(target)
    write_text_atomic(tmp_path / "link.json", "new")
    assert target.read_text() == "kept" and (tmp_path / "link.json").read_text() == "new"
    assert not (tmp_path / "link.json").is_symlink()


def test_metrics_that_are_undefined_are_written_as_null_json(tmp_path, capsys):
    """Ten lines leave one in the Kaggle test split: its AUC is undefined, and Python
    wrote it as NaN, which is not JSON (jq and JavaScript reject the file)."""
    out = tmp_path / "x.tsv"
    assert main(["data", "synth-tsv", "--lines", "10", "--out", str(out)]) == 0
    assert "AUC undefined" in capsys.readouterr().out
    text = (tmp_path / "x.tsv.optimum.json").read_text()
    assert "NaN" not in text and json.loads(text)["kaggle_test"]["auc"] is None
    from recscale.config.small_files import json_text

    assert json.loads(json_text({"a": [math.nan, 1.5], "b": math.inf, "c": "x"})) == {
        "a": [None, 1.5], "b": None, "c": "x",
    }  # fmt: skip


def test_checkpoint_inspect_reports_no_checkpoints_on_stderr(tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "holds no checkpoints" in error_line(out.err)
    # a path that is not there, or a file, says so ("no checkpoints at" hid the typo)
    rc, line = _fails(capsys, "checkpoint", "inspect", str(tmp_path / "typo"))
    assert rc == 1 and line.endswith("typo does not exist"), line
    (tmp_path / "f").write_text("")
    rc, line = _fails(capsys, "checkpoint", "inspect", str(tmp_path / "f"))
    assert rc == 1 and line.endswith("f is not a directory"), line


@pytest.mark.skipif(sys.platform != "linux", reason="a pipe's closed reader polls as POLLERR")
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(tmp_path):
    """``recscale plan ... | head -1``: the rest of the output could not be written and the
    command said "recscale: error: Broken pipe" (exit 1)."""
    code = (
        "import sys, time; from recscale.cli.main import main; "
        "sys.stdout.write('x\\n' * 10); sys.stdout.flush(); time.sleep(0.5); "
        "sys.exit(main(['plan', '--config', 'A', '--world-size', '64']))"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "0"},
    )
    p.stdout.readline()
    p.stdout.close()  # the reader goes, as head does after its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Broken pipe" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("closed", ["stdout", "stderr", "all"])
def test_closed_standard_streams_neither_crash_a_run_nor_land_in_its_files(tmp_path, closed):
    """``recscale train ... >&-``: Python had no sys.stdout, the run's first line was an
    AttributeError, and the directory it left (config.toml) refused a rerun. A closed
    descriptor would also be taken by the next file the run opened, so what C libraries
    write to fd 1 or 2 would land in it. Each closed one is opened on /dev/null: the run
    trains, its files hold only what they should, and a bad key still exits 2."""
    shut = {"stdout": ">&-", "stderr": "2>&-", "all": "<&- >&- 2>&-"}[closed]
    run = tmp_path / "run"
    cmd = f"exec {sys.executable} -m recscale train --config debug --train.steps=3 --run-dir {run}"
    r = subprocess.run(["bash", "-c", f"{cmd} {shut}"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads((run / "metrics.json").read_text())["steps"] == 3
    logged = (run / "train_log.jsonl").read_text().splitlines()
    assert logged and all(json.loads(line) for line in logged)
    bad = f"exec {sys.executable} -m recscale config --nope.x=1 {shut}"
    assert subprocess.run(["bash", "-c", bad], capture_output=True, timeout=120).returncode == 2


def test_eval_of_a_run_that_kept_no_model_says_why(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", "debug", "--run-dir", str(run), "--train.steps=2"]
    assert main([*argv, "--train.progress=false", "--train.save_model=false"]) == 0
    capsys.readouterr()
    rc, line = _fails(capsys, "eval", "--model", str(run))
    assert rc == 1 and "train.save_model=false" in line
    rc, line = _fails(capsys, "eval", "--model", str(tmp_path / "none"))
    assert rc == 1 and "not a run directory" in line


def test_an_ssd_dir_under_a_file_names_the_file(tmp_path, capsys):
    """``--embedding.ssd_dir=/dev/null`` said "File exists" of the tier's file."""
    (tmp_path / "a-file").write_text("x")
    for where in (tmp_path / "a-file", tmp_path / "a-file" / "deeper"):
        rc, line = _fails(
            capsys, "train", "--config", "debug", "--train.steps=1", "--train.progress=false",
            "--embedding.placement=ssd", f"--embedding.ssd_dir={where}",
        )  # fmt: skip
        assert rc == 1 and f"{tmp_path / 'a-file'} is not a directory" in line, line
    assert (tmp_path / "a-file").read_text() == "x"


def test_a_choice_with_an_invisible_character_is_shown_as_typed(capsys):
    rc, line = _fails(capsys, "config", "--config", "debug", "--train.device=cpu\t")
    assert rc == 2 and "'cpu\\t'" in line


@pytest.mark.parametrize("planted", ["hard link", "fifo"])
def test_a_lock_file_that_is_a_hard_link_or_a_fifo_is_not_written(tmp_path, capsys, planted):
    """A run's ``.recscale.lock`` hard-linked to a file elsewhere had that file truncated
    and a pid written into it; a FIFO there was opened as the lock."""
    run = tmp_path / "run"
    run.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    lock = run / ".recscale.lock"
    if planted == "hard link":
        os.link(precious, lock)
    else:
        os.mkfifo(lock)
    rc, line = _fails(
        capsys, "train", "--config", "debug", "--run-dir", str(run), "--train.steps=1",
        "--train.progress=false",
    )  # fmt: skip
    assert rc == 1 and "not a lock file recscale made" in line, line
    assert precious.read_text() == "keep me\n"
    assert sorted(p.name for p in run.iterdir()) == [".recscale.lock"]


def test_the_filesystem_root_is_no_run_directory():
    """``--run-dir /`` trained and wrote ``/metrics.json``, ``/config.toml`` and
    ``/checkpoints`` (as root, in a container)."""
    from pathlib import Path

    from recscale.train.run import RunDirInUse, check_run_dir

    with pytest.raises(RunDirInUse, match="filesystem root"):
        check_run_dir(Path("/"), None)
    with pytest.raises(RunDirInUse, match="filesystem root"):
        check_run_dir(Path("/tmp/.."), None)


def test_a_run_directory_that_is_a_device_says_what_it_is(tmp_path):
    """``--run-dir /dev/null`` was refused as "is a file"; a FIFO too."""
    import os
    from pathlib import Path

    from recscale.train.run import RunDirInUse, check_run_dir

    with pytest.raises(RunDirInUse, match="/dev/null is a character device; name a directory"):
        check_run_dir(Path("/dev/null"), None)
    os.mkfifo(tmp_path / "f")
    with pytest.raises(RunDirInUse, match="is a FIFO; name a directory"):
        check_run_dir(tmp_path / "f", None)


def test_a_run_that_fails_before_writing_leaves_no_empty_directory(tmp_path, capsys):
    """A run refused after its directory was made (for its lock: a dataset that is not
    there) left an empty ``runs/<timestamp>`` behind, one per failed try; a directory
    that was there before, or holds the run's files, stays."""
    run = tmp_path / "run"
    argv = ["train", "--config", "debug", f"--data.path={tmp_path / 'nope'}", "--run-dir"]
    rc, line = _fails(capsys, *argv, str(run))
    assert rc == 1 and "not a recscale dataset" in line
    assert not run.exists()
    run.mkdir()
    rc, _ = _fails(capsys, *argv, str(run))
    assert rc == 1 and run.is_dir()  # the user's own (empty) directory
    done = tmp_path / "done"
    assert main(["train", "--config", "debug", "--train.steps=3", "--run-dir", str(done)]) == 0
    assert (done / "metrics.json").is_file()


def _damage(p: dict, change: str) -> None:
    """One field of a 2-rank plan of the debug preset made what no plan holds."""
    first, second = p["placements"][0], p["placements"][1]
    if change == "rank_text":
        first["ranks"] = ["0"]
    elif change == "world_size_text":
        p["world_size"] = "2"
    elif change == "unknown_tier":
        first["placement"] = "moon"
    elif change == "negative_cache":
        first.update(placement="ssd", cache_bytes=-5)
    elif change == "unknown_kernel":
        first["kernel"] = "evil"
    elif change == "table_twice":
        p["placements"].append(dict(first))
    elif change == "repeated_rank":
        second.update(kind="row_wise", ranks=[0, 0])
    elif change == "replica_on_one_rank":
        second.update(kind="data_parallel", ranks=[1])
    elif change == "nan_hit_rate":
        first["hit_rate"] = math.nan
    elif change == "placement_not_object":
        p["placements"][0] = "C1"
    elif change == "misspelt_key":
        first["placment"] = "ssd"
    elif change == "table_of_another_model":
        p["placements"].append(dict(first, table="C99"))
    elif change == "memory_for_three_ranks":
        p["memory_per_rank"] = [1, 2, 3]
    elif change == "negative_cost":
        p["cost_per_rank"] = [0.1, -0.1]


@pytest.mark.parametrize(
    "change, says",
    [
        ("rank_text", "ranks is ['0'], not a list of distinct whole rank numbers"),
        ("world_size_text", "world_size is '2', not a whole number"),
        ("unknown_tier", "placement is 'moon', not one of ('device', 'host', 'ssd')"),
        ("negative_cache", "cache_bytes is -5, not a whole number of bytes >= 0"),
        ("unknown_kernel", "kernel is 'evil'"),
        ("table_twice", "table C1 is placed twice"),
        ("repeated_rank", "not a list of distinct whole rank numbers"),
        ("replica_on_one_rank", "data_parallel is on every rank, not [1]"),
        ("nan_hit_rate", "hit_rate is nan, not a share in [0, 1]"),
        ("placement_not_object", "placements[0] is not an object"),
        ("misspelt_key", "placements[0] (table C1): unknown key 'placment'"),
        ("table_of_another_model", "places tables the model does not have: C99"),
        ("memory_for_three_ranks", "memory_per_rank has 3 entries for 2 ranks"),
        ("negative_cost", "cost_per_rank is not a list of numbers >= 0"),
    ],
)
def test_a_plan_file_field_no_plan_holds_is_named(tmp_path, change, says):
    """A ``distributed.plan`` file is read field by field: a rank written as text was a
    TypeError traceback on every rank; a world size written as text said "a plan for 2
    ranks but the job has 2"; an unknown tier ("moon") built an ssd tier, a negative
    cache a one-row one; a table placed twice, a rank repeated in a row-wise table or a
    replicated table on one rank trained without a word, and so did a misspelt key
    (its default in force), a table the model lacks and per-rank figures for another
    world size."""
    from recscale.config import ConfigError, load_config
    from recscale.planner.from_config import plan_for, table_infos, uniform_plan

    cfg = load_config("debug", [])
    plan = uniform_plan(table_infos(cfg), 2, "data_parallel").to_dict()
    _damage(plan, change)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    cfg = load_config("debug", [f"--distributed.plan={path}"])
    with pytest.raises(ConfigError) as err:
        plan_for(cfg, 2, 1 << 30)
    assert err.value.key == "distributed.plan" and says in str(err.value), str(err.value)


def test_a_plan_file_without_the_planners_figures_is_read(tmp_path):
    """The per-rank memory and cost figures are the planner's predictions: a hand-written
    plan may leave them out."""
    from recscale.config import load_config
    from recscale.planner.from_config import plan_for, table_infos

    cfg = load_config("debug", [])
    names = [t.name for t in table_infos(cfg)]
    plan = {
        "world_size": 2,
        "placements": [
            {"table": n, "kind": "table_wise", "ranks": [i % 2]} for i, n in enumerate(names)
        ],
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    got = plan_for(load_config("debug", [f"--distributed.plan={path}"]), 2, 1 << 30)
    assert [p.ranks for p in got.placements] == [[i % 2] for i in range(len(names))]
    assert got.memory_per_rank == [0, 0] and got.placements[0].placement == "device"


def test_a_plan_files_tiers_and_a_configured_tier_are_not_both_taken(tmp_path):
    """A plan that puts tables on ssd itself and ``embedding.placement=ssd`` (or host,
    auto) each decide every table's tier: the configured one replaced the plan's without
    a word. Both given is refused, naming the key; a plan of device tables takes the
    configured tier, and ``embedding.placement=device`` follows the plan's."""
    from recscale.config import ConfigError, load_config
    from recscale.planner.from_config import plan_for, table_infos, uniform_plan

    plan = uniform_plan(table_infos(load_config("debug", [])), 1, "table_wise").to_dict()
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(plan))
    plan["placements"][0].update(placement="ssd", cache_bytes=4096)
    tiered = tmp_path / "tiered.json"
    tiered.write_text(json.dumps(plan))
    for tier in ("ssd", "host", "auto"):
        cfg = load_config(
            "debug", [f"--distributed.plan={tiered}", f"--embedding.placement={tier}"]
        )
        with pytest.raises(ConfigError) as err:
            plan_for(cfg, 1, 1 << 30)
        assert err.value.key == "embedding.placement" and "tiered.json places" in str(err.value)
        cfg = load_config("debug", [f"--distributed.plan={plain}", f"--embedding.placement={tier}"])
        assert plan_for(cfg, 1, 1 << 30).placements[0].placement == "device"  # tiers: later
    got = plan_for(load_config("debug", [f"--distributed.plan={tiered}"]), 1, 1 << 30)
    assert (got.placements[0].placement, got.placements[0].cache_bytes) == ("ssd", 4096)


def test_a_benchmark_plans_an_auto_tier_without_an_ssd_dir(tmp_path, capsys, monkeypatch):
    """``bench throughput`` / ``pipeline`` with ``embedding.placement=auto`` and no
    ``embedding.ssd_dir`` (a training run puts it in its run directory; a benchmark has
    none) said only "No such file or directory" (the pipeline: a traceback from every
    rank): the planner measured the free space of "". It measures the temp dir the tier's
    files then go to; a directory that cannot be made names the key."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the tier's temp dir lands
    argv = ["bench", "throughput", "--config", "debug", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--embedding.placement=auto"]) == 0
    assert "samples/s" in capsys.readouterr().out
    (tmp_path / "a_file").write_text("")
    blocked = f"--embedding.ssd_dir={tmp_path / 'a_file' / 'tier'}"
    rc, line = _fails(capsys, *argv, "--embedding.placement=auto", blocked)
    assert rc == 2 and "'embedding.ssd_dir'" in line and "a_file/tier" in line, line


@pytest.mark.parametrize("bench", ["throughput", "pipeline"])
def test_a_cache_too_small_for_a_benchmark_is_one_line(capsys, bench):
    """``embedding.cache_bytes`` below the rows a batch needs stops the run at its first
    step: one line from ``train``, a traceback from ``bench throughput`` and one from
    each rank of ``bench pipeline`` (a rank's error came back as text in a
    RuntimeError). A rank's refusal now comes back as itself (``run_ranks``'
    passthrough), reported as in one process."""
    import pickle

    from recscale.config import ConfigError

    argv = ["bench", bench, "--config", "debug", "--steps", "1", "--warmup", "0"]
    rc, line = _fails(capsys, *argv, "--embedding.placement=ssd", "--embedding.cache_bytes=1000")
    assert rc == 1 and line.startswith("recscale: error: the embedding cache holds"), line
    assert "raise embedding.cache_bytes" in line
    e = pickle.loads(pickle.dumps(ConfigError("model.kernels", "no such kernel")))
    assert (e.key, str(e)) == ("model.kernels", "config key 'model.kernels': no such kernel")


@pytest.mark.parametrize(
    "argv, key",
    [
        (["bench", "calibrate", "--nope.x=1"], "'--nope.x'"),
        (["bench", "calibrate", "--config", "A"], "'--config'"),
        (["bench", "throughput", "--config", "debug", "--data.path={ds}"], "'data.path'"),
        (["bench", "pipeline", "--config", "debug", "--data.path={ds}"], "'data.path'"),
        (
            [
                "bench",
                "sweep",
                "--vary",
                "train.batch_size=64",
                "--out",
                "{out}",
                "--data.path={ds}",
            ],
            "'data.path'",
        ),
        (["bench", "sweep", "--vary", "data.path={ds}", "--out", "{out}"], "'--vary'"),
    ],
)
def test_what_a_benchmark_would_ignore_is_refused_before_it_runs(tmp_path, capsys, argv, key):
    """``bench calibrate`` times its own shapes: a ``--config`` or an override (an
    unknown key included) was ignored through minutes of measuring. The other
    benchmarks time synthetic batches: a dataset named to them was ignored without a
    word. Each is one line naming the key, before any work."""
    ds = make_dataset(tmp_path, 300, seed=2, hash_size=20)
    argv = [a.format(ds=ds, out=tmp_path / "sweep") for a in argv]
    rc, line = _fails(capsys, *argv)
    assert rc == 2 and key in line, line
    assert not (tmp_path / "sweep").exists()


def test_checkpoint_inspect_refuses_arguments_it_would_ignore(tmp_path, capsys):
    """``checkpoint inspect RUN --model.embedding_dim=4`` printed the checkpoint as if the
    override meant something; it is refused as ``data``'s subcommands refuse theirs."""
    assert main(["checkpoint", "inspect", str(tmp_path), "--model.embedding_dim=4"]) == 2
    assert "unexpected arguments --model.embedding_dim=4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "debug", "--data.path=x\x1b[31mred\x07"],
        ["data", "info", "\x1b[2Jgone"],
        ["data", "info", ".", "\x1b]0;title\x07"],
        ["plan", "--config", "bad\x1b[1m\x9b"],
    ],
)
def test_control_characters_in_what_an_error_quotes_are_shown_escaped(tmp_path, capsys, argv):
    """An error quoting a path or value printed its ESC sequences raw: a dataset path
    named ``x<ESC>[31m...`` turned the terminal red, ``<ESC>]0;...<BEL>`` set its title,
    ``<ESC>[2J`` cleared it. They are written ``\\x1b``, ``\\x07``, ``\\x9b``."""
    assert main([*argv, f"--run-dir={tmp_path / 'run'}"] if argv[0] == "train" else argv) != 0
    err = capsys.readouterr().err
    assert "\\x1b" in err and not any(c in err for c in "\x1b\x07\x9b"), repr(err)


def test_control_characters_in_what_a_command_prints_are_shown_escaped(tmp_path, capsys):
    """Only errors were escaped: a run directory named ``a<ESC>]0;...<BEL>b`` set the
    terminal's title from ``wrote .../metrics.json``, from eval's result line and from
    synth-tsv's. Everything the commands print goes through the escaping stream; JSON
    output stays JSON, and the progress bar keeps its carriage returns. A path's bytes
    that are not UTF-8 (lone surrogates) are written as ``\\xNN`` too: a strict UTF-8
    stream raised on them mid-command."""
    run = tmp_path / "a\x1b]0;title\x07b\x9bc\udc9bd"  # \udc9b: the byte 0x9b of a path
    base = ["--config", "debug", "--train.steps=2", "--train.progress=true"]
    assert main(["train", *base, f"--run-dir={run}"]) == 0
    assert main(["eval", "--model", str(run)]) == 0
    assert main(["data", "synth-tsv", "--lines", "5", "--out", str(run / "x.tsv")]) == 0
    out, err = capsys.readouterr()
    assert f"{tmp_path}/a\\x1b]0;title\\x07b\\x9bc\\x9bd/metrics.json" in out, out
    assert not any(c in out + err for c in "\x1b\x07\x9b\udc9b"), repr(out + err)
    assert "\r" in err  # tqdm redraws its line
    assert main(["eval", "--model", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] > 0
    assert sys.stdout is not None and not type(sys.stdout).__name__ == "EscapingStream"


def test_a_loop_of_symbolic_links_is_one_line_naming_it(tmp_path, capsys):
    """``a -> b -> a`` as the run directory or a preprocess input was pathlib's
    ``RuntimeError: Symlink loop`` traceback."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop = tmp_path / "a"
    for argv in (
        ["train", "--config", "debug", "--train.steps=1", f"--run-dir={loop}"],
        ["train", "--config", "debug", "--train.steps=1", f"--run-dir={loop / 'sub'}"],
        ["data", "preprocess", "--input", str(loop), "--out", str(tmp_path / "ds")],
    ):
        assert main(argv) == 1
        line = error_line(capsys.readouterr().err)
        assert line.startswith(f"recscale: error: {loop}") and "loop of symbolic links" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize(
    "argv, flag, named",
    [
        (["throughput", "--threads", "2"], "--threads", "--train.threads"),
        (["throughput", "--world-size", "2"], "--world-size", "pipeline and calibrate"),
        (["throughput", "--vary", "train.batch_size=64"], "--vary", "bench sweep does"),
        (["pipeline", "--out", "x"], "--out", "sweep and calibrate"),
        (["sweep", "--world-size", "2", "--out", "x"], "--world-size", "pipeline"),
    ],
)
def test_a_bench_flag_its_benchmark_ignores_is_one_line(capsys, argv, flag, named):
    """A flag of another benchmark (e.g. ``bench throughput --threads 4``) ran without a
    word and without the effect the user asked for."""
    rc, line = _fails(capsys, "bench", *argv, "--config", "debug", "--steps", "1")
    assert rc == 2 and f"'{flag}'" in line and "does not take it" in line and named in line


@pytest.mark.parametrize(
    "key", ["data.zipf_alpha", "data.eval_samples", "data.bag_sizes", "model.table_sizes"]
)
def test_synthetic_keys_for_a_run_on_a_dataset_are_refused(tmp_path, capsys, key):
    """The synthetic generator's keys named on the command line of a run on a dataset
    (``--data.zipf_alpha=2 --data.path=DS``) changed nothing, without a word - the twin
    of a dataset's keys on synthetic data - and tables' sizes were replaced by the
    dataset's. ``train`` and ``eval`` refuse them before any work; a preset's own values
    (the debug preset's eval_samples and table sizes) pass through any data, and so does
    ``data.seed`` (it shuffles a dataset too)."""
    ds = make_dataset(tmp_path, 300, seed=2, hash_size=20)
    run = tmp_path / "run"
    value = {"data.zipf_alpha": "2", "data.eval_samples": "100"}.get(key, ",".join(["2"] * 26))
    argv = ["train", "--config", "debug", f"--data.path={ds}", "--data.eval_split=train"]
    argv.append("--train.steps=2")
    rc, line = _fails(capsys, *argv, f"--{key}={value}", "--run-dir", str(run))
    assert rc == 2 and f"'{key}'" in line and f"the dataset {ds}" in line, line
    assert not run.exists()
    assert main([*argv, "--data.seed=7", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    rc, line = _fails(capsys, "eval", "--model", str(run), f"--{key}={value}")
    assert rc == 2 and f"'{key}'" in line, line
