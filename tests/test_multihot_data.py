"""Multi-hot datasets: Parquet list columns -> binary -> batches equal to the input;
`recscale data multihot` against a plain-Python expansion; training on the result."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import make_dataset, run_cli, train_then_eval

from recscale.data.dataset import BatchLoader, BinaryDataset, DatasetError
from recscale.data.multihot import MLPERF_BAG_SIZES, bag_of, expand, feature_salts
from recscale.dataprep.multihot import to_multihot

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

F = 26


def _bags_table(rows: int, seed: int, max_bag: int = 5, hash_size: int = 1000):
    """A multi-hot Parquet table and the bags it holds ([row][feature] -> list of ids)."""
    g = np.random.default_rng(seed)
    bags = [
        [g.integers(0, hash_size, g.integers(0, max_bag + 1)).tolist() for _ in range(F)]
        for _ in range(rows)
    ]
    cols = {"label": pa.array(g.integers(0, 2, rows), pa.int64())}
    dense = g.integers(0, 100, (rows, 13))
    for k in range(13):
        cols[f"I{k + 1}"] = pa.array(dense[:, k], pa.int64())
    for k in range(F):
        cols[f"C{k + 1}"] = pa.array([b[k] for b in bags], pa.list_(pa.int64()))
    return pa.table(cols), bags, dense


def _preprocess(tmp_path, files, *extra):
    out = tmp_path / "mh"
    r = run_cli(
        "data",
        "preprocess",
        "--format",
        "parquet",
        "--input",
        *map(str, files),
        "--out",
        str(out),
        *extra,
    )
    return r, out


def _multi_hot_dataset(tmp_path, rows: int, seed: int):
    """A multi-hot Parquet file of ``rows`` rows preprocessed (no split, ids < hash size):
    (the table, its bags, its raw dense values, the dataset)."""
    table, bags, dense = _bags_table(rows, seed=seed)
    pq.write_table(table, tmp_path / "in.parquet")
    r, out = _preprocess(
        tmp_path, [tmp_path / "in.parquet"], "--split", "none", "--hash-size", "1000"
    )
    assert r.returncode == 0, r.stderr
    return table, bags, dense, BinaryDataset(out, "train")


def _rows_of(batches) -> list[list[list[int]]]:
    """Feature-major jagged batches -> [row][feature] bags."""
    out = []
    for b in batches:
        n, offs, vals = b.batch_size, b.offsets.numpy(), b.values.numpy()
        for i in range(n):
            out.append([vals[offs[f * n + i] : offs[f * n + i + 1]].tolist() for f in range(F)])
    return out


def test_parquet_round_trip_equals_the_input(tmp_path):
    table, bags, dense, ds = _multi_hot_dataset(tmp_path, 700, seed=1)
    assert ds.multi_hot and ds.rows == 700
    batches = list(BatchLoader(ds, 128, shuffle=False, epochs=1, drop_last=False))
    assert _rows_of(batches) == bags
    got_dense = np.concatenate([b.dense.numpy() for b in batches])
    np.testing.assert_allclose(got_dense, np.log1p(dense).astype(np.float32), rtol=1e-6)
    labels = np.concatenate([b.labels.numpy() for b in batches])
    np.testing.assert_array_equal(labels, table.column("label").to_numpy())


def test_shuffled_rank_slices_cover_every_row_once(tmp_path):
    _, bags, _, ds = _multi_hot_dataset(tmp_path, 1000, seed=2)
    kw = dict(shuffle=True, seed=4, block_rows=128, epochs=1)
    one = _rows_of(BatchLoader(ds, 100, **kw))
    assert sorted(map(str, one)) == sorted(map(str, bags))  # a permutation of every row
    assert one != bags
    # four ranks' slices put together are the single process's batches
    ranks = [_rows_of(BatchLoader(ds, 100, rank=r, world_size=4, **kw)) for r in range(4)]
    joined = [row for i in range(10) for r in range(4) for row in ranks[r][i * 25 : (i + 1) * 25]]
    assert joined == one


def test_parquet_bad_rows_are_counted_with_file_and_row(tmp_path):
    table, _, _ = _bags_table(50, seed=3)
    labels = table.column("label").to_pylist()
    labels[7] = 3
    c5 = table.column("C5").to_pylist()
    c5[11] = [4, -2]
    table = table.set_column(0, "label", pa.array(labels, pa.int64()))
    table = table.set_column(
        table.schema.get_field_index("C5"), "C5", pa.array(c5, pa.list_(pa.int64()))
    )
    pq.write_table(table, tmp_path / "bad.parquet")
    r, out = _preprocess(
        tmp_path, [tmp_path / "bad.parquet"], "--split", "none", "--max-bad-fraction", "0.1"
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["bad_lines"]["counts"] == {"bad label": 1, "id outside 0..2^32-1": 1}
    assert meta["bad_lines"]["examples"]["bad label"] == [f"{tmp_path / 'bad.parquet'}:8"]
    assert meta["splits"]["train"]["rows"] == 48
    r, _ = _preprocess(tmp_path, [tmp_path / "bad.parquet"], "--mode", "vocab")
    assert r.returncode == 1 and "--mode hash only" in r.stderr


def test_parquet_bad_ids_are_named_by_what_is_wrong(tmp_path):
    """Integer ids are not hex text: a null id inside a bag and an id outside 0..2^32-1
    (negative, 2^32, unsigned 2^64-1 - which a cast through float64 rounded) are each
    counted under their own kind with file:row, not as "non-hex category"; a null bag is
    an empty one; 2^32-1 is a good id."""
    table, _, _ = _bags_table(40, seed=5)
    n = table.num_rows

    def put(name, values, type_):
        return table.set_column(table.schema.get_field_index(name), name, pa.array(values, type_))

    c3 = table.column("C3").to_pylist()
    c3[2], c3[5], c3[9] = [1, None], None, [2**32 - 1]
    table = put("C3", c3, pa.list_(pa.int64()))
    c7 = [[1]] * n
    c7[4], c7[6] = [2**64 - 1], [2**32]
    table = put("C7", c7, pa.list_(pa.uint64()))
    c9 = list(range(n))  # a scalar integer column among the lists: a bag of one
    c9[8] = -1
    table = put("C9", c9, pa.int64())
    pq.write_table(table, tmp_path / "ids.parquet")
    r, out = _preprocess(
        tmp_path, [tmp_path / "ids.parquet"], "--split", "none", "--max-bad-fraction", "0.2"
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    bad = meta["bad_lines"]
    assert bad["counts"] == {"null id in a bag": 1, "id outside 0..2^32-1": 3}
    where = str(tmp_path / "ids.parquet")
    assert bad["examples"]["null id in a bag"] == [f"{where}:3"]
    assert bad["examples"]["id outside 0..2^32-1"] == [f"{where}:5", f"{where}:7", f"{where}:9"]
    assert meta["splits"]["train"]["rows"] == n - 4


def test_parquet_one_hot_integer_ids_outside_32_bits_are_named(tmp_path):
    """Criteo Parquet with integer categories (one-hot): a negative id and unsigned
    2^64-1 are "id outside 0..2^32-1" with file:row; null is a missing category."""
    n = 30
    cols = {"label": pa.array([k % 2 for k in range(n)], pa.int64())}
    cols |= {f"I{k}": pa.array([k] * n, pa.int64()) for k in range(1, 14)}
    cols |= {f"C{k}": pa.array([k * 7 + r for r in range(n)], pa.int64()) for k in range(1, 27)}
    c2 = list(range(n))
    c2[3], c2[4], c2[11] = -5, None, 2**32 - 1
    cols["C2"] = pa.array(c2, pa.int64())
    c4 = [1] * n
    c4[6] = 2**64 - 1
    cols["C4"] = pa.array(c4, pa.uint64())
    pq.write_table(pa.table(cols), tmp_path / "ids.parquet")
    r, out = _preprocess(
        tmp_path, [tmp_path / "ids.parquet"], "--split", "none", "--max-bad-fraction", "0.2"
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    bad = meta["bad_lines"]
    where = str(tmp_path / "ids.parquet")
    assert bad["counts"] == {"id outside 0..2^32-1": 2}
    assert bad["examples"]["id outside 0..2^32-1"] == [f"{where}:4", f"{where}:7"]
    assert meta["splits"]["train"]["rows"] == n - 2


def test_multi_hot_parquet_with_a_text_column_names_it(tmp_path):
    """A list column makes the file multi-hot; a hex-string column beside it is named
    with what the multi-hot reader takes (was "want list<int> or int", which read as if
    the list column were wrong)."""
    table, _, _ = _bags_table(10, seed=6)
    i = table.schema.get_field_index("C4")
    table = table.set_column(i, "C4", pa.array(["0a"] * 10))
    pq.write_table(table, tmp_path / "mixed.parquet")
    r, out = _preprocess(tmp_path, [tmp_path / "mixed.parquet"], "--split", "none")
    assert r.returncode == 1 and not out.exists()
    assert "column C4: is string; multi-hot Parquet" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_file_whose_rows_are_all_bad_is_counted_not_a_crash(tmp_path):
    """A block with no good row stopped preprocessing with "memoryview: cannot cast view
    with zeros in shape" instead of counting its rows; a label column of text was a bare
    "could not convert string to float"."""
    good, bags, _ = _bags_table(300, seed=6)
    pq.write_table(good, tmp_path / "good.parquet")
    bad, _, _ = _bags_table(10, seed=7)
    bad = bad.set_column(0, "label", pa.array([None] * 10, pa.int64()))
    pq.write_table(bad, tmp_path / "bad.parquet")
    files = [tmp_path / "good.parquet", tmp_path / "bad.parquet"]
    r, out = _preprocess(tmp_path, files, "--split", "none", "--max-bad-fraction", "0.05")
    assert r.returncode == 0, r.stderr
    assert BinaryDataset(out, "train").rows == 300
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["bad_lines"]["counts"] == {"bad label": 10}
    r, _ = _preprocess(tmp_path, [tmp_path / "bad.parquet"], "--split", "none")
    assert r.returncode == 1 and "10 bad lines of 10" in r.stderr and "Traceback" not in r.stderr
    text = good.set_column(0, "label", pa.array(["x"] * 300))
    pq.write_table(text, tmp_path / "text.parquet")
    r, _ = _preprocess(tmp_path, [tmp_path / "text.parquet"], "--split", "none")
    assert r.returncode == 1 and "column 'label' is string" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def onehot(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("onehot"), 3000, seed=5, hash_size=500)


@pytest.mark.parametrize("layout", ["rule", "ids"])
def test_multihot_expansion_matches_plain_python(tmp_path, onehot, layout):
    sizes = [1 + (k % 4) for k in range(F)]
    to_multihot(onehot, tmp_path / "mh", sizes, seed=9, layout=layout, echo=lambda _m: None)
    src, ds = BinaryDataset(onehot, "train"), BinaryDataset(tmp_path / "mh", "train")
    assert ds.multi_hot and ds.rows == src.rows and (ds.bag_rule is not None) == (layout == "rule")
    salts = feature_salts(F, 9)
    rows = _rows_of(BatchLoader(ds, 1000, shuffle=False, epochs=1))
    for r in (0, 1, 999, 2999):
        for f in range(F):
            x, n = int(src.sparse[r, f]), src.table_sizes[f]
            want = bag_of(x, f, sizes[f], n, salts)
            assert rows[r][f] == want and want[0] == x and all(0 <= y < n for y in want)
    np.testing.assert_array_equal(np.asarray(ds.dense), np.asarray(src.dense))
    # deterministic: the same input, sizes and seed give the same bytes
    to_multihot(onehot, tmp_path / "again", sizes, seed=9, layout=layout, echo=lambda _m: None)
    names = ("sparse.i32", "dense.f32", "labels.u8") + (
        ("row_offsets.i64", "bag_lengths.u16") if layout == "ids" else ()
    )
    for name in names:
        assert (tmp_path / "mh/train" / name).read_bytes() == (
            tmp_path / "again/train" / name
        ).read_bytes()


def test_rule_layout_gives_the_batches_of_the_ids_layout(tmp_path, onehot):
    """The loader's on-read expansion vs the written ids: shuffled blocks, two ranks'
    slices, an epoch boundary and a resume mid-epoch - every batch equal."""
    from recscale.data.dataset import LoaderPosition

    sizes = [1 + (k % 7) for k in range(F)]
    for layout in ("rule", "ids"):
        to_multihot(onehot, tmp_path / layout, sizes, seed=3, layout=layout, echo=lambda _m: None)
    rule, ids = (BinaryDataset(tmp_path / n, "train") for n in ("rule", "ids"))
    assert rule.meta["splits"]["train"]["ids"] == ids.meta["splits"]["train"]["ids"]
    on_disk = {
        n: sum(p.stat().st_size for p in (tmp_path / n).rglob("*.*") if p.is_file())
        for n in ("rule", "ids")
    }
    assert on_disk["rule"] < on_disk["ids"] / 2
    for rank in (0, 1):
        kw = dict(shuffle=True, seed=4, block_rows=700, rank=rank, world_size=2)
        pos = {"rule": LoaderPosition(epoch=1, batch=3), "ids": LoaderPosition(epoch=1, batch=3)}
        for a, b in zip(*(list(zip(range(12), BatchLoader(ds, 256, **kw))) for ds in (rule, ids))):
            for name in ("dense", "values", "offsets", "labels"):
                assert torch.equal(getattr(a[1], name), getattr(b[1], name)), name
        resumed = [
            list(zip(range(8), BatchLoader(ds, 256, position=pos[n], **kw)))
            for n, ds in (("rule", rule), ("ids", ids))
        ]
        for (_, a), (_, b) in zip(*resumed):
            assert torch.equal(a.values, b.values) and torch.equal(a.offsets, b.offsets)


def test_rule_layout_refuses_broken_metadata(tmp_path, onehot):
    to_multihot(onehot, tmp_path / "mh", [2], seed=0, echo=lambda _m: None)
    meta = json.loads((tmp_path / "mh/metadata.json").read_text())
    for bad, match in (
        ({"bag_sizes": [2, 2]}, "without valid bag_sizes"),
        ({"multi_hot_layout": "packed"}, "unknown multi_hot_layout"),
        ({"bag_sizes": [2.5] * F}, "without valid bag_sizes"),  # not silently int()-ed
        ({"bag_sizes": [70_000] * F}, "without valid bag_sizes"),  # lengths are uint16
        ({"multi_hot_seed": "abc"}, "multi_hot_seed is 'abc'"),
    ):
        (tmp_path / "mh/metadata.json").write_text(json.dumps({**meta, **bad}))
        with pytest.raises(DatasetError, match=match):
            BinaryDataset(tmp_path / "mh", "train")
    with pytest.raises(ValueError, match="--layout takes one of rule, ids"):
        to_multihot(onehot, tmp_path / "x", [2], layout="packed", echo=lambda _m: None)


def test_ids_layout_refuses_a_split_without_its_id_count(tmp_path, onehot):
    to_multihot(onehot, tmp_path / "mh", [2], seed=0, layout="ids", echo=lambda _m: None)
    meta = json.loads((tmp_path / "mh/metadata.json").read_text())
    del meta["splits"]["train"]["ids"]
    (tmp_path / "mh/metadata.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match="multi-hot split 'train' without its ids count"):
        BinaryDataset(tmp_path / "mh", "train")


def test_expand_ids_stay_in_their_tables():
    sizes, bag = [7, 100_000, 3], [3, 100, 2]
    ids = np.array([[6, 99_999, 2], [0, 5, 1]], np.int32)
    out = expand(ids, sizes, bag, 0).reshape(2, -1)
    assert (out[:, :3] < 7).all() and (out[:, 3:103] < 100_000).all() and (out[:, 103:] < 3).all()
    assert out[0, 0] == 6 and out[0, 3] == 99_999 and out[0, 103] == 2
    # a bag spreads over its table: 99 draws of a 100k-row table are nearly all distinct
    assert len(set(out[0, 4:103].tolist())) >= 95
    assert expand(ids, sizes, bag, 1).tolist() != out.reshape(-1).tolist()  # the seed matters


def test_multihot_cli_refuses_bad_sizes_and_multi_hot_input(tmp_path, onehot):
    cmd = ["data", "multihot", "--input", str(onehot)]
    r = run_cli(*cmd, "--out", str(tmp_path / "x"), "--bag-sizes", "1,2")
    assert r.returncode == 1 and "1 or 26 sizes" in r.stderr
    r = run_cli(*cmd, "--out", str(tmp_path / "mh"))
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "mh/metadata.json").read_text())
    assert meta["bag_sizes"] == list(MLPERF_BAG_SIZES)
    with pytest.raises(DatasetError, match="multi-hot already"):
        to_multihot(tmp_path / "mh", tmp_path / "y", [1], echo=lambda _m: None)


def test_train_and_eval_on_multi_hot(tmp_path, onehot):
    to_multihot(onehot, tmp_path / "mh", [2] * F, echo=lambda _m: None)
    m, scored = train_then_eval(tmp_path / "mh", tmp_path / "run", steps=15)
    assert m["count"] == 3000 and m["steps"] == 15 and np.isfinite(m["logloss"])
    assert scored["auc"] == pytest.approx(m["auc"])


def test_synthetic_fixed_bag_sizes_and_config_checks():
    from recscale.config import load_config
    from recscale.config.errors import ConfigError
    from recscale.planner.from_config import table_infos
    from recscale.train.data_source import make_synthetic

    sizes = [1 + (k % 5) for k in range(F)]
    cfg = load_config("default", ["--data.bag_sizes=" + ",".join(map(str, sizes))])
    b = make_synthetic(cfg).batch(0, 64)
    lengths = b.lengths().view(F, 64)
    assert (lengths == torch.tensor(sizes)[:, None]).all()
    assert [t.pooling for t in table_infos(cfg)] == sizes
    with pytest.raises(ConfigError, match="data.bag_sizes.*has 3 entries, one a table: 26"):
        load_config("default", ["--data.bag_sizes=1,2,3"])
    mlperf = load_config("criteo_multihot_dcnv2")
    assert mlperf.data.bag_sizes == list(MLPERF_BAG_SIZES)


def test_multi_hot_loader_resumes_exactly(tmp_path):
    from recscale.data.dataset import LoaderPosition

    _, _, _, ds = _multi_hot_dataset(tmp_path, 900, seed=6)
    kw = dict(shuffle=True, seed=5, block_rows=200)
    full = [b for _, b in zip(range(20), BatchLoader(ds, 128, **kw))]
    pos = LoaderPosition()
    it = iter(BatchLoader(ds, 128, position=pos, **kw))
    for _ in range(9):  # crosses the epoch boundary (7 batches an epoch)
        next(it)
    saved = LoaderPosition(**pos.state_dict())
    resumed = [b for _, b in zip(range(11), BatchLoader(ds, 128, position=saved, **kw))]
    for a, b in zip(full[9:], resumed):
        assert np.array_equal(a.values.numpy(), b.values.numpy())
        assert np.array_equal(a.offsets.numpy(), b.offsets.numpy())
