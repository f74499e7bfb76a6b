"""``recscale eval --model RUN_DIR [--data.path DIR] [--split NAME]``: score a trained model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from recscale.cli.output import print_error
from recscale.cli.train_cmd import run_dir_of
from recscale.config.errors import ConfigError
from recscale.config.loader import load_config, parse_overrides
from recscale.config.small_files import json_text, write_bytes_atomic, write_text_atomic


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained model (--model RUN_DIR from recscale train) on a split",
        epilog="Config overrides (e.g. --data.path DIR) apply on top of RUN_DIR/config.toml; "
        "keys only training reads (train.steps, optimizer.*, ...) are refused.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="run directory: config.toml + model.pt, or else its newest valid checkpoint; "
        "or one checkpoint (RUN_DIR/checkpoints/step_N), or RUN_DIR/checkpoints (its newest)",
    )
    p.add_argument(
        "--split", default=None, help="dataset split (default: data.eval_split, usually test)"
    )
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument(
        "--predictions",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write each sample's click probability, in the split's row order: "
        "FILE.npy (float32, one a sample) or FILE.csv (label,probability)",
    )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    # Imported here, not at the top: `recscale --help` and the other commands need
    # neither torch nor the training stack (seconds of imports).
    import torch

    from recscale import native
    from recscale.checkpoint.format import CheckpointError
    from recscale.checkpoint.manager import resolve_chain
    from recscale.checkpoint.model_file import MODEL_FILE, load_model_file
    from recscale.checkpoint.state import restore
    from recscale.metrics import metrics_text
    from recscale.models.dlrm import build_model
    from recscale.native.team import flush_denormals
    from recscale.train.data_source import (
        adopt_dataset_shapes,
        check_synthetic_memory,
        eval_batches,
        refuse_keys_a_dataset_overrules,
    )
    from recscale.train.parallel import check_eval_batch_memory, evaluate
    from recscale.train.precision import resolve_row_precision
    from recscale.train.step import resolve_device

    if args.predictions is not None:
        check_predictions_path(args.predictions)
    run_dir: Path = args.model
    checkpoint: Path | None = None  # a checkpoint (or the checkpoints/ folder) named
    if not (run_dir / "config.toml").exists() and (
        run_dir.name == "checkpoints" or (run_dir / "manifest.json").exists()
    ):
        checkpoint = run_dir
        run_dir = run_dir_of(run_dir) or run_dir.parent  # the parent: named in the error
    has_checkpoints = (run_dir / "checkpoints").is_dir()
    if not (run_dir / "config.toml").exists() or not (
        os.path.lexists(run_dir / MODEL_FILE) or has_checkpoints
    ):
        why = (
            "has a config.toml but no model.pt and no checkpoints/ (a run with "
            "train.save_model=false and no checkpointing keeps no model to score)"
            if (run_dir / "config.toml").is_file()
            else "is not a run directory: no config.toml with a model.pt or checkpoints/"
        )
        if checkpoint is not None:  # a checkpoint is scored with its run's config
            why = f"(above the checkpoint {checkpoint}) {why}"
        print_error(f"{run_dir} {why}")
        return 1
    try:
        trained = load_config(str(run_dir / "config.toml"), saved=True)
    except ConfigError as e:  # the run's own config.toml: the file --model named
        raise ConfigError("--model" if e.key == "--config" else e.key, e.message) from None
    cfg = load_config(str(run_dir / "config.toml"), overrides, saved=True)
    keys = [key for key, _ in parse_overrides(overrides)]
    refuse_training_only_keys(keys)
    refuse_keys_a_dataset_overrules(cfg, keys)
    if cfg.train.threads:  # as training takes it (0: torch's own, the cores)
        torch.set_num_threads(cfg.train.threads)
    if args.split and cfg.data.uses_dataset():  # the split scored, checked in its place
        cfg.data.eval_split = args.split
    try:
        adopt_dataset_shapes(cfg, training=False)
    except ConfigError as e:
        if args.split and e.key == "data.eval_split":
            raise ConfigError("--split", e.message) from None
        raise
    if cfg.model != trained.model:
        print(
            "recscale: error: the evaluation data implies a different model than the one trained "
            f"(table sizes {sum(cfg.model.table_sizes):,} vs {sum(trained.model.table_sizes):,} "
            "rows)",
            file=sys.stderr,
        )
        return 1
    if args.split and not cfg.data.uses_dataset():
        raise ConfigError(
            "--split",
            f"{args.split!r}: this run trained on synthetic data, which has one held-out set "
            "(no splits); name a dataset with --data.path to score one of its splits",
        )
    check_eval_batch_memory(cfg, 1, args.split)  # before the model is built and restored
    if not cfg.data.uses_dataset():
        check_synthetic_memory(cfg)
    device = resolve_device(cfg.train.device)
    flush_denormals(native.library())  # as training runs (train/step.py)
    resolve_row_precision(cfg, device)  # a run's config.toml names it; auto for older ones
    model = build_model(cfg.model, cfg.embedding, device=device, init_rows=False)  # restored
    if checkpoint is None and os.path.lexists(run_dir / MODEL_FILE):  # the final model
        try:
            load_model_file(model, run_dir)
        except CheckpointError as e:
            print_error(e)
            return 1
    else:  # the final checkpoint (or, after a crash, the newest valid one)
        try:
            chain = resolve_chain(checkpoint or run_dir, echo=lambda m: print(m, file=sys.stderr))
            step = restore(model, None, chain)["step"]
        except CheckpointError as e:
            print_error(e)
            return 1
        print(f"recscale: evaluating checkpoint {chain[-1].name} (step {step})", file=sys.stderr)
    split = args.split or cfg.data.eval_split
    # in the run's precision, as its own evaluations: its metrics.json, reproduced
    if args.predictions is not None:  # before the scoring: never where the run reads
        refuse_overwriting_inputs(args.predictions, run_dir, cfg.data.path)
    metrics, logits, labels = evaluate(model, eval_batches(cfg, split), device, cfg.train.precision)
    metrics["split"] = split if cfg.data.uses_dataset() else "synthetic-eval"
    metrics["precision"] = cfg.train.precision
    if args.predictions is not None:
        write_predictions(args.predictions, logits, labels)
        metrics["predictions"] = str(args.predictions)
    # a checkpoint named by its path: its own file beside the final model's
    named = (
        f"_{chain[-1].name}" if checkpoint is not None and checkpoint.name != "checkpoints" else ""
    )
    out = run_dir / f"eval_{metrics['split']}{named}.json"
    write_text_atomic(out, json_text(metrics, indent=2) + "\n")  # not through a planted link
    if args.json:
        print(json_text(metrics, indent=2))
    else:
        split = f"{metrics['split']} ({metrics['count']:,} samples)"
        print(f"{split}: {metrics_text(metrics)}  -> {out}")
        if args.predictions is not None:
            print(f"{metrics['count']:,} predictions -> {args.predictions}")
    return 0


# What eval reads nothing of: the training's steps, rates, stops, checkpoints and ranks
# (a whole section: None). Given, they changed nothing, without a word.
TRAINING_ONLY: dict[str, frozenset[str] | None] = {
    "optimizer": None,
    "checkpoint": None,
    "distributed": None,
    "train": frozenset(
        "batch_size steps epochs seed progress log_every max_seconds save_model eval_every "
        "target_auc".split()
    ),
    "data": frozenset("train_split val_split shuffle prefetch_batches".split()),
    "embedding": frozenset(
        "lr eps beta1 beta2 initial_accumulator slipstream slipstream_threshold "
        "slipstream_interval".split()
    ),
}


def refuse_training_only_keys(keys: list[str]) -> None:
    """A ConfigError for the first override eval would ignore (``TRAINING_ONLY``)."""
    for key in keys:
        section, _, name = key.partition(".")
        if section in TRAINING_ONLY and (
            TRAINING_ONLY[section] is None or name in TRAINING_ONLY[section]
        ):
            raise ConfigError(
                key,
                "acts in training only: eval scores the trained model as its run's config "
                "has it (its data, eval batch, device, precision and tier keys can be "
                "given; the split: --split)",
            )


PREDICTION_FORMATS = (".npy", ".csv")


def check_predictions_path(path: Path) -> None:
    """Refuse, before anything is loaded, a predictions file of no known format or in a
    folder that is not there."""
    if path.suffix.lower() not in PREDICTION_FORMATS:
        raise ConfigError(
            "--predictions",
            f"{str(path)!r}: name a .npy (float32, one probability a sample) or a .csv "
            "(label,probability) file",
        )
    if path.is_dir():
        raise ConfigError("--predictions", f"{str(path)!r} is a directory; name a file")
    if not path.parent.is_dir():
        raise ConfigError("--predictions", f"{str(path.parent)!r} is not a directory")


def refuse_overwriting_inputs(path: Path, run_dir: Path, data_path: str) -> None:
    """Predictions never go where the run reads from: its checkpoints or the dataset's
    folder (the run directory itself takes them: its own files are no .npy or .csv)."""
    target = path.resolve()
    for kept, what in (
        (run_dir / "checkpoints", "the run's checkpoints"),
        (data_path, "the dataset"),
    ):
        if kept and (kept := Path(kept).resolve()) in (target, *target.parents):
            raise ConfigError(
                "--predictions",
                f"{str(path)!r} is inside {what} ({kept}); write the predictions elsewhere",
            )


def write_predictions(path: Path, logits, labels) -> None:
    """Each sample's probability (sigmoid of its fp32 logit) in the split's order, the
    file replaced whole or not at all."""
    import io

    import numpy as np
    import torch

    probs = torch.sigmoid(logits.double()).float().numpy()
    if path.suffix.lower() == ".npy":
        buf = io.BytesIO()
        np.save(buf, probs)
        write_bytes_atomic(path, buf.getvalue())
        return
    lines = (f"{int(y)},{q:.7g}\n" for y, q in zip(labels.tolist(), probs.tolist()))
    write_text_atomic(path, "label,probability\n" + "".join(lines))
