"""The Criteo text parser's dense fields against Python's own integers: any decimal
integer is a value (however many digits; Parquet's int64 columns take the same ones),
anything else in a dense field is a "non-integer dense value"."""

import math

import numpy as np
import pytest

from recscale.data.criteo_parse import BAD_KINDS, NUM_FIELDS, ParsedChunk

GOOD = ["1", *(["3"] * 13), *(["0000000a"] * 26)]
NON_INTEGER = BAD_KINDS[3]


def _parse_dense(value: str) -> tuple[int, float]:
    """(status, I2) of one line whose I2 is ``value``."""
    fields = list(GOOD)
    fields[2] = value
    assert len(fields) == NUM_FIELDS
    buf = np.frombuffer(("\t".join(fields) + "\n").encode(), np.uint8)
    chunk = ParsedChunk(2).parse(buf)
    assert chunk.lines == 1
    return int(chunk.status[0]), float(chunk.dense[0, 1]) if chunk.rows else math.nan


def _reference(value: str) -> float:
    """log(1 + max(x, 0)) of Python's unbounded integer, as float32 stores it."""
    return float(np.float32(math.log1p(float(max(int(value), 0)))))


@pytest.mark.parametrize(
    "value",
    [
        "0",
        "7",
        "-0",
        "-3",
        "007",
        "4294967296",
        "999999999999999999",  # 18 digits: the most an int64 holds without a check
        "9223372036854775807",  # int64's largest
        "9223372036854775808",  # one past it
        "18446744073709551616",
        "99999999999999999999999",
        "-9223372036854775809",
        "0000000000000000000000001",  # leading zeros count as digits too
    ],
)
def test_any_decimal_integer_is_a_value_as_python_reads_it(value):
    status, got = _parse_dense(value)
    assert status == 0, value
    assert got == pytest.approx(_reference(value), rel=1e-6), value


def test_an_integer_past_floats_range_stays_finite():
    for value in ("9" * 400, "1" + "0" * 308):
        status, got = _parse_dense(value)
        assert status == 0 and math.isfinite(got) and got == pytest.approx(math.log1p(1e300))


@pytest.mark.parametrize("value", ["+3", " 3", "3 ", "1e5", "0x10", "2.5", "-", "--1", "\uff13"])
def test_what_is_not_a_decimal_integer_is_counted_bad(value):
    status, _ = _parse_dense(value)
    assert BAD_KINDS[status] == NON_INTEGER, value


def test_a_long_label_is_still_a_bad_label():
    fields = list(GOOD)
    fields[0] = "0" * 19 + "1"
    chunk = ParsedChunk(2).parse(np.frombuffer(("\t".join(fields) + "\n").encode(), np.uint8))
    assert chunk.rows == 0 and BAD_KINDS[int(chunk.status[0])] == "bad label"


def _parquet(path, dense_column, pa, pq, c2=None):
    n = len(dense_column)
    cols = {"label": pa.array([k % 2 for k in range(n)])}
    cols |= {f"I{k}": pa.array(list(range(1, n + 1))) for k in range(1, 14)}
    cols["I3"] = dense_column
    cols |= {f"C{k}": pa.array([f"{k:02x}"] * n) for k in range(1, 27)}
    if c2 is not None and pa.types.is_list(c2.type):  # multi-hot: every feature a bag
        cols |= {f"C{k}": pa.array([[k]] * n, c2.type) for k in range(1, 27)}
    if c2 is not None:
        cols["C2"] = c2
    pq.write_table(pa.table(cols), path)
    return path


def _preprocess(tmp_path, src, name, what="dense"):
    from recscale.dataprep.preprocess import PreprocessOptions, preprocess

    out = tmp_path / name
    meta = preprocess(
        PreprocessOptions(
            inputs=[src], out=out, input_format="parquet", hash_sizes=[1000], split="none",
            max_bad_fraction=0.9,
        ),
        echo=lambda s: None,
    )  # fmt: skip
    if what == "dense":
        return meta, np.fromfile(out / "train" / "dense.f32", np.float32).reshape(-1, 13)
    return meta, np.fromfile(out / "train" / "sparse.i32", np.int32).reshape(-1, 26)


def test_parquet_dense_floats_as_pandas_writes_them_read_as_the_integers(tmp_path):
    """pandas stores an integer column with a missing value as float64 (NaN): that
    column was refused whole ("must be integer, is double")."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ints = [7, None, 0, -3, 2**40, 12]
    floats = [7.0, float("nan"), 0.0, -3.0, 2.0**40, 12.0]
    m_int, d_int = _preprocess(
        tmp_path, _parquet(tmp_path / "i.parquet", pa.array(ints), pa, pq), "i"
    )
    m_flt, d_flt = _preprocess(
        tmp_path, _parquet(tmp_path / "f.parquet", pa.array(floats), pa, pq), "f"
    )
    assert m_int["bad_lines"]["bad"] == m_flt["bad_lines"]["bad"] == 0
    np.testing.assert_array_equal(d_flt, d_int)
    want = [math.log1p(max(x or 0, 0)) for x in ints]
    np.testing.assert_allclose(d_flt[:, 2], want, rtol=1e-6)


def test_parquet_dense_values_that_are_not_whole_are_counted_bad(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    values = [1.0, 2.5, float("inf"), 4.0, float("-inf"), 6.0, 1e-9, 8.0]
    src = _parquet(tmp_path / "f.parquet", pa.array(values, pa.float32()), pa, pq)
    meta, dense = _preprocess(tmp_path, src, "f")
    assert meta["bad_lines"]["counts"] == {NON_INTEGER: 4}
    assert meta["bad_lines"]["examples"][NON_INTEGER] == [f"{src}:{n}" for n in (2, 3, 5, 7)]
    np.testing.assert_allclose(dense[:, 2], [math.log1p(x) for x in (1, 4, 6, 8)], rtol=1e-6)


def test_a_parquet_dense_column_of_another_type_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = _parquet(tmp_path / "b.parquet", pa.array([True, False]), pa, pq)
    with pytest.raises(ValueError, match=r"column I3 must be integer.*is bool"):
        _preprocess(tmp_path, src, "b")


def test_parquet_float_ids_read_as_the_integers_and_nan_is_missing(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    dense = pa.array([1, 2, 3, 4])
    ints = pa.array([7, None, 0, 2**32 - 1], pa.int64())
    floats = pa.array([7.0, float("nan"), 0.0, 2.0**32 - 1])
    m_i, s_i = _preprocess(tmp_path, _parquet(tmp_path / "i.pq", dense, pa, pq, ints), "i", "ids")
    m_f, s_f = _preprocess(tmp_path, _parquet(tmp_path / "f.pq", dense, pa, pq, floats), "f", "ids")
    assert m_i["bad_lines"]["bad"] == m_f["bad_lines"]["bad"] == 0
    np.testing.assert_array_equal(s_f, s_i)
    assert s_f[:, 1].tolist() == [7, 0, 0, (2**32 - 1) % 1000]


def test_parquet_float_ids_that_are_not_whole_or_in_range_are_counted_bad(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ids = pa.array([1.0, 2.5, -1.0, 4.0, 2.0**32, float("inf"), 7.0])
    src = _parquet(tmp_path / "f.pq", pa.array(list(range(7))), pa, pq, ids)
    meta, sparse = _preprocess(tmp_path, src, "f", "ids")
    report = meta["bad_lines"]
    assert report["counts"] == {"id not a whole number": 2, "id outside 0..2^32-1": 2}
    assert report["examples"]["id not a whole number"] == [f"{src}:2", f"{src}:6"]
    assert report["examples"]["id outside 0..2^32-1"] == [f"{src}:3", f"{src}:5"]
    assert sparse[:, 1].tolist() == [1, 4, 7]


def test_multi_hot_parquet_bags_of_floats_read_as_bags_of_integers(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    bags = [[1, 2], [3], [], [4, 5, 6]]
    outs = {}
    for name, typ in (("i", pa.int64()), ("f", pa.float64())):
        ids = pa.array([[float(x) if name == "f" else x for x in b] for b in bags], pa.list_(typ))
        src = _parquet(tmp_path / f"{name}.pq", pa.array([1, 2, 3, 4]), pa, pq, ids)
        meta, _ = _preprocess(tmp_path, src, name)
        assert meta["bad_lines"]["bad"] == 0
        files = sorted((tmp_path / name / "train").iterdir())
        outs[name] = {f.name: f.read_bytes() for f in files}
    assert "bag_lengths.u16" in outs["i"]  # written as multi-hot
    assert outs["f"] == outs["i"]
