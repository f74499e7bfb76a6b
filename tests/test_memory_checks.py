"""Memory checks before the work: what a run, its evaluation, the synthetic data or the
dense model would need, against the memory there is, refused naming the key that sizes
it - never an allocator traceback after training, or the kernel killing the run."""

from __future__ import annotations

import pytest
from helpers import error_line, make_dataset

from recscale.cli.main import main
from recscale.config import ConfigError, load_config
from recscale.train.parallel import (
    QUEUED_BYTES_PER_ID,
    STEP_BYTES_PER_ID,
    batch_bytes_per_sample,
)


def _fails(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and the one error line of ``recscale ARGV`` run in this process."""
    rc = main(list(argv))
    return rc, error_line(capsys.readouterr().err)


def test_a_batch_beyond_memory_is_refused_before_the_first_batch(capsys):
    rc, line = _fails(capsys, "train", "--config", "debug", "--train.batch_size=10000000000")
    assert rc == 2 and "train.batch_size" in line and "GB" in line


def test_an_eval_batch_beyond_memory_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """The evaluation's batches (train.eval_batch_size, forward only) were never checked:
    dim 65,536 trained its batches of 256, then asked for 56 GB to score 8,192 at once -
    a traceback after the training. Refused before the model is built; the same run
    with smaller eval batches trains, and ``recscale eval`` checks them too."""
    from recscale.train import parallel

    monkeypatch.setattr(parallel, "available_memory", lambda _d: 8 << 30)  # any host alike
    wide = ["--model.embedding_dim=65536", "--model.bottom_mlp=32,65536", "--train.steps=2"]
    run = tmp_path / "r"
    rc, line = _fails(capsys, "train", "--config", "debug", *wide, f"--run-dir={run}")
    assert rc == 2 and "'train.eval_batch_size'" in line and "smaller eval batch" in line, line
    assert not run.exists()
    small = ["--train.progress=false", "--model.embedding_dim=1024", "--model.bottom_mlp=32,1024"]
    small += ["--data.eval_samples=512"]
    assert main(["train", "--config", "debug", "--train.steps=2", *small, f"--run-dir={run}"]) == 0
    capsys.readouterr()
    big = ["--data.eval_samples=90000", "--train.eval_batch_size=90000"]  # ~10 GB at once
    rc, line = _fails(capsys, "eval", "--model", str(run), *big)
    assert rc == 2 and "'train.eval_batch_size'" in line, line


def test_synthetic_datas_first_draw_beyond_memory_names_the_dense_width(monkeypatch):
    """10^5 dense features: the generator's calibration draw (16,384 samples at once)
    asked for 26 GB and the kernel killed the run; named before anything is built. The
    draw's bytes a value are measured here, so the estimate cannot drift from the code."""
    import tracemalloc

    from recscale.data.synthetic import CALIBRATION_ROWS, DENSE_DRAW_BYTES, SyntheticCriteo
    from recscale.train import data_source

    gen = SyntheticCriteo([10] * 3, num_dense=2000, seed=1)
    tracemalloc.start()
    try:
        gen.batch(0, 4096, "eval")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / (4096 * 2000) <= DENSE_DRAW_BYTES + 1  # two float64 copies at most
    cfg = load_config("debug", ["--model.num_dense_features=1000"])
    draw = CALIBRATION_ROWS * 1000 * DENSE_DRAW_BYTES
    monkeypatch.setattr(data_source, "available_memory", lambda _d: int(draw / 0.8) + 1)
    data_source.check_synthetic_memory(cfg)  # just fits
    monkeypatch.setattr(data_source, "available_memory", lambda _d: int(draw / 0.8) - 1)
    with pytest.raises(ConfigError, match="16,384 samples of 1,000 dense features") as e:
        data_source.check_synthetic_memory(cfg)
    assert e.value.key == "model.num_dense_features"


def test_the_batch_estimate_grows_with_the_model_and_stays_low():
    """A low estimate (it refuses only what cannot fit): the MLPerf model's sample is
    larger than the debug model's, and a batch of config A takes well under a GB."""
    debug, a, dcn = (load_config(n) for n in ("debug", "A", "criteo_multihot_dcnv2"))
    assert batch_bytes_per_sample(debug) < batch_bytes_per_sample(a) < batch_bytes_per_sample(dcn)
    assert a.train.batch_size * batch_bytes_per_sample(a) < 1e9


def test_the_batch_estimate_counts_a_multi_hot_datasets_bags(tmp_path):
    """A multi-hot dataset's ids were counted one a table (the synthetic data's mean),
    so 65,535-id bags at batch 256 (33 GB) passed the memory check and the kernel
    killed the run; the planner and the performance model priced one id a table too."""
    from recscale.dataprep.multihot import to_multihot
    from recscale.planner.from_config import ids_per_sample, table_infos

    one_hot = make_dataset(tmp_path, 300, seed=1, hash_size=50)
    bags = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
    to_multihot(one_hot, tmp_path / "mh", bags, echo=lambda _m: None)
    cfgs = [load_config("debug", [f"--data.path={p}"]) for p in (one_hot, tmp_path / "mh")]
    assert ids_per_sample(cfgs[0]) == [1.0] * 26
    assert ids_per_sample(cfgs[1]) == [float(b) for b in bags]
    assert [t.pooling for t in table_infos(cfgs[1])] == [float(b) for b in bags]
    extra = batch_bytes_per_sample(cfgs[1]) - batch_bytes_per_sample(cfgs[0])
    per_id = STEP_BYTES_PER_ID + QUEUED_BYTES_PER_ID * cfgs[1].data.prefetch_batches
    assert extra == (sum(bags) - 26) * per_id and per_id >= 52


def test_a_synthetic_eval_set_beyond_memory_is_refused_before_training(capsys):
    rc, line = _fails(
        capsys, "train", "--config", "debug", "--train.steps=100000", "--data.eval_samples=1e10"
    )
    assert rc == 2 and "data.eval_samples" in line


@pytest.mark.parametrize(
    "name, over",
    [
        ("debug", []),
        ("A", []),
        ("debug", ["--model.interaction_self=true"]),
        ("debug", ["--model.num_dense_features=0", "--model.bottom_mlp="]),
        ("debug", ["--model.interaction=cat"]),
        ("debug", ["--model.interaction=dcnv2"]),
    ],
)
def test_the_dense_parameters_are_counted_as_the_model_allocates_them(name, over):
    from recscale.models.dlrm import build_model
    from recscale.train.parallel import dense_parameter_counts

    cfg = load_config(name, over)
    model = build_model(cfg.model, cfg.embedding)
    built = sum(p.numel() for p in model.dense_parameters())
    assert sum(dense_parameter_counts(cfg).values()) == built


def test_an_mlp_beyond_memory_names_its_key_not_an_allocator_error(capsys):
    rc, line = _fails(
        capsys, "train", "--config", "debug", "--train.batch_size=2", "--model.top_mlp=300000000,1"
    )
    assert rc == 2 and "'model.top_mlp'" in line and "parameters" in line


def test_a_table_width_beyond_memory_names_its_key_not_an_allocator_error(capsys):
    """Choosing each table's kernel had allocated a probe row as wide as the table before
    the memory check: a dim of 1e12 under DCNv2 (no bottom MLP to match) was torch's
    "can't allocate memory" traceback."""
    rc, line = _fails(
        capsys, "train", "--config", "debug", "--model.interaction=dcnv2",
        "--model.embedding_dim=1000000000000",
    )  # fmt: skip
    assert rc == 2 and "'embedding.placement'" in line and "GB" in line


def test_a_forecast_whose_dense_side_fills_the_device_says_so():
    """20,000 tables make a dot interaction of 2e8 pairs: the dense side alone exceeds
    an H100, which the plan's error had blamed on the tables (0.01 GB)."""
    from recscale.perfmodel.devices import device_spec
    from recscale.perfmodel.forecast import forecast
    from recscale.planner.plan import PlanError

    cfg = load_config("debug", ["--model.table_sizes=" + ",".join(["5"] * 20000)])
    with pytest.raises(PlanError, match="dense model's state .* alone exceed"):
        forecast(cfg, device_spec("h100-sxm"), 1, "tf32")


def test_ranks_on_one_host_check_their_tables_against_their_share(tmp_path, capsys, monkeypatch):
    """CPU ranks on one host each checked their tables against the host's whole memory:
    four ranks of 6 GB each passed on 24 GB free, and together the kernel killed them.
    Each checks against its share (``LOCAL_WORLD_SIZE``); alone, the same tables pass."""
    from recscale.train import parallel

    monkeypatch.setattr(parallel, "available_memory", lambda _d: 1 << 30)  # 1.07 GB free
    big = ["train", "--config", "debug", "--train.steps=1", "--model.table_sizes=12000000"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    rc, line = _fails(capsys, *big, "--embedding.optimizer=sgd", "--model.embedding_dim=8")
    assert rc == 2 and "'embedding.placement'" in line, line
    assert "384.00 MB (rows" in line and "268.44 MB are available to each of the 4 ranks" in line
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = [*big, "--embedding.optimizer=sgd", f"--run-dir={tmp_path / 'r'}"]
    assert main([*alone, "--data.eval_samples=256", "--train.save_model=false"]) == 0
