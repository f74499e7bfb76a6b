"""Training and evaluation batches from the configured source (synthetic or a dataset)."""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from recscale.config.errors import ConfigError, value_text
from recscale.config.schema import Config, DataConfig
from recscale.config.small_files import loads_toml
from recscale.data.batch import Batch
from recscale.data.columns import read_metadata
from recscale.data.dataset import (
    BatchLoader,
    BinaryDataset,
    DatasetError,
    LoaderPosition,
    SplitMissing,
)
from recscale.data.id_profile import read_id_profile
from recscale.data.synthetic import CALIBRATION_ROWS, DENSE_DRAW_BYTES, SyntheticCriteo
from recscale.planner.from_config import table_infos
from recscale.planner.job_plan import available_memory
from recscale.units import size_text


def make_synthetic(cfg: Config) -> SyntheticCriteo:
    """The config's synthetic source. The training stream, the held-out set and the
    ssd tier's row order of one run share one (it holds no state once made, and making
    it materialises every id's hidden effects: 5.5 s and 520 MB for config B's 26M rows,
    made twice a run before)."""
    d = cfg.data
    return _synthetic(
        tuple(cfg.model.table_sizes),
        cfg.model.num_dense_features,
        d.seed,
        d.zipf_alpha,
        d.min_ids_per_feature,
        d.max_ids_per_feature,
        d.signal_scale,
        d.target_ctr,
        tuple(d.bag_sizes) if d.bag_sizes else None,
    )


# the last config's source (a process runs one model at a time), keyed by
# SyntheticCriteo's arguments in its own order, made hashable
_synthetic = functools.lru_cache(maxsize=1)(SyntheticCriteo)


# What only a dataset reads: synthetic data is one stream of batches and one held-out set
DATASET_KEYS = ("train_split", "eval_split", "val_split", "shuffle", "block_rows")


# What only synthetic data reads: a dataset brings its own ids, bags, clicks and splits
SYNTHETIC_KEYS = (
    "eval_samples",
    "zipf_alpha",
    "min_ids_per_feature",
    "max_ids_per_feature",
    "bag_sizes",
    "signal_scale",
    "target_ctr",
)


def refuse_keys_a_dataset_overrules(cfg: Config, given: Iterable[str]) -> None:
    """The synthetic generator's keys, and the tables' sizes, named on the command line
    (``given``: the dotted keys of its overrides) for a run on a dataset changed
    nothing, without a word. Only the command line's: a preset or a run's config.toml
    carries them at values of its own (the debug preset's eval_samples and table
    sizes) through any data."""
    if not cfg.data.uses_dataset():
        return
    for key in given:
        section, _, name = key.partition(".")
        if section == "data" and name in SYNTHETIC_KEYS:
            raise ConfigError(
                key,
                f"shapes the synthetic data; the run reads the dataset {cfg.data.path}, "
                "which brings its own ids, bags and clicks",
            )
        if key == "model.table_sizes":
            raise ConfigError(
                key,
                f"the dataset {cfg.data.path} sets its tables' sizes (its metadata.json; "
                "`recscale data preprocess` chose them: --hash-size, or --min-count in vocab mode)",
            )


def _refuse_dataset_keys(data: DataConfig) -> None:
    """``--data.eval_split=val`` (or ``shuffle=false``...) on synthetic data changed
    nothing, without a word."""
    default = DataConfig()
    for key in DATASET_KEYS:
        value = getattr(data, key)
        if value != getattr(default, key):
            shown = value_text(value)
            raise ConfigError(
                f"data.{key}",
                f"{shown} applies to a dataset (data.path); synthetic data is one stream of "
                "batches and one held-out set",
            )


def adopt_dataset_shapes(cfg: Config, training: bool = True) -> str | None:
    """With a dataset, take its table sizes (and check its dense width and, for
    ``training``, that its train split holds a batch); returns a note. Without one, a
    dataset's own keys set away from their defaults are refused, for ``training``."""
    if not cfg.data.uses_dataset():
        if training:
            _refuse_dataset_keys(cfg.data)
        return None
    try:
        ds = BinaryDataset(cfg.data.path, cfg.data.train_split)
    except SplitMissing as e:
        raise ConfigError("data.train_split", str(e)) from e
    if training and ds.rows < cfg.train.batch_size:  # a partial batch is dropped: none left
        raise ConfigError(
            "train.batch_size",
            f"{cfg.train.batch_size} is more than the {ds.rows:,} rows of split "
            f"{cfg.data.train_split!r} of {cfg.data.path}: nothing would train",
        )
    if ds.num_dense != cfg.model.num_dense_features:
        raise ConfigError(
            "model.num_dense_features",
            f"is {cfg.model.num_dense_features} but {cfg.data.path} has {ds.num_dense} dense "
            "features",
        )
    # The split evaluated at the end is opened now: a bad data.eval_split fails in a
    # second, not after training.
    try:
        ev = BinaryDataset(cfg.data.path, cfg.data.eval_split)
    except (DatasetError, OSError) as e:
        raise ConfigError("data.eval_split", str(e)) from e
    if ev.rows == 0:
        raise ConfigError(
            "data.eval_split",
            f"split {cfg.data.eval_split!r} of {cfg.data.path} has no rows: nothing to score"
            f"{' at the end' if training else ''} (its splits: {_split_rows(ds.meta)})",
        )
    if ev.table_sizes != ds.table_sizes or ev.num_dense != ds.num_dense:
        raise ConfigError(
            "data.eval_split",
            f"split {cfg.data.eval_split!r} of {cfg.data.path} has other shapes than "
            f"{cfg.data.train_split!r}",
        )
    if training and cfg.train.eval_every and not _split_rows(ds.meta).get(cfg.data.val_split):
        raise ConfigError(
            "data.val_split",
            f"{cfg.data.path} has no rows in a split {cfg.data.val_split!r} to score during "
            f"training (its splits: {_split_rows(ds.meta)})",
        )
    note = None
    if cfg.model.table_sizes != ds.table_sizes:
        note = (
            f"table sizes from {cfg.data.path}/metadata.json "
            f"({len(ds.table_sizes)} tables, {sum(ds.table_sizes):,} rows)"
        )
        cfg.model.table_sizes = ds.table_sizes
    cfg.validate()
    return note


def train_batches(
    cfg: Config, start_step: int = 0, rank: int = 0, world_size: int = 1
) -> Iterator[Batch]:
    """An endless stream of this rank's slices of the training batches from global step
    ``start_step`` on (datasets loop over epochs). Both sources are deterministic in
    the step, which is all a resumed run needs to continue with exactly the batches it
    would have seen. Rank ``r`` of ``W`` gets samples ``[r B/W, (r+1) B/W)`` of each
    global batch (a dataset loader reads only those rows)."""
    t = cfg.train
    if cfg.data.uses_dataset():
        ds = BinaryDataset(cfg.data.path, cfg.data.train_split)
        loader = BatchLoader(
            ds,
            t.batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
            block_rows=cfg.data.block_rows,
            rank=rank,
            world_size=world_size,
        )
        epoch, batch = divmod(start_step, loader.batches_per_epoch)
        loader.position = LoaderPosition(epoch, batch)
        return iter(loader)
    stream = make_synthetic(cfg).batches(t.batch_size, "train", start=start_step)
    if world_size == 1:
        return stream
    n = t.batch_size // world_size
    return (b.slice(rank * n, (rank + 1) * n) for b in stream)


def resume_batch_note(cfg: Config, saved_config: object, step: int) -> str | None:
    """A line for a run resumed on a dataset at another ``train.batch_size`` than the
    checkpoint's (``saved_config``: the TOML its manifest keeps): the loader's position
    is the step times the batch, so the samples between the two positions are read
    twice or never. Synthetic batches are drawn by step and size: any size goes on."""
    if not cfg.data.uses_dataset() or not isinstance(saved_config, str):
        return None
    try:
        saved = loads_toml(saved_config)["train"]["batch_size"]
    except (tomllib.TOMLDecodeError, KeyError, TypeError):
        return None
    new = cfg.train.batch_size
    if type(saved) is not int or saved == new:
        return None
    at, read = step * new, step * saved
    gap = f"{read - at:,} samples read again" if new < saved else f"{at - read:,} samples skipped"
    return (
        f"train.batch_size={new}, where the checkpoint trained at {saved}: a dataset's "
        f"position is the step times the batch, so from step {step:,} the run reads from "
        f"sample {at:,} of its stream where the checkpoint had read {read:,} ({gap}; "
        f"--train.batch_size={saved} goes on where it stopped)"
    )


def eval_batches(cfg: Config, split: str | None = None) -> Iterable[Batch]:
    """Every held-out sample once: the dataset's eval split, or ``data.eval_samples``
    synthetic ones."""
    b = cfg.train.eval_batch_size
    if cfg.data.uses_dataset():
        ds = BinaryDataset(cfg.data.path, split or cfg.data.eval_split)
        if ds.rows == 0:  # a tiny input's kaggle split: metrics of nothing are undefined
            raise DatasetError(
                f"split {ds.split!r} of {cfg.data.path} has no rows: nothing to score "
                f"(its splits: {_split_rows(ds.meta)})"
            )
        return BatchLoader(
            ds, b, shuffle=False, drop_last=False, epochs=1, block_rows=cfg.data.block_rows
        )
    check_eval_set_memory(cfg)
    data = make_synthetic(cfg)
    n = cfg.data.eval_samples
    blocks = [
        data.batch(i, min(EVAL_DRAW, n - i * EVAL_DRAW), "eval") for i in range(-(-n // EVAL_DRAW))
    ]
    return blocks if b == EVAL_DRAW else _rebatched(blocks, b)


# The synthetic held-out set is drawn in blocks of this many samples, whatever the
# eval batch: a batch's draw standardises its dense features over the batch, so drawn
# in eval batches the set - and its AUC - changed with train.eval_batch_size (0.7025 at
# 16,384, 0.7017 at 7 for the same model). 16,384 = the default eval batch.
EVAL_DRAW = 16384


def _rebatched(blocks: list[Batch], b: int) -> Iterator[Batch]:
    """The samples of ``blocks``, in order, in batches of ``b`` (the last one shorter);
    a batch across two blocks joins its pieces. Only one batch is made at a time."""
    starts = np.cumsum([0, *(blk.batch_size for blk in blocks)])
    for lo in range(0, int(starts[-1]), b):
        hi = min(lo + b, int(starts[-1]))
        pieces = [
            blk
            if (s, s + blk.batch_size) == (lo, hi)
            else blk.slice(max(lo, s) - s, min(hi, s + blk.batch_size) - s)
            for s, blk in zip(starts[:-1].tolist(), blocks)
            if s < hi and lo < s + blk.batch_size
        ]
        yield pieces[0] if len(pieces) == 1 else Batch.cat(pieces)


def synthetic_eval_set_bytes(cfg: Config) -> int:
    """Host bytes of the kept synthetic held-out set: dense float32, ids int64, one
    int64 offset a bag, the label, for each of ``data.eval_samples``."""
    ids = sum(t.pooling for t in table_infos(cfg))
    f = len(cfg.model.table_sizes)
    per_sample = cfg.model.num_dense_features * 4 + ids * 8 + f * 8 + 4
    return cfg.data.eval_samples * per_sample


def check_synthetic_memory(cfg: Config) -> None:
    """Before anything is built: the synthetic generator's first draw (``CALIBRATION_ROWS``
    samples at once, to set its click rate) must fit the host memory - 10^5 dense
    features asked for 26 GB there, and the kernel killed the run - and so must the
    held-out set (:func:`check_eval_set_memory`)."""
    have = available_memory(torch.device("cpu"))
    draw = CALIBRATION_ROWS * cfg.model.num_dense_features * DENSE_DRAW_BYTES
    if draw > 0.8 * have:
        raise ConfigError(
            "model.num_dense_features",
            f"synthetic data draws {CALIBRATION_ROWS:,} samples of "
            f"{cfg.model.num_dense_features:,} dense features at once to set its click rate: "
            f"{size_text(draw)}, but {size_text(have)} of host memory are available",
        )
    check_eval_set_memory(cfg)


def check_eval_set_memory(cfg: Config) -> None:
    """The synthetic held-out set is drawn once and kept (every evaluation scores the same
    samples): refuse, naming ``data.eval_samples``, a set the host memory cannot hold -
    10^10 samples would draw for hours, then fail on an allocation."""
    need = synthetic_eval_set_bytes(cfg)
    have = available_memory(torch.device("cpu"))
    if need > 0.5 * have:
        raise ConfigError(
            "data.eval_samples",
            f"{cfg.data.eval_samples:,} synthetic held-out samples are drawn once and kept: "
            f"{size_text(need)}, but {size_text(have)} of host memory are available "
            "(the run needs the rest): use fewer",
        )


def popularity_ranks(cfg: Config) -> Callable[[int], np.ndarray] | None:
    """``rank_of_id(feature)``: each id's popularity rank in its table (0 = the most
    used), the order an ssd tier's file lays rows out in (``embedding.row_order``); None
    for id order. Synthetic data knows its own popularity law; a dataset its id profile
    (each id's count over the train split, written by preprocessing: data/id_profile.py),
    or, where it has none, its first ``embedding.order_sample_rows`` training samples,
    counted once on first use. Either way ids by count, then by id."""
    e = cfg.embedding
    if e.row_order == "id":
        return None
    # Nothing is built or counted until an ssd file asks (a synthetic source for a large
    # model takes seconds to make).
    source: list[SyntheticCriteo] = []
    counted: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def rank_of_id(feature: int) -> np.ndarray:
        if not cfg.data.uses_dataset():
            source[:] = source or [make_synthetic(cfg)]
            return source[0].rank_of_id(feature)
        if not counted:
            profile = read_id_profile(cfg.data.path, read_metadata(cfg.data.path))
            if profile is None:
                tables = list(range(len(cfg.model.table_sizes)))
                profile = sample_id_counts(cfg, e.order_sample_rows, tables).values()
            counted.update(enumerate(profile))
        ids, counts = (np.asarray(a, dtype=np.int64) for a in counted[feature])
        n = cfg.model.table_sizes[feature]
        seen = ids[np.lexsort((ids, -counts))]
        unseen = np.setdiff1d(np.arange(n, dtype=np.int64), seen, assume_unique=True)
        rank = np.empty(n, dtype=np.int64)
        rank[np.concatenate([seen, unseen])] = np.arange(n, dtype=np.int64)
        return rank

    return rank_of_id


def sample_id_counts(cfg: Config, samples: int, features: list[int]) -> dict[int, tuple]:
    """``feature -> (ids, counts)`` over the first ``samples`` training samples (the
    very batches step 0, 1, ... train on: every rank reads the same ones)."""
    seen: dict[int, list[np.ndarray]] = {f: [] for f in features}
    stream = train_batches(cfg, 0)
    for _ in range(max(1, -(-samples // cfg.train.batch_size))):
        batch = next(stream, None)
        if batch is None:  # a dataset smaller than the sample
            break
        for f in features:
            seen[f].append(batch.feature_values(f).numpy().astype(np.int64))
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    return {
        f: np.unique(np.concatenate(v), return_counts=True) if v else empty for f, v in seen.items()
    }


def _split_rows(meta: dict) -> dict[str, int]:
    """A dataset's splits and their rows, as its metadata says (checked when opened)."""
    return {name: int(s["rows"]) for name, s in meta["splits"].items()}
