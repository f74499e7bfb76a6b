"""Parse Criteo TSV bytes into columns with one numba pass (no per-line Python).

A line is ``label \\t I1..I13 \\t C1..C26 \\n``: 40 tab-separated fields, any of the
feature fields may be empty (missing). Per good line the kernel writes::

    dense   [13] float32   log(1 + max(x, 0)); missing -> 0; x any decimal integer
    cats    [26] uint32    the hex value of C_k (1..8 hex digits); missing -> 0
    missing      uint32    bit k set when C_k is empty
    label        uint8     0 or 1

Every line gets a status; a bad line writes nothing and is reported by kind::

    1 wrong field count   2 bad label   3 non-integer dense value   4 non-hex category

A line without 40 fields is kind 1 whatever else is wrong with it (a file separated
by spaces or commas, a blank line). Parquet rows with integer ids add two kinds the
text never has (``data/sources.py``, ``dataprep/multihot_parquet.py``)::

    5 id outside 0..2^32-1   6 null id in a bag   7 id not a whole number (a float id)

and the text's reader one (``data/sources.py``): ``8 line over 1 MB``, read through to
its end without being held or parsed.
"""

from __future__ import annotations

import numpy as np

from recscale.kernels import numba as nb

NUM_DENSE, NUM_CAT = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CAT
BAD_KINDS = {
    1: "wrong field count",
    2: "bad label",
    3: "non-integer dense value",
    4: "non-hex category",
    5: "id outside 0..2^32-1",
    6: "null id in a bag",
    7: "id not a whole number",
    8: "line over 1 MB",
}
BAD_LABEL, BAD_DENSE, BAD_HEX, BAD_ID_RANGE, BAD_NULL_ID, BAD_ID_FRACTION = 2, 3, 4, 5, 6, 7
BAD_LONG_LINE = 8  # read through to its end by the text's reader, not parsed
TRUNCATED_GZIP = "truncated gzip"


@nb.njit(nogil=True, cache=True)
def _hex_digit(c):
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


@nb.njit(nogil=True, cache=True)
def parse_lines(buf, dense, cats, missing, labels, status):
    """Parse complete lines in ``buf`` (uint8). Returns (lines, good rows).

    Output arrays need one slot per line; good rows are packed at the front.
    A final line without a newline is parsed too (the caller only passes one at EOF).
    """
    n = buf.shape[0]
    i = 0
    line = 0
    row = 0
    while i < n:
        field = 0
        bad = 0
        val = 0
        big = -1.0  # a dense value past 18 digits, carried as a float (see below)
        ndig = 0
        neg = False
        miss = np.uint32(0)
        label = 0
        while True:
            c = buf[i] if i < n else 10
            i += 1
            if c == 13 and (i >= n or buf[i] == 10):  # CR of a CRLF line end
                continue
            if c == 9 or c == 10:
                if bad == 0 and field < NUM_FIELDS:
                    if field == 0:
                        if ndig == 0 or val > 1 or neg:
                            bad = 2
                        label = val
                    elif field <= NUM_DENSE:
                        if ndig == 0:
                            if neg:
                                bad = 3
                            else:
                                dense[row, field - 1] = 0.0
                        elif neg:
                            dense[row, field - 1] = 0.0
                        else:
                            x = big if big >= 0.0 else val
                            dense[row, field - 1] = np.log1p(x)
                    else:
                        k = field - 1 - NUM_DENSE
                        if ndig == 0:
                            miss |= np.uint32(1) << np.uint32(k)
                            cats[row, k] = 0
                        else:
                            cats[row, k] = val
                field += 1
                val = 0
                big = -1.0
                ndig = 0
                neg = False
                if c == 10:
                    break
                continue
            if bad != 0 or field >= NUM_FIELDS:
                continue
            if field <= NUM_DENSE:  # label or integer field
                if 48 <= c <= 57:
                    ndig += 1
                    if ndig <= 18:
                        val = val * 10 + (c - 48)
                    elif field == 0:
                        bad = 2  # a label past 18 digits is not 0 or 1
                    elif big < 0.0:
                        # an integer past int64 is still an integer (Parquet's columns
                        # take any int64): go on in float64, which log1p needs anyway
                        big = val * 10.0 + (c - 48)
                    elif big < 1e300:  # saturated beyond: log1p stays finite (690.8)
                        big = big * 10.0 + (c - 48)
                elif c == 45 and ndig == 0 and not neg and field > 0:  # leading minus
                    neg = True
                else:
                    bad = 2 if field == 0 else 3
            else:
                d = _hex_digit(c)
                ndig += 1
                if d < 0 or ndig > 8:
                    bad = 4
                else:
                    val = val * 16 + d
        if field != NUM_FIELDS:
            # the line's shape first: a space- or comma-separated line (one field) or a
            # blank one reads as a bad label too, and "wrong field count" says what is off
            bad = 1
        status[line] = bad
        if bad == 0:
            missing[row] = miss
            labels[row] = label
            row += 1
        line += 1
    return line, row


class ParsedChunk:
    """Column buffers for up to ``capacity`` lines."""

    def __init__(self, capacity: int) -> None:
        self.dense = np.empty((capacity, NUM_DENSE), np.float32)
        self.cats = np.empty((capacity, NUM_CAT), np.uint32)
        self.missing = np.empty(capacity, np.uint32)
        self.labels = np.empty(capacity, np.uint8)
        self.status = np.empty(capacity, np.int8)
        self.lines = 0
        self.rows = 0

    def parse(self, buf: np.ndarray) -> ParsedChunk:
        self.lines, self.rows = parse_lines(
            buf, self.dense, self.cats, self.missing, self.labels, self.status
        )
        return self
