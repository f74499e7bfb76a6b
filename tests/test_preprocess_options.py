"""``recscale data preprocess`` options that would change nothing, or could not run,
refused in one line before any input is read."""

from __future__ import annotations

import pytest
from helpers import error_line

from recscale.cli.main import main
from recscale.dataprep.common import CHUNKS_HELD


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--mode", "vocab", "--hash-size", "10"], "--hash-size applies to --mode hash"),
        (["--min-count", "3"], "--min-count applies to --mode vocab"),  # hash: the default
        # a read allocates its chunk whole: a terabyte was a MemoryError traceback
        (["--chunk-mb", "100000000"], f"holds about {CHUNKS_HELD} chunks at once"),
    ],
    ids=["hash_size_in_vocab_mode", "min_count_in_hash_mode", "chunk_beyond_memory"],
)
def test_an_option_that_cannot_act_is_refused_before_reading(tmp_path, capsys, options, says):
    src = tmp_path / "in.tsv"
    src.write_text("0\t1" + "\t" * 38 + "\n")
    argv = ["data", "preprocess", "--input", str(src), "--out", str(tmp_path / "ds")]
    assert main([*argv, "--split", "none", *options]) == 1
    line = error_line(capsys.readouterr().err)
    assert says in line, line
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.tmp").exists()
