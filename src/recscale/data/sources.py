"""Input sources for preprocessing: streams of parsed Criteo rows in bounded memory.

* TSV, plain or gzip (detected by magic bytes, multi-member gzip supported). A
  reader thread reads/decompresses ``chunk_bytes`` at a time while the parser
  threads work; chunks end at a line boundary. A gzip stream that ends before its
  end-of-stream marker is reported as truncated, one that zlib cannot decode (a bad
  block, a failed CRC) as damaged, each with the lines read before it.
* Parquet (pyarrow): columns ``label, I1..I13, C1..C26``; categorical columns may
  be integers or hex strings.

Every source yields :class:`Piece`: parsed columns plus per-line statuses.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recscale.data.columns import DatasetError
from recscale.data.criteo_parse import (
    BAD_DENSE,
    BAD_HEX,
    BAD_ID_FRACTION,
    BAD_ID_RANGE,
    BAD_LABEL,
    BAD_LONG_LINE,
    NUM_CAT,
    NUM_DENSE,
    ParsedChunk,
)
from recscale.data.prefetch import Prefetcher

GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
# A line longer than this is no Criteo line (39 fields, ~150-500 bytes): the reader
# stops there rather than hold a file without line breaks whole in memory.
MAX_LINE_BYTES = 1 << 20


@dataclass
class Piece:
    chunks: list[ParsedChunk]  # in line order
    text_bytes: int
    # why the file's gzip stream stopped early after this piece: "" (it did not),
    # "truncated" (no end-of-stream marker) or "damaged (zlib's reason)"
    gzip_cut: str = ""
    first_line: int = 1  # line number (1-based) of the piece's first line in its file


def _raw_blocks(path: Path, chunk_bytes: int) -> Iterator[tuple[bytes, str]]:
    """Decompressed (or plain) byte blocks, each with why the gzip stream stopped early
    after it ("" where it did not; see ``Piece.gzip_cut``)."""
    with open(path, "rb") as f:
        is_gzip = f.read(2) == GZIP_MAGIC
        f.seek(0)
        if not is_gzip:
            while block := f.read(chunk_bytes):
                yield block, ""
            return
        d = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
        pending = b""
        while True:
            comp = f.read(1 << 20) if not pending else pending
            pending = b""
            if not comp:
                yield b"", "" if d.eof else "truncated"  # the file ended: did the stream?
                return
            try:
                out = d.decompress(comp)
            except zlib.error as e:  # a bad block or CRC: corrupt, not short
                yield b"", f"damaged ({e})"
                return
            if out:
                yield out, ""
            if d.eof:  # next gzip member, if any
                pending = d.unused_data
                d = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
                if not pending:
                    rest = f.read(1 << 20)
                    if not rest:
                        return
                    pending = rest


def _without_bom(blocks: Iterator[tuple[bytes, str]]) -> Iterator[tuple[bytes, str]]:
    """``blocks`` less a UTF-8 byte-order mark opening the text (what editors on Windows
    write): not data - it made the first line a bad one, and a file of under 1,000
    lines fail ``--max-bad-fraction`` for it."""
    head = b""
    for block, cut_short in blocks:
        head += block
        if len(head) >= len(UTF8_BOM) or cut_short:
            yield head.removeprefix(UTF8_BOM), cut_short
            break
    else:
        if head:
            yield head.removeprefix(UTF8_BOM), ""
        return
    yield from blocks


def _line_blocks(path: Path, chunk_bytes: int) -> Iterator[tuple[bytes | None, str]]:
    """Blocks of whole lines of about ``chunk_bytes`` (the last may lack a newline).

    The str says why a gzip file's last block is its last (``Piece.gzip_cut``); the
    partial line at the cut is dropped (it never existed whole in the file). A line
    longer than ``MAX_LINE_BYTES`` after whole lines (a run of zeros a crash left, lines
    run together) is read through to its end without being held and stands as
    ``(None, "")``: one bad line. Before any whole line it is an error: the file is not
    text, or its lines end in CR alone.
    """
    carry, parts, size, done = b"", [], 0, 0  # done: bytes of whole lines yielded
    skipping = False  # inside an over-long line, dropping its bytes
    for block, cut_short in _without_bom(_raw_blocks(path, chunk_bytes)):
        if skipping and block:
            end = block.find(b"\n")
            block = b"" if end < 0 else block[end + 1 :]
            if end >= 0:
                skipping = False
                yield None, ""
        if cut_short:
            if skipping:  # the stream stopped inside it
                yield None, ""
            data = carry + b"".join(parts) + block
            yield data[: data.rfind(b"\n") + 1], cut_short
            return
        if not block:
            continue
        parts.append(block)
        size += len(block)
        if size >= chunk_bytes:
            data = carry + b"".join(parts)
            parts, size = [], 0
            cut = data.rfind(b"\n") + 1
            carry = data[cut:]
            if cut:
                done += cut
                yield data[:cut], ""
            if len(carry) > MAX_LINE_BYTES:  # held whole, it would grow with the file
                if not done:
                    raise DatasetError(
                        f"{path}: no line break in {len(carry):,} bytes from its start (a "
                        f"Criteo line is under 1 kB; lines ending in CR alone or a file "
                        f"that is not text read so): not a Criteo TSV file"
                    )
                carry, skipping = b"", True
    if skipping:  # the file's last line
        yield None, ""
        return
    data = carry + b"".join(parts)
    if data:
        yield data, ""


def _split_at_newline(data: bytes, parts: int) -> list[bytes]:
    out, start = [], 0
    for k in range(1, parts):
        pos = data.find(b"\n", max(start, len(data) * k // parts))
        if pos < 0:
            break
        out.append(data[start : pos + 1])
        start = pos + 1
    out.append(data[start:])
    return [p for p in out if p]


def tsv_pieces(
    path: Path, chunk_bytes: int, pool: ThreadPoolExecutor, threads: int
) -> Iterator[Piece]:
    line = 1
    for data, gzip_cut in Prefetcher(_line_blocks(path, chunk_bytes), depth=2):
        if data is None:  # a line over MAX_LINE_BYTES, read through: one bad line
            long = ParsedChunk(1)
            long.status[0], long.lines, long.rows = BAD_LONG_LINE, 1, 0
            yield Piece([long], 0, "", line)
            line += 1
            continue
        parts = _split_at_newline(data, threads) if data else []

        def parse(part: bytes) -> ParsedChunk:
            buf = np.frombuffer(part, dtype=np.uint8)
            return ParsedChunk(int(np.count_nonzero(buf == 10)) + 1).parse(buf)

        chunks = list(pool.map(parse, parts))
        yield Piece(chunks, len(data), gzip_cut, line)
        line += sum(c.lines for c in chunks)


_HEX = np.full(256, -1, np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _hex_column(col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrow string column -> (values uint32, missing bool, bad bool), vectorised.

    Each value is padded to 8 characters and the 8-byte strings read as one
    ``[n, 8]`` byte array, so every padded string must be exactly 8 bytes: a value
    longer than 8 bytes, or holding a character beyond ASCII (``"ééé"``: 3 characters,
    6 bytes), is bad and stands in as ``"00000000"``. (Padding by characters had made
    such a string longer than 8 bytes and shifted every later row's digits.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(col)
    chars = pc.fill_null(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False)
    nbytes = pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
    missing = nbytes == 0
    bad = (nbytes > 8) | (nbytes != chars)
    padded = pc.utf8_lpad(pc.fill_null(col, ""), 8, "0")
    padded = pc.if_else(pa.array(bad), pa.scalar("00000000", col.type), padded)
    width = 8 if pa.types.is_string(padded.type) else 16  # offsets: int32 or int64
    offsets = np.frombuffer(padded.buffers()[1], f"<i{width // 2}")
    first = int(offsets[padded.offset])
    if int(offsets[padded.offset + n]) - first != 8 * n:
        raise AssertionError("padded hex column is not 8 bytes a value")
    raw = np.frombuffer(padded.buffers()[2], np.uint8)[first : first + 8 * n].reshape(n, 8)
    nib = _HEX[raw]
    bad |= (nib < 0).any(axis=1) & ~missing
    nib = np.where(nib < 0, 0, nib).astype(np.uint32)
    values = np.zeros(n, np.uint32)
    for k in range(8):
        values = (values << 4) | nib[:, k]
    return np.where(missing, 0, values).astype(np.uint32), missing, bad


def _category_column(col, path: Path, name: str):
    """A category column as strings for :func:`_hex_column`: dictionary-encoded ones
    (pandas' category dtype, Spark) decoded; anything but text or integers is named."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise ValueError(f"{path}: column {name} must hold hex strings or integers, is {col.type}")
    return col


def parquet_dense(rb, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Columns ``I1..I13`` of a record batch -> (log(1 + max(x, 0)) [n, 13], bad [n]).

    Integer columns as they are; floating ones too (pandas stores an integer column
    with a missing value as float64), where NaN and null are missing and a value that
    is not a whole number (2.5, inf) makes its row a "non-integer dense value", as in
    the text. Any other type is a ValueError naming the column."""
    import pyarrow as pa

    dense = np.zeros((rb.num_rows, NUM_DENSE), np.float32)
    bad = np.zeros(rb.num_rows, bool)
    for k in range(NUM_DENSE):
        col = rb.column(f"I{k + 1}")
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise ValueError(
                f"{path}: column I{k + 1} must be integer (or whole floats), is {col.type}"
            )
        x = col.to_numpy(zero_copy_only=False).astype(np.float64)  # null -> NaN: missing
        if pa.types.is_floating(col.type):
            bad |= np.isinf(x) | (np.isfinite(x) & (x != np.floor(x)))
        x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # a bad row's value is unused
        dense[:, k] = np.log1p(np.maximum(x, 0.0))
    return dense, bad


# Schema metadata key of the Parquet splits preprocess writes (--parquet-out).
PREPROCESSED_KEY = b"recscale.preprocessed"

CRITEO_COLUMNS = (
    "label",
    *(f"I{k + 1}" for k in range(NUM_DENSE)),
    *(f"C{k + 1}" for k in range(NUM_CAT)),
)


def parquet_schema(path: Path):
    """``path``'s Arrow schema; a file Parquet cannot read, or one naming a Criteo
    column twice (which of the two is the feature?), is a ValueError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    if PREPROCESSED_KEY in (schema.metadata or {}):
        raise ValueError(
            f"{path}: a split `recscale data preprocess --parquet-out` wrote (its dense "
            "values already log(1 + x), its ids already table rows), not raw Criteo "
            f"data: train on its dataset (--data.path {path.parent}), or preprocess the "
            "raw files"
        )
    twice = [c for c in CRITEO_COLUMNS if schema.names.count(c) > 1]
    if twice:
        raise ValueError(
            f"{path}: column {twice[0]!r} appears {schema.names.count(twice[0])} times; "
            "each Criteo column must appear once"
        )
    return schema


def ids_beyond_32_bits(v: np.ndarray) -> np.ndarray:
    """Where integer ids fall outside 0..2^32-1, compared in their own type (through
    float64, unsigned 2^64-1 rounded and wrapped)."""
    return (v >= 2**32) if v.dtype.kind == "u" else (v < 0) | (v >= 2**32)


def id_values(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ids as stored (integers, or floats - pandas stores an integer column with a gap
    as float64) -> (uint32 ids, each one's ``BAD_KINDS`` code or 0). A float id must be
    whole; either kind must fall in 0..2^32-1. NaN here is not missing: the caller
    takes nulls (and a float column's NaN) out first."""
    bad = np.zeros(v.shape[0], np.int8)
    if v.dtype.kind == "f":
        bad[~np.isfinite(v) | (v != np.floor(v))] = BAD_ID_FRACTION
    bad[(bad == 0) & ids_beyond_32_bits(v)] = BAD_ID_RANGE
    return np.where(bad == 0, v, 0).astype(np.uint32), bad


def float_nulls(col):
    """A float column with NaN as null (pandas' missing integer), else ``col``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_floating(col.type):
        return pc.if_else(pc.is_nan(col), pa.scalar(None, col.type), col)
    return col


def parquet_pieces(path: Path, rows_per_piece: int = 1 << 20) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = parquet_schema(path).names
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    need = list(CRITEO_COLUMNS)
    missing = [c for c in need if c not in names]
    if missing:
        raise ValueError(
            f"{path}: no column {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; Criteo Parquet has {', '.join(need[:3])} ... C{NUM_CAT}"
        )
    line = 1
    for rb in pf.iter_batches(batch_size=rows_per_piece):
        n = rb.num_rows
        chunk = ParsedChunk(n)
        status = np.zeros(n, np.int8)
        try:
            label = rb.column("label").to_numpy(zero_copy_only=False).astype(np.float64)
        except (TypeError, ValueError, pa.ArrowException):
            raise ValueError(
                f"{path}: column 'label' is {rb.column('label').type}, not 0/1"
            ) from None
        # 0 or 1 exactly: 0.5 (a probability, a soft label) was truncated to 0 and kept
        status[~np.isin(label, (0.0, 1.0))] = BAD_LABEL
        label = np.where(status == BAD_LABEL, 0, label).astype(np.int64)
        dense, bad_dense = parquet_dense(rb, path)
        status[(status == 0) & bad_dense] = BAD_DENSE
        cats = np.zeros((n, NUM_CAT), np.uint32)
        miss_bits = np.zeros(n, np.uint32)
        for k in range(NUM_CAT):
            col = rb.column(f"C{k + 1}")
            if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
                col = float_nulls(col)  # ids as they are: 0..2^32-1, whole
                miss = np.asarray(col.is_null().to_numpy(zero_copy_only=False))
                vals, bad = id_values(col.fill_null(0).to_numpy(zero_copy_only=False))
                status = np.where(status == 0, bad, status)
            else:
                vals, miss, bad = _hex_column(_category_column(col, path, f"C{k + 1}"))
                status[(status == 0) & bad] = BAD_HEX
            cats[:, k] = vals
            miss_bits |= miss.astype(np.uint32) << np.uint32(k)
        good = status == 0
        rows = int(good.sum())
        chunk.dense[:rows], chunk.cats[:rows] = dense[good], cats[good]
        chunk.missing[:rows], chunk.labels[:rows] = miss_bits[good], label[good].astype(np.uint8)
        chunk.status[:n] = status
        chunk.lines, chunk.rows = n, rows
        yield Piece([chunk], rb.nbytes, False, line)
        line += n
