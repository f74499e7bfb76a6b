"""A dataset's id profile (data/id_profile.py): written by preprocessing, read by the ssd
tier's file order; checked against counts of the written ids themselves."""

import json

import numpy as np
import pytest
from helpers import error_line, make_dataset, run_cli

from recscale.config import load_config
from recscale.data.columns import DatasetError, read_metadata
from recscale.data.dataset import BinaryDataset
from recscale.data.id_profile import PROFILE_FILE, read_id_profile
from recscale.dataprep.criteo_tsv import synthetic_lines
from recscale.dataprep.preprocess import PreprocessOptions, preprocess
from recscale.train.data_source import adopt_dataset_shapes, popularity_ranks, sample_id_counts


def _brute_counts(root, f: int, size: int) -> np.ndarray:
    ids = np.asarray(BinaryDataset(root, "train").sparse)[:, f]
    return np.bincount(ids, minlength=size)


@pytest.mark.parametrize("id_mode", ["hash", "vocab"])
def test_the_profile_counts_each_id_of_the_train_split(tmp_path, id_mode):
    src = tmp_path / "in.tsv"
    src.write_text("\n".join(synthetic_lines(1400, seed=3)) + "\n")
    kw = {"hash_sizes": [97]} if id_mode == "hash" else {"min_count": 2}
    out = tmp_path / "ds"
    opts = PreprocessOptions(inputs=[src], out=out, id_mode=id_mode, split="kaggle", **kw)
    meta = preprocess(opts, echo=lambda s: None)
    root = tmp_path / "ds"
    entry = {k: v for k, v in meta["id_profile"].items() if k not in ("hit_curves", "ids")}
    assert entry == {"file": PROFILE_FILE, "split": "train", "rows": 1200}
    profile = read_id_profile(root, read_metadata(root))
    assert len(profile) == 26
    for f in range(26):
        # every id of the train split as written (missing 0, rare 1, hashed), counted here
        counts = _brute_counts(root, f, meta["table_sizes"][f])
        ids, got = profile[f]
        np.testing.assert_array_equal(ids, np.nonzero(counts)[0])
        np.testing.assert_array_equal(got, counts[ids])
    assert sum(int(c.sum()) for _, c in profile) == 26 * 1200


def _dataset_cfg(ds, rows: int, batch: int = 256):
    cfg = load_config(
        "debug",
        [
            f"--data.path={ds}",
            "--data.eval_split=train",
            "--embedding.placement=ssd",
            f"--embedding.order_sample_rows={rows}",
            f"--train.batch_size={batch}",
        ],
    )
    adopt_dataset_shapes(cfg)
    return cfg


def _drop_profile(ds) -> None:
    meta = json.loads((ds / "metadata.json").read_text())
    del meta["id_profile"]
    (ds / "metadata.json").write_text(json.dumps(meta))


def test_the_file_order_is_the_whole_train_splits_not_its_first_samples(tmp_path):
    ds = make_dataset(tmp_path, 3000, seed=2, hash_size=500)
    ranks = popularity_ranks(_dataset_cfg(ds, 256))  # the sample would be one batch
    for f in (0, 5, 25):
        r = ranks(f)
        assert sorted(r.tolist()) == list(range(500))
        counts = _brute_counts(ds, f, 500)
        by_rank = np.argsort(r)
        assert (np.diff(counts[by_rank]) <= 0).all()  # most used first
        ties = counts[by_rank][:-1] == counts[by_rank][1:]
        assert (by_rank[:-1][ties] < by_rank[1:][ties]).all()  # ties by id
    # the same order as counting every sample at start, which a dataset without one does
    _drop_profile(ds)
    counted = popularity_ranks(_dataset_cfg(ds, 3000, batch=250))  # 12 batches: each row once
    for f in (0, 5, 25):
        np.testing.assert_array_equal(counted(f), ranks(f))


def test_a_dataset_without_a_profile_counts_its_first_samples(tmp_path):
    ds = make_dataset(tmp_path, 3000, seed=2, hash_size=500)
    _drop_profile(ds)
    cfg = _dataset_cfg(ds, 2000)
    ranks = popularity_ranks(cfg)
    counted = sample_id_counts(cfg, 2000, [0, 5])
    for f in (0, 5):
        r = ranks(f)
        assert sorted(r.tolist()) == list(range(cfg.model.table_sizes[f]))
        ids, counts = counted[f]
        # ranked by count (ties by id), then the ids never seen, by id
        by_rank = np.argsort(r)
        seen = ids[np.lexsort((ids, -counts))]
        assert by_rank[: len(seen)].tolist() == seen.tolist()
        unseen = sorted(set(range(cfg.model.table_sizes[f])) - set(ids.tolist()))
        assert by_rank[len(seen) :].tolist() == unseen


def test_a_missing_or_foreign_profile_is_named_before_training(tmp_path):
    ds = make_dataset(tmp_path, 3000, seed=2, hash_size=500)
    profile = ds / PROFILE_FILE
    meta = read_metadata(ds)
    good = profile.read_bytes()
    profile.write_bytes(good[:-4])  # one id short: not this dataset's
    with pytest.raises(DatasetError, match="another dataset") as e:
        read_id_profile(ds, meta)
    assert str(profile) in str(e.value)
    other = np.frombuffer(good, np.uint32).copy()
    other[meta["id_profile"]["ids"][0]] += 1  # the right size, table 0 counting other rows
    profile.write_bytes(other.tobytes())
    with pytest.raises(DatasetError, match="table 0's counts add up to 3,001"):
        read_id_profile(ds, meta)
    profile.unlink()
    args = [
        "train",
        "--config=debug",
        f"--data.path={ds}",
        "--data.eval_split=train",
        "--train.steps=5",
        "--train.progress=false",
        "--embedding.placement=ssd",
        f"--embedding.ssd_dir={tmp_path / 'ssd'}",
        f"--run-dir={tmp_path / 'run'}",
    ]
    r = run_cli(*args)
    assert r.returncode != 0
    line = error_line(r.stderr)
    assert str(profile) in line and "missing" in line, line
    assert not (tmp_path / "run" / "metrics.json").exists()
    profile.write_bytes(good)  # put back, the same run trains
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    # in memory the order is not needed: a missing profile does not stop the run
    profile.unlink()
    mem = [a for a in args if "--embedding." not in a and "run-dir" not in a]
    r = run_cli(*mem, f"--run-dir={tmp_path / 'run2'}")
    assert r.returncode == 0, r.stderr


def test_the_planner_reads_the_profiles_hit_curve(tmp_path):
    from recscale.data.id_profile import CURVE_FRACTIONS
    from recscale.planner.from_config import hit_curves

    ds = make_dataset(tmp_path, 3000, seed=2, hash_size=500)
    cfg = _dataset_cfg(ds, 256)
    curves = hit_curves(cfg)
    assert len(curves) == 26
    for f in (0, 7, 25):
        counts = _brute_counts(ds, f, 500)
        top = np.sort(counts)[::-1]
        for (x, y), want_x in zip(curves[f], CURVE_FRACTIONS):
            # a cache of the top ceil(x n) rows serves this share of the split's lookups
            k = max(1, int(np.ceil(x * 500)))
            assert x == want_x and y == pytest.approx(top[:k].sum() / counts.sum())
        assert curves[f][-1][1] > curves[f][0][1]
    # a dataset without a profile: the summary's three points (none for a column of
    # missing values only)
    _drop_profile(ds)
    assert {len(c) for c in hit_curves(cfg)} <= {0, 3} and len(hit_curves(cfg)[0]) == 3


def test_a_multi_hot_copy_drops_the_one_hot_profile_and_preprocess_replaces_its_own(tmp_path):
    from recscale.dataprep.multihot import to_multihot

    ds = make_dataset(tmp_path, 600, seed=4, hash_size=300)
    meta = to_multihot(ds, tmp_path / "mh", [3], echo=lambda s: None)
    # the bags hold other ids than the one-hot columns it counted: no profile, no file
    assert "id_profile" not in meta and not (tmp_path / "mh" / PROFILE_FILE).exists()
    # a dataset's own profile is not a stranger to the next preprocess into the same place
    src = tmp_path / "again.tsv"
    src.write_text("\n".join(synthetic_lines(300, seed=5)) + "\n")
    opts = PreprocessOptions(inputs=[src], out=ds, hash_sizes=[300], split="none")
    assert preprocess(opts, echo=lambda s: None)["id_profile"]["rows"] == 300


def test_data_info_prints_each_tables_hit_curve_on_one_line(tmp_path):
    ds = make_dataset(tmp_path, 600, seed=4, hash_size=300)
    r = run_cli("data", "info", str(ds))
    assert r.returncode == 0, r.stderr
    curves = json.loads(r.stdout)["id_profile"]["hit_curves"]
    stored = read_metadata(ds)["id_profile"]["hit_curves"]
    assert list(curves) == [f"C{i + 1}" for i in range(26)]
    first = curves["C1"].split(", ")
    assert len(first) == 10 and first[0] == f"0.1%: {stored[0][0][1]:.3f}"
