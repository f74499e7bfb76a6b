"""What the one-hot and multi-hot preprocessors share: their options, the bad-line
report (counts by kind with ``file:line`` examples), the split of rows into train /
val / test, and the output directory's rules (refuse to destroy anything; build under
``OUT.tmp``; swap into place with no moment where a half dataset reads as whole)."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recscale import locks
from recscale.config.small_files import kind_of, not_a_file
from recscale.data.columns import ID_LIMIT, READ_FORMAT_VERSION, read_metadata
from recscale.data.criteo_parse import BAD_KINDS, NUM_CAT
from recscale.data.id_profile import PROFILE_FILE
from recscale.procfs import mem_available
from recscale.units import size_text

FORMAT_VERSION = READ_FORMAT_VERSION  # what data/columns.py reads is what is written
SPLITS = ("train", "val", "test")
HASH_CAP = 40_000_000  # MLPerf's rows per table
BLOCK_ROWS = 1 << 18


# Files a TSV input is not: each was read as text, every line bad ("290 bad lines of 290").
_NOT_TEXT = (
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first (xz -d)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first (zstd -d)"),
    (b"BZh", "bzip2-compressed", "decompress it first (bunzip2)"),
    (b"PK\x03\x04", "a zip archive", "unzip it first"),
    (b"PAR1", "Parquet", "read it with --format parquet"),
)


def _check_text_input(path: Path) -> None:
    """A TSV input (plain or gzip) that is another format is named with the fix."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    for magic, what, fix in _NOT_TEXT:
        if head.startswith(magic):
            raise ValueError(f"input {path} is {what}; recscale reads plain or gzip text: {fix}")
    gzip = head.startswith(b"\x1f\x8b")  # compressed bytes say nothing of its lines
    if not gzip and b"\r" in head and b"\n" not in head:  # one line: every row lost
        raise ValueError(
            f"input {path}: its lines end in CR alone (classic Mac text); recscale reads "
            f"lines ending in LF or CRLF: convert it, e.g. tr '\\r' '\\n' < {path} > OUT"
        )


class BadDataError(ValueError):
    """Too many malformed lines; the message has the counts and examples."""


# Parse chunks held at once, at most: two read ahead, one being read, its lines joined
# (a copy), one being parsed, its columns.
CHUNKS_HELD = 6


@dataclass
class PreprocessOptions:
    inputs: list[Path]
    out: Path
    input_format: str = "criteo"  # criteo (TSV, plain or .gz) | parquet
    id_mode: str = "hash"  # hash | vocab
    # hash mode: one size, one per feature, or [] = auto: 4 x the feature's distinct values
    # in the train split, at most 40M (MLPerf's cap) - tables that fit the data
    hash_sizes: list[int] = field(default_factory=list)
    min_count: int = 1
    split: str = "kaggle"  # kaggle | by-file | none
    test_files: list[Path] = field(default_factory=list)
    val_files: list[Path] = field(default_factory=list)
    max_bad_fraction: float = 0.001
    chunk_bytes: int = 32 << 20
    threads: int = 0
    parquet_out: bool = False
    examples_per_kind: int = 5

    def all_inputs(self) -> list[Path]:
        """Every input once, in order: the train inputs, then validation, then test files."""
        return list(dict.fromkeys([*self.inputs, *self.val_files, *self.test_files]))

    def validate(self) -> None:
        if not self.inputs:
            raise ValueError("no input files")
        first: dict[Path, str] = {}
        for p in self.inputs:  # named twice, its rows were read once, without a word
            key = Path(p).resolve()
            if key in first:
                also = f" (first as {first[key]})" if first[key] != str(p) else ""
                raise ValueError(f"--input names the file {p} twice{also}; name each input once")
            first[key] = str(p)
        for p in [*self.inputs, *self.test_files, *self.val_files]:
            try:
                kind = not_a_file(os.stat(p).st_mode)
            except FileNotFoundError:
                raise ValueError(f"input file not found: {p}") from None
            except OSError as e:
                raise ValueError(f"cannot read input {p}: {e.strerror or e}") from None
            if kind == "a directory":
                raise ValueError(f"input {p} is a directory; name the files in it")
            if kind is not None:  # a pipe or a device: no size, and it cannot be read twice
                raise ValueError(
                    f"input {p} is {kind}; preprocessing reads each input more than once "
                    "and needs its size: name a regular file (plain or .gz)"
                )
        if self.id_mode not in ("hash", "vocab"):
            raise ValueError(f"--mode must be hash or vocab, got {self.id_mode!r}")
        if self.split not in ("kaggle", "by-file", "none"):
            raise ValueError(f"--split must be kaggle, by-file or none, got {self.split!r}")
        if self.hash_sizes and (
            len(self.hash_sizes) not in (1, NUM_CAT)
            or min(self.hash_sizes) <= 0
            or max(self.hash_sizes) > ID_LIMIT
        ):
            # ids are stored as int32: a larger size wrapped them negative, and no
            # training could open the dataset it wrote
            raise ValueError(
                f"--hash-size takes 1 or {NUM_CAT} sizes in 1..{ID_LIMIT:,} (ids are 32-bit), "
                f"got {self.hash_sizes}"
            )
        if self.min_count < 1:
            raise ValueError("--min-count must be >= 1")
        # each mode's own knob, given to the other, changed nothing without a word
        if self.id_mode == "vocab" and self.hash_sizes:
            raise ValueError(
                "--hash-size applies to --mode hash; vocab mode gives each table a row per "
                "value it keeps (--min-count sets which)"
            )
        if self.id_mode == "hash" and self.min_count != 1:
            raise ValueError(
                "--min-count applies to --mode vocab; hash mode keeps every value "
                "(--hash-size sets the tables' rows)"
            )
        if not 0.0 <= self.max_bad_fraction <= 1.0:  # NaN fails too
            raise ValueError(
                "--max-bad-fraction is a share of the lines, in [0, 1]; got "
                f"{self.max_bad_fraction}"
            )
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: all cores), got {self.threads}")
        if self.chunk_bytes < 1:  # a read of 0 bytes ends the file: nothing would be parsed
            raise ValueError(
                f"the parse chunk must be > 0 bytes (--chunk-mb >= 1), got {self.chunk_bytes}"
            )
        # a read allocates its whole chunk up front (a 1 TB one: a MemoryError traceback),
        # and the pipeline holds several: read ahead, joined at whole lines, parsed
        held, available = CHUNKS_HELD * self.chunk_bytes, mem_available()
        if held > available:
            raise ValueError(
                f"--chunk-mb {self.chunk_bytes >> 20:,}: preprocessing holds about "
                f"{CHUNKS_HELD} chunks at once ({size_text(held)}), more than the "
                f"{size_text(available)} available; choose at most "
                f"{available // CHUNKS_HELD >> 20:,}"
            )
        if self.input_format not in ("criteo", "parquet"):
            raise ValueError(f"--format must be criteo or parquet, got {self.input_format!r}")
        if self.input_format == "criteo":
            for p in self.all_inputs():
                _check_text_input(p)
        if (self.test_files or self.val_files) and self.split != "by-file":
            raise ValueError(
                f"--test/--val name the files of each split, which only --split by-file uses "
                f"(this is --split {self.split}): add --split by-file"
            )
        if self.split == "by-file":
            test = {Path(p).resolve() for p in (self.test_files or [self.inputs[-1]])}
            for p in self.val_files:  # it went to the test split and no val split was written
                if Path(p).resolve() in test:
                    raise ValueError(
                        f"{p} is both a validation (--val) and a test file: a file's rows go "
                        "to one split"
                    )
            held_out = test | {Path(p).resolve() for p in self.val_files}
            if all(Path(p).resolve() in held_out for p in self.inputs):
                raise ValueError(
                    "--split by-file leaves no input for training (the test split defaults to "
                    "the last input): give more inputs, or name the test files with --test"
                )
        check_output_dir(Path(self.out), [*self.inputs, *self.test_files, *self.val_files])


def _dataset_strangers(path: Path) -> list[str] | None:
    """None when ``path`` is not a recscale dataset (no ``metadata.json`` that reads as
    one), else the entries in it that a dataset does not have (a directory holding a
    file called metadata.json beside other things is not ours to replace)."""
    try:
        meta = read_metadata(path)
        splits = set(meta["splits"])
        meta["table_sizes"]
    except (OSError, ValueError, KeyError, TypeError):  # DatasetError is a ValueError
        return None
    ours = {"metadata.json", "bad_lines.txt", PROFILE_FILE, *splits}
    ours |= {f"{s}.parquet" for s in splits}
    return sorted(c.name for c in path.iterdir() if c.name not in ours)


def check_output_dir(out: Path, inputs: list[Path]) -> None:
    """Refuse an output that would destroy something: a non-empty directory that is not
    a dataset, one that holds an input, or the working directory or one of its parents."""
    o = out.resolve()
    cwd = Path.cwd().resolve()
    if o == cwd or o in cwd.parents:
        raise ValueError(
            f"--out {out} is the working directory or one of its parents; "
            "name a new directory for the dataset"
        )
    for p in inputs:
        i = Path(p).resolve()
        if o == i or o in i.parents or i in o.parents:
            raise ValueError(
                f"--out {out} is, holds or lies inside the input {p}; write the dataset elsewhere"
            )
    if o.exists() and not o.is_dir():
        raise ValueError(f"--out {out} is {kind_of(o)}; name a directory for the dataset")
    if o.is_dir() and any(o.iterdir()):
        strangers = _dataset_strangers(o)
        if strangers is None:
            raise ValueError(
                f"--out {out} is a non-empty directory that is not a recscale dataset "
                "(no metadata.json of one); it is left alone: name a new or empty directory"
            )
        if strangers:
            raise ValueError(
                f"--out {out} is a dataset but also holds {strangers[0]!r}"
                f"{f' and {len(strangers) - 1} more' if len(strangers) > 1 else ''}, which "
                "replacing it would delete; move them, or name another directory"
            )
    tmp = o.with_name(o.name + ".tmp")
    leftovers = {"raw", "metadata.json", *SPLITS, "bad_lines.txt", PROFILE_FILE}
    if tmp.exists() and not {c.name for c in tmp.iterdir()} <= leftovers:
        raise ValueError(f"{tmp} exists and is not a leftover of an earlier preprocess; move it")


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """The one writer of the dataset ``out`` (a second one gets ``LockedError`` naming
    this pid); ``OUT.tmp`` is removed on any error, a full disk included."""
    lock = out.parent / f".{out.name}.lock"
    locks.hold(lock, f"the dataset {out}")
    try:
        yield
    except BaseException as e:
        shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
        if (
            isinstance(e, OSError)
            and e.errno == errno.ENOSPC
            and e.strerror == os.strerror(errno.ENOSPC)  # a write's own, not a check's
        ):  # it named nothing: say where, and what is left there now
            # its total, not what is free now: files still open hold their blocks
            total = shutil.disk_usage(out.parent).total
            raise OSError(
                errno.ENOSPC,
                f"the disk under {out.parent} ({size_text(total)} in all) filled while "
                f"{out} was written; nothing was written, its partial output is removed "
                "(free space, or write elsewhere)",
            ) from e
        raise
    finally:
        locks.release(lock)


def check_free_space(out: Path, nbytes: int, what: str, echo: Callable[[str], None]) -> None:
    """Say how much is about to be written; refuse (before writing) what the disk under
    ``out`` cannot hold."""
    base = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(base).free
    echo(f"{what}: writing {size_text(nbytes)} under {out.parent} ({size_text(free)} free)")
    if nbytes > free:
        raise OSError(
            errno.ENOSPC,
            f"{what} needs {size_text(nbytes)} but {base} has {size_text(free)} free; "
            "nothing was written (free space, or write elsewhere)",
        )


def fresh_tmp_dir(out: Path) -> Path:
    """``OUT.tmp``, emptied: everything is built there and renamed into place at the end."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_into_place(tmp: Path, out: Path) -> None:
    """Replace an old dataset without a moment where a half one could be read as whole:
    move the old one aside, rename the new one in, then delete the old one."""
    aside = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        if aside.exists() and not out.exists():
            os.replace(aside, out)  # the old dataset back where it was
        raise
    shutil.rmtree(aside, ignore_errors=True)


@dataclass
class BadLineReport:
    lines: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    def add_statuses(self, status: np.ndarray, path: Path, first_line: int, limit: int) -> None:
        """Count one chunk's line statuses (0 = good) and keep the first examples per kind."""
        self.lines += status.shape[0]
        bad_idx = np.nonzero(status)[0]
        if bad_idx.size == 0:
            return
        kinds, counts = np.unique(status[bad_idx], return_counts=True)
        for code, n in zip(kinds.tolist(), counts.tolist()):
            kind = BAD_KINDS[code]
            self.counts[kind] = self.counts.get(kind, 0) + n
            ex = self.examples.setdefault(kind, [])
            if len(ex) < limit:
                where = bad_idx[status[bad_idx] == code][: limit - len(ex)]
                ex.extend(f"{path}:{first_line + int(i)}" for i in where)

    def add(self, kind: str, where: str, limit: int) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        ex = self.examples.setdefault(kind, [])
        if len(ex) < limit:
            ex.append(where)

    def describe(self) -> str:
        if not self.counts:
            return f"0 bad lines of {self.lines:,}"
        parts = [f"{self.bad:,} bad lines of {self.lines:,} ({self.bad / max(self.lines, 1):.4%}):"]
        for kind, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            parts.append(f"  {kind}: {n:,} (e.g. {', '.join(self.examples[kind])})")
        return "\n".join(parts)


def check_bad_lines(
    report: BadLineReport,
    rows: int,
    opts: PreprocessOptions,
    tmp: Path,
    echo: Callable[[str], None],
) -> None:
    """Print the bad-line report; stop (removing ``tmp``, nothing written) when bad lines
    exceed ``--max-bad-fraction`` or no row is valid."""
    echo(report.describe())
    if report.lines and report.bad / report.lines > opts.max_bad_fraction:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BadDataError(
            f"{report.describe()}\nthat is more than --max-bad-fraction={opts.max_bad_fraction:g}; "
            "nothing was written (fix the inputs or raise the limit)"
        )
    if rows == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BadDataError("no valid rows in the inputs")


def split_ranges(
    opts: PreprocessOptions, file_rows: list[tuple[Path, int, int]], total: int
) -> dict[str, list[tuple[int, int]]]:
    """Row ranges of each split in the raw columns; a train split without rows (its files
    hold no valid line, or too few lines for the Kaggle split's sixth sevenths) is a
    ``BadDataError`` - such a dataset was written, and no run could train on it."""
    ranges = _split_ranges(opts, file_rows, total)
    if not sum(hi - lo for lo, hi in ranges.get("train", [])):
        raise BadDataError(
            f"the train split would hold no rows ({total:,} valid rows in all, --split "
            f"{opts.split}): "
            + (
                "its input files hold no valid line"
                if opts.split == "by-file"
                else "too few rows to split (the Kaggle split trains on 6/7 of them)"
            )
            + "; nothing was written"
        )
    return ranges


def _split_ranges(
    opts: PreprocessOptions, file_rows: list[tuple[Path, int, int]], total: int
) -> dict[str, list[tuple[int, int]]]:
    if opts.split == "none":
        return {"train": [(0, total)]}
    if opts.split == "kaggle":
        # Reference DLRM: 7 "days" of equal size; days 0-5 train, day 6 halved into val and test.
        train_end = total * 6 // 7
        val_end = train_end + (total - train_end) // 2
        return {
            "train": [(0, train_end)],
            "val": [(train_end, val_end)],
            "test": [(val_end, total)],
        }
    test = {Path(p).resolve() for p in (opts.test_files or [opts.inputs[-1]])}
    val = {Path(p).resolve() for p in opts.val_files}
    out: dict[str, list[tuple[int, int]]] = {"train": [], "val": [], "test": []}
    for path, lo, hi in file_rows:
        name = "test" if path.resolve() in test else "val" if path.resolve() in val else "train"
        out[name].append((lo, hi))
    return {k: v for k, v in out.items() if v}
