"""The configuration schema: one small dataclass per component, composed by :class:`Config`.

The dataclass defaults *are* the embedded default run (``recscale train`` with no
arguments); ``configs/default.toml`` spells the same values out and a test keeps the
two equal. Every ``validate`` raises :class:`ConfigError` naming the dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from recscale.config.compression_rules import check_compression
from recscale.config.errors import ConfigError, counted
from recscale.config.inert_keys import refuse_inert_keys

# Criteo-shaped but small enough to train in about a minute on 2 CPU cores: the
# per-feature cardinalities keep Criteo's spread (3 .. ~10^5 rows).
# fmt: off
DEFAULT_TABLE_SIZES = [
    1460, 583, 100_000, 80_000, 305, 24, 12_517, 633, 3, 50_000, 5_683, 100_000, 3_194,
    27, 14_992, 90_000, 10, 5_652, 2_173, 4, 100_000, 18, 15, 60_000, 105, 40_000,
]
# fmt: on

POOLINGS = ("sum", "mean")
INTERACTIONS = ("dot", "cat", "dcnv2")
SPARSE_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
DEVICES = ("auto", "cpu", "cuda")
DATA_SOURCES = ("auto", "synthetic", "binary")
# Every list of allowed values lives here, once; the modules that act on them import it.
# Kernels, in fallback order after "auto": native C (CPU), Triton (GPU), numba (CPU), torch ops.
KERNELS = ("auto", "native", "triton", "numba", "torch")
PLACEMENTS = ("device", "host", "ssd")  # where a table's rows live (a storage tier)
ROW_ORDERS = ("frequency", "id")
CACHE_POLICIES = ("lfu", "lru")
MAX_THREADS = 1024  # train.threads
ROW_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "split_bf16")  # stored embedding rows in training
COMPRESSIONS = ("none", "qr", "mixed_dim", "tt")  # embedding/compressed.py
QR_OPS = ("mult", "add", "concat")
CHECKPOINT_PRECISIONS = ("fp32", "fp16", "int8")
SHARDING_KINDS = ("data_parallel", "table_wise", "row_wise", "column_wise")
PRECISIONS = ("fp32", "tf32", "bf16")
HOST_MEMORY = ("retain", "system")  # train/host_memory.py
SCHEDULE_DECAYS = ("polynomial", "linear")  # train.precision: the MLPs and interaction


FLOAT32_MAX = 3.4028234663852886e38


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class ModelConfig:
    """DLRM shape. ``bottom_mlp``/``top_mlp`` list output widths (inputs are implied)."""

    arch: str = "dlrm"
    num_dense_features: int = 13
    table_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_TABLE_SIZES))
    embedding_dim: int = 16
    # Optional per-table dims (one per table); empty means every table uses embedding_dim.
    table_dims: list[int] = field(default_factory=list)
    pooling: str = "sum"
    bottom_mlp: list[int] = field(default_factory=lambda: [128, 64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [128, 64, 1])
    interaction: str = "dot"
    # Include each feature's dot product with itself (the diagonal) in the dot interaction.
    interaction_self: bool = False
    # dcnv2: low-rank cross layers over [dense, embeddings] (MLPerf DLRMv2: 3 layers, rank 512).
    dcn_layers: int = 3
    dcn_rank: int = 512
    # Fused kernels (embedding backward, dot interaction): auto = the fastest available
    # (native C/AVX2 dot interaction, numba embedding backward on CPU; torch elsewhere);
    # torch = the straightforward reference path; numba = numba only; native = require
    # the native interaction kernels (recscale.native).
    kernels: str = "auto"

    def dims(self) -> list[int]:
        return (
            list(self.table_dims)
            if self.table_dims
            else [self.embedding_dim] * len(self.table_sizes)
        )

    def validate(self) -> None:
        _choice("model.arch", self.arch, ("dlrm",))
        _positive("model.num_dense_features", self.num_dense_features, allow_zero=True)
        if not self.table_sizes:
            raise ConfigError("model.table_sizes", "needs at least one table")
        for i, n in enumerate(self.table_sizes):
            if n <= 0:
                raise ConfigError("model.table_sizes", f"table {i} has {n} rows; sizes must be > 0")
        _positive("model.embedding_dim", self.embedding_dim)
        if self.table_dims:
            if len(self.table_dims) != len(self.table_sizes):
                raise ConfigError(
                    "model.table_dims",
                    f"has {counted(len(self.table_dims), 'entry', 'entries')} but "
                    f"model.table_sizes has {len(self.table_sizes)}",
                )
            for i, d in enumerate(self.table_dims):
                if d <= 0:
                    raise ConfigError(
                        "model.table_dims", f"table {i} has dim {d}; dims must be > 0"
                    )
        _choice("model.pooling", self.pooling, POOLINGS)
        _choice("model.interaction", self.interaction, INTERACTIONS)
        if self.interaction == "dcnv2":
            _positive("model.dcn_layers", self.dcn_layers)
            _positive("model.dcn_rank", self.dcn_rank)
        _choice("model.kernels", self.kernels, KERNELS)
        for key, mlp in (("model.bottom_mlp", self.bottom_mlp), ("model.top_mlp", self.top_mlp)):
            for w in mlp:
                if w <= 0:
                    raise ConfigError(key, f"layer widths must be > 0, got {mlp}")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ConfigError(
                "model.top_mlp", f"must end in a single logit (last width 1), got {self.top_mlp}"
            )
        if self.num_dense_features > 0 and not self.bottom_mlp:
            raise ConfigError(
                "model.bottom_mlp", "needs at least one layer when there are dense features"
            )
        if self.interaction == "dot":
            dims = set(self.dims())
            if len(dims) != 1:
                raise ConfigError(
                    "model.table_dims",
                    "the dot interaction needs every table at one embedding dim (mixed dims: "
                    f'interaction = "cat" or "dcnv2"), got dims {sorted(dims)}',
                )
            (d,) = dims
            if self.num_dense_features > 0 and self.bottom_mlp[-1] != d:
                raise ConfigError(
                    "model.bottom_mlp",
                    f"the dot interaction needs the bottom MLP to end at the embedding dim {d}, "
                    f"but it ends at {self.bottom_mlp[-1]}",
                )


@dataclass
class EmbeddingConfig:
    """Embedding storage and its fused sparse optimizer."""

    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9  # adam only
    beta2: float = 0.999  # adam only
    # Initial value of the row-wise Adagrad accumulator.
    initial_accumulator: float = 0.0
    # Check every id against its table size each step (cheap; catches bad data early).
    # Off, an id past all of a storage's rows still stops the run (named as the check
    # would; every kernel bounds its rows), but one past its own table reads the next
    # table's rows: only for data already checked.
    validate_ids: bool = True
    # Where the rows live: device (memory of the training device), ssd (a file under
    # ssd_dir behind a hot-row cache of cache_bytes; for tables larger than memory), host
    # (host memory behind a cache in device memory; for GPU runs), or auto (the planner
    # puts the largest tables on ssd when all do not fit memory_budget_gb).
    placement: str = "device"
    # Directory of the ssd tier's files ("" = RUN_DIR/embeddings, or a temp dir).
    ssd_dir: str = ""
    # Cache for ssd/host tables: bytes of rows + optimizer state (0 = ssd: from the
    # memory available at start, planner.from_config.default_ssd_cache; host: 10% of
    # the tables).
    cache_bytes: int = 0
    # Cache eviction: lfu (use counts, halved every 1000 lookups) or lru.
    cache_policy: str = "lfu"
    # ssd tier: reads and writes of rows in flight at once (a batch's misses and
    # write-backs, coalesced where adjacent); 1 = one at a time.
    io_depth: int = 32
    # How the ssd tier's file is read and written (docs/tiered_storage.md): pread
    # (batched requests at io_depth), direct (the same through O_DIRECT, no page cache),
    # map (its memory map: a copy a row), auto (map when the file takes at most half the
    # memory available at start, shared among the host's ranks, else pread).
    ssd_access: str = "auto"
    # Where a cached tier's next batch is made resident: thread (ahead, on the pipeline's
    # thread), inline (each lookup brings its misses), auto (inline where the tier is in
    # memory and the step's threads take every core; train/cache_prefetch.py).
    cache_prefetch: str = "auto"
    # A batch whose rows have not come from the tier after this many seconds stops the
    # run naming the file (a stalled or far too slow device; 0 = wait for ever).
    io_stall_seconds: float = 600.0
    # ssd tier's file layout: frequency (each table's rows hottest first, from the data's
    # id popularity: a page read brings rows of like heat, and the page cache holds the
    # warm rows densely) or id. Checkpoints store rows by id either way.
    row_order: str = "frequency"
    # Fill the ssd/host cache with the hottest rows before the first step (needs
    # row_order=frequency).
    warm_start: bool = True
    # The share of the cache whose warm rows stay resident for the whole run (FAE's hot
    # set: a row of rank 50,000 is used less than once in 300 steps, so LFU cannot tell
    # it from a cold row used once - the popularity order can); the rest of the cache is
    # LFU/LRU over whatever the batches bring. 0 = every warm row may be evicted.
    warm_pin_share: float = 0.8
    # A dataset without an id profile (id_counts.u32, written by preprocessing) has its
    # first this many training samples counted to order the rows (ids by count, then id).
    order_sample_rows: int = 1_000_000
    # Slipstream (ssd/host tiers, with warm_start's pinned hot rows): skip for one
    # interval the update - and the write-back - of each hot row whose weights moved by
    # less than slipstream_threshold (relative L2) over the last slipstream_interval
    # steps (embedding/slipstream.py). Changes the arithmetic: off by default.
    slipstream: bool = False
    slipstream_threshold: float = 0.01
    slipstream_interval: int = 100
    # placement=auto: memory for tables + optimizer state + caches, GB (0 = half the RAM).
    memory_budget_gb: float = 0.0
    # Stored precision of the rows in training: fp16 / bf16 (half the bytes) or int8
    # (a quarter, plus a row-wise scale and bias); stochastic rounding in the update,
    # optimizer state fp32 (embedding/low_precision.py). Tables in device memory.
    # split_bf16: fp32 values in two halves, the lookup reading the bf16 high ones.
    # auto: split_bf16 where train.precision=bf16 runs on the CPU with plain tables in
    # memory, fp32 rows wider than a cache line (dim > 16) and the native kernels; fp32
    # elsewhere (train/precision.py).
    row_precision: str = "auto"
    # Compressed tables (embedding/compressed.py): rows computed from smaller factors.
    # qr: quotient x remainder tables (qr_buckets remainder rows; combined by qr_op);
    # mixed_dim: table t gets dim * (n_min / n_t) ** md_alpha dims (a power of two) and a
    # projection to the common dim; tt: tensor-train cores of rank tt_rank. A table the
    # method would not shrink stays plain.
    compression: str = "none"
    # Per-table overrides, "NAME=METHOD" (e.g. ["C1=none", "C20=tt"]).
    table_compression: list[str] = field(default_factory=list)
    # Tables with fewer rows stay plain (the reference DLRM's qr/md threshold): a small
    # table saves little memory and its every id is frequent enough to matter.
    compress_min_rows: int = 10000
    qr_buckets: int = 4
    qr_op: str = "mult"
    md_alpha: float = 0.3
    tt_rank: int = 8
    # Share of each compressed table's rows kept exact (plain rows at row_precision):
    # the ids most frequent in the first hot_sample_rows training samples (TT-Rec's
    # cache of hot rows, FAE's hot embeddings). 0 = none.
    hot_fraction: float = 0.0
    hot_sample_rows: int = 131072

    def validate(self) -> None:
        _choice("embedding.optimizer", self.optimizer, SPARSE_OPTIMIZERS)
        _choice("embedding.placement", self.placement, (*PLACEMENTS, "auto"))
        _positive("embedding.memory_budget_gb", self.memory_budget_gb, allow_zero=True)
        _choice("embedding.cache_policy", self.cache_policy, CACHE_POLICIES)
        _choice("embedding.row_precision", self.row_precision, ("auto", *ROW_PRECISIONS))
        _choice("embedding.compression", self.compression, COMPRESSIONS)
        _choice("embedding.qr_op", self.qr_op, QR_OPS)
        _positive("embedding.compress_min_rows", self.compress_min_rows, allow_zero=True)
        for key in ("qr_buckets", "tt_rank"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"embedding.{key}", f"must be >= 1, got {getattr(self, key)}")
        if not 0.0 <= self.hot_fraction < 1.0:
            raise ConfigError(
                "embedding.hot_fraction", f"must be in [0, 1), got {self.hot_fraction}"
            )
        if int(self.hot_sample_rows) < 1:
            raise ConfigError(
                "embedding.hot_sample_rows", f"must be >= 1, got {self.hot_sample_rows}"
            )
        if not 0.0 <= self.md_alpha <= 2.0:
            raise ConfigError("embedding.md_alpha", f"must be in [0, 2], got {self.md_alpha}")
        named: set[str] = set()
        for item in self.table_compression:
            name, _, method = str(item).partition("=")
            if not name or method not in COMPRESSIONS:
                raise ConfigError(
                    "embedding.table_compression",
                    f"{item!r}: expected NAME=METHOD with METHOD one of {COMPRESSIONS}",
                )
            if name in named:  # the last would have won without a word
                raise ConfigError("embedding.table_compression", f"{name} is named twice")
            named.add(name)
        # split_bf16 is fp32's bits: a tier keeps the fp32 row (embedding/placement.py)
        if self.row_precision not in ("auto", "fp32", "split_bf16") and self.placement != "device":
            raise ConfigError(
                "embedding.row_precision",
                f"{self.row_precision} rows live in device memory; placement {self.placement!r}"
                " takes fp32 and split_bf16 rows only (use embedding.placement=device)",
            )
        _positive("embedding.cache_bytes", self.cache_bytes, allow_zero=True)
        _choice("embedding.ssd_access", self.ssd_access, ("auto", "pread", "direct", "map"))
        _choice("embedding.cache_prefetch", self.cache_prefetch, ("auto", "thread", "inline"))
        if not 1 <= int(self.io_depth) <= 256:
            raise ConfigError("embedding.io_depth", f"must be in [1, 256], got {self.io_depth}")
        _positive("embedding.io_stall_seconds", self.io_stall_seconds, allow_zero=True)
        _choice("embedding.row_order", self.row_order, ROW_ORDERS)
        if not 0.0 <= float(self.slipstream_threshold) < 1.0:
            raise ConfigError(
                "embedding.slipstream_threshold",
                f"a relative change in [0, 1), got {self.slipstream_threshold}",
            )
        if int(self.slipstream_interval) < 1:
            raise ConfigError(
                "embedding.slipstream_interval", f"must be >= 1, got {self.slipstream_interval}"
            )
        if self.slipstream and (
            self.placement == "device" or not self.warm_start or not self.warm_pin_share
        ):
            raise ConfigError(
                "embedding.slipstream",
                "watches the hot rows pinned in an ssd/host cache: it needs "
                "embedding.placement=ssd|host|auto, warm_start=true and warm_pin_share > 0",
            )
        if self.memory_budget_gb and self.placement != "auto":  # the budget auto plans to
            raise ConfigError(
                "embedding.memory_budget_gb",
                f"is what placement=auto fits the tables into; placement {self.placement!r} "
                "does not plan (set embedding.placement=auto, or leave the budget at 0)",
            )
        if not 0.0 <= float(self.warm_pin_share) <= 0.95:
            raise ConfigError(
                "embedding.warm_pin_share",
                f"must be in [0, 0.95] (the rest of the cache takes the batches' misses), "
                f"got {self.warm_pin_share}",
            )
        if int(self.order_sample_rows) < 1:
            raise ConfigError(
                "embedding.order_sample_rows", f"must be >= 1, got {self.order_sample_rows}"
            )
        for key, value, allow_zero in (
            ("embedding.lr", self.lr, False),
            ("embedding.eps", self.eps, False),
            ("embedding.initial_accumulator", self.initial_accumulator, True),
        ):
            _positive(key, value, allow_zero=allow_zero)
            # the rows, their state and the fused updates' scalars are float32: beyond its
            # range torch refused the fill or the step size with a traceback
            if value > FLOAT32_MAX:
                raise ConfigError(
                    key, f"must be at most {FLOAT32_MAX:.4g} (a float32 holds it), got {value}"
                )
        for key, b in (("embedding.beta1", self.beta1), ("embedding.beta2", self.beta2)):
            if not 0.0 <= b < 1.0:
                raise ConfigError(key, f"must be in [0, 1), got {b}")


@dataclass
class DenseOptimizerConfig:
    """The torch optimizer for MLP parameters."""

    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    eps: float = 1e-8
    # Learning-rate schedule, for the dense and the embedding learning rates alike
    # (train/schedule.py): linear warm-up over warmup_steps, then from decay_start a decay
    # over decay_steps down to decay_to x the rate (polynomial: squared, as the reference
    # DLRM; or linear), which then stays. 0 steps = no warm-up / no decay.
    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0
    decay: str = "polynomial"
    decay_to: float = 0.0

    def validate(self) -> None:
        _choice("optimizer.name", self.name, DENSE_OPTIMIZERS)
        _positive("optimizer.lr", self.lr)
        _positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optimizer.eps", self.eps)
        _positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optimizer.decay_start", self.decay_start, allow_zero=True)
        _positive("optimizer.decay_steps", self.decay_steps, allow_zero=True)
        _choice("optimizer.decay", self.decay, SCHEDULE_DECAYS)
        if not 0.0 <= self.decay_to <= 1.0:
            raise ConfigError("optimizer.decay_to", f"must be in [0, 1], got {self.decay_to}")
        if self.decay_steps and self.decay_start < self.warmup_steps:
            raise ConfigError(
                "optimizer.decay_start",
                f"{self.decay_start} is inside the warm-up ({self.warmup_steps} steps)",
            )


@dataclass
class DataConfig:
    """Where batches come from.

    ``synthetic`` draws Criteo-shaped data from a hidden model; ``binary`` reads a
    dataset written by ``recscale data preprocess`` at ``path``; ``auto`` is binary
    when ``path`` is set. With a dataset, the table sizes come from its metadata.
    """

    source: str = "auto"
    path: str = ""
    train_split: str = "train"
    eval_split: str = "test"
    # What train.eval_every scores during training (a dataset without it: eval_split).
    val_split: str = "val"
    # Block shuffle of the binary dataset (block order and rows within a block).
    shuffle: bool = True
    block_rows: int = 65536
    seed: int = 1234
    eval_samples: int = 131_072
    # Zipf exponent of each feature's id popularity (real logs: ~1.0-1.2).
    zipf_alpha: float = 1.1
    # Ids per sample per feature are drawn uniformly in [min_ids, max_ids] (1, 1 = one-hot).
    min_ids_per_feature: int = 1
    max_ids_per_feature: int = 1
    # Or exactly these ids per bag, one per table (MLPerf DLRMv2's fixed multi-hot
    # sizes); [] = drawn from [min, max] as above.
    bag_sizes: list[int] = field(default_factory=list)
    # Strength of the hidden model's signal; larger makes the task easier.
    signal_scale: float = 1.0
    # Click rate of the synthetic data (Criteo Kaggle: 0.256).
    target_ctr: float = 0.25
    # Batches prepared ahead of the training step on a background thread.
    prefetch_batches: int = 4

    def validate(self) -> None:
        _choice("data.source", self.source, DATA_SOURCES)
        if self.source == "binary" and not self.path:
            raise ConfigError("data.path", "is required when data.source is binary")
        _positive("data.block_rows", self.block_rows)
        _positive("data.seed", self.seed, allow_zero=True)  # numpy's generators: >= 0
        _positive("data.eval_samples", self.eval_samples)
        _positive("data.zipf_alpha", self.zipf_alpha, allow_zero=True)
        _positive("data.min_ids_per_feature", self.min_ids_per_feature, allow_zero=True)
        if self.max_ids_per_feature < self.min_ids_per_feature:
            raise ConfigError(
                "data.max_ids_per_feature",
                f"({self.max_ids_per_feature}) is below data.min_ids_per_feature "
                f"({self.min_ids_per_feature})",
            )
        _positive("data.max_ids_per_feature", self.max_ids_per_feature)
        if any(k < 0 for k in self.bag_sizes):
            raise ConfigError("data.bag_sizes", f"sizes must be >= 0, got {self.bag_sizes}")
        _positive("data.signal_scale", self.signal_scale, allow_zero=True)
        if not 0.0 < self.target_ctr < 1.0:
            raise ConfigError("data.target_ctr", f"must be in (0, 1), got {self.target_ctr}")
        _positive("data.prefetch_batches", self.prefetch_batches, allow_zero=True)

    def uses_dataset(self) -> bool:
        return self.source == "binary" or (self.source == "auto" and bool(self.path))


@dataclass
class TrainConfig:
    batch_size: int = 1024
    steps: int = 3000
    # Train this many passes over the dataset instead (steps = ceil(epochs x rows / batch);
    # a dataset only). Setting it sets train.steps = 0; a layer may not set both.
    epochs: float = 0.0
    eval_batch_size: int = 16384
    seed: int = 0
    device: str = "auto"
    # 0 = one thread per available core.
    threads: int = 0
    progress: bool = True
    # Steps between progress/log-file updates.
    log_every: int = 50
    # Stop after this many seconds of training even if steps remain (0 = no limit).
    max_seconds: float = 0.0
    # Write the trained model as a final checkpoint in RUN_DIR/checkpoints (for `recscale eval`).
    save_model: bool = True
    # Score the validation split every N steps (0 = only at the end) ...
    eval_every: int = 0
    # ... and stop once its AUC reaches this (0 = never; MLPerf style: time to target).
    target_auc: float = 0.0
    # Arithmetic of the MLPs and the interaction: fp32, tf32 (CUDA: TF32 tensor-core
    # GEMMs), or bf16 (autocast; fp32 master weights, tables and optimizer state; on the
    # CPU wide rows default to Split-SGD-BF16: embedding.row_precision=auto).
    precision: str = "fp32"
    # Freed host memory from step 0 (the model is built under malloc's default): retain
    # (keep it; no re-faulting of large activations each step) or system (unmap them).
    host_memory: str = "retain"

    def validate(self) -> None:
        _positive("train.batch_size", self.batch_size)
        _positive("train.epochs", self.epochs, allow_zero=True)
        if self.epochs == 0:
            _positive("train.steps", self.steps)
        elif self.steps != 0:
            raise ConfigError(
                "train.epochs", "train.steps and train.epochs are both set; set one of them"
            )
        _positive("train.eval_batch_size", self.eval_batch_size)
        _choice("train.device", self.device, DEVICES)
        _choice("train.precision", self.precision, PRECISIONS)
        _choice("train.host_memory", self.host_memory, HOST_MEMORY)
        _positive("train.eval_every", self.eval_every, allow_zero=True)
        if not 0.0 <= self.target_auc < 1.0:
            raise ConfigError("train.target_auc", f"must be in [0, 1), got {self.target_auc}")
        if self.target_auc and not self.eval_every:
            raise ConfigError("train.target_auc", "needs train.eval_every (how often to check it)")
        _positive("train.threads", self.threads, allow_zero=True)
        if self.threads > MAX_THREADS:  # OpenMP runtimes crash long before a number like 10^5
            raise ConfigError(
                "train.threads", f"{self.threads} is more than {MAX_THREADS}; 0 uses the cores"
            )
        _positive("train.log_every", self.log_every)
        _positive("train.max_seconds", self.max_seconds, allow_zero=True)


@dataclass
class CheckpointConfig:
    """Checkpointing (off unless every_steps or every_minutes is set; then also at the end)."""

    every_steps: int = 0
    every_minutes: float = 0.0
    # Keep the newest K checkpoints (and the full checkpoints their increments need).
    keep: int = 3
    # Every Nth checkpoint is full, the others incremental (1 = always full) ...
    full_every: int = 4
    # ... and a checkpoint is full anyway when more than this share of all rows changed.
    full_if_fraction: float = 0.5
    # Embedding rows on disk: fp32, fp16, or int8 (row-wise scale + bias); state stays fp32.
    precision: str = "fp32"
    # Write from an in-memory snapshot on a background thread while training goes on.
    async_write: bool = True

    def validate(self) -> None:
        _positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        _positive("checkpoint.every_minutes", self.every_minutes, allow_zero=True)
        _positive("checkpoint.keep", self.keep)
        _positive("checkpoint.full_every", self.full_every)
        if not 0.0 <= self.full_if_fraction <= 1.0:
            raise ConfigError(
                "checkpoint.full_if_fraction", f"must be in [0, 1], got {self.full_if_fraction}"
            )
        _choice("checkpoint.precision", self.precision, CHECKPOINT_PRECISIONS)


SHARDINGS = ("auto", *SHARDING_KINDS)


@dataclass
class DistributedConfig:
    """Multi-process training (``torchrun --nproc_per_node=N -m recscale train``)."""

    # auto = the planner's choice per table; or one kind for every table.
    sharding: str = "auto"
    # A plan from `recscale plan --json` (overrides sharding).
    plan: str = ""
    # Embedding memory per rank for the planner, GB (0 = the device's memory / 2).
    memory_per_rank_gb: float = 0.0
    # The planner's costs: "auto" = this host's `recscale bench calibrate` file when
    # saved (rank 0's, broadcast), else the default bandwidths; "none"; or a file path.
    calibration: str = "auto"
    # Distribute the next batch's ids while this batch computes.
    pipeline: bool = True
    # Seconds a collective waits for a silent rank before the job fails.
    timeout_s: float = 300.0

    def validate(self) -> None:
        _choice("distributed.sharding", self.sharding, SHARDINGS)
        _positive("distributed.memory_per_rank_gb", self.memory_per_rank_gb, allow_zero=True)
        _positive("distributed.timeout_s", self.timeout_s)


@dataclass
class Config:
    """The root config: one section per component (the TOML tables of the same names)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self, inert_keys: bool = True) -> Config:
        for f in fields(self):
            section = getattr(self, f.name)
            for g in fields(section):  # no setting means anything as NaN or infinity
                v = getattr(section, g.name)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{f.name}.{g.name}", f"must be a finite number, got {v}")
            section.validate()
        bags, n = len(self.data.bag_sizes), len(self.model.table_sizes)
        if bags and bags != n:
            entries = counted(bags, "entry", "entries")
            raise ConfigError("data.bag_sizes", f"has {entries}, one a table: {n}")
        check_compression(self)
        if inert_keys:  # else the caller checks the keys it was given (load_config)
            refuse_inert_keys(self)
        return self
