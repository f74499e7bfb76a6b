"""``recscale data preprocess|synth-tsv|multihot|info``: build and inspect binary datasets."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recscale.cli.output import print_error, printable
from recscale.config.small_files import json_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="preprocess click logs into a binary dataset")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    pp = dsub.add_parser("preprocess", help="Criteo TSV (plain/.gz) or Parquet -> binary dataset")
    pp.add_argument(
        "--format", default="criteo", choices=["criteo", "parquet"], help="input format"
    )
    pp.add_argument("--input", nargs="+", required=True, type=Path, help="input files, in order")
    pp.add_argument("--out", required=True, type=Path, help="output dataset directory")
    pp.add_argument("--mode", default="hash", choices=["hash", "vocab"], help="categorical id mode")
    pp.add_argument(
        "--hash-size",
        default="auto",
        help="hash mode: rows per table, one number or 26 comma-separated, or auto (default: "
        "4 x each feature's distinct values in the train split, at most 40M as MLPerf)",
    )
    pp.add_argument(
        "--min-count", type=int, default=1, help="vocab mode: rarer ids share one 'rare' id"
    )
    pp.add_argument(
        "--split",
        default="kaggle",
        choices=["kaggle", "by-file", "none"],
        help="kaggle: first 6/7 train, last 1/7 halved into val/test; by-file: --test/--val files",
    )
    pp.add_argument(
        "--test", nargs="*", default=[], type=Path, help="by-file: test files (default: last input)"
    )
    pp.add_argument("--val", nargs="*", default=[], type=Path, help="by-file: validation files")
    pp.add_argument(
        "--max-bad-fraction", type=float, default=0.001, help="fail above this share of bad lines"
    )
    pp.add_argument("--threads", type=int, default=0, help="parser threads (default: all cores)")
    pp.add_argument("--chunk-mb", type=int, default=32, help="text per parse chunk (bounds memory)")
    pp.add_argument("--parquet-out", action="store_true", help="also write each split as Parquet")

    sp = dsub.add_parser("synth-tsv", help="write a synthetic Criteo-format TSV (plain or .gz)")
    sp.add_argument("--lines", type=int, required=True)
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument(
        "--cycle-blocks",
        type=int,
        default=0,
        metavar="N",
        help="draw only N blocks of 100k lines and repeat them (fast, for ingestion-speed "
        "tests; the test split then repeats training lines, so held-out metrics are not "
        "meaningful). Default 0: every line drawn afresh",
    )

    mp = dsub.add_parser(
        "multihot", help="a one-hot dataset -> multi-hot bags (MLPerf DLRMv2 style)"
    )
    mp.add_argument("--input", required=True, type=Path, help="a one-hot dataset directory")
    mp.add_argument("--out", required=True, type=Path, help="the multi-hot dataset directory")
    mp.add_argument(
        "--bag-sizes",
        default="mlperf",
        help="ids per bag: one number, one per feature (comma-separated), or mlperf "
        "(MLPerf DLRMv2's 26 sizes: 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1)",
    )
    mp.add_argument("--seed", type=int, default=0, help="draws the bags' offsets")
    mp.add_argument(
        "--layout",
        choices=("rule", "ids"),
        default="rule",
        help="rule (default): keep the one-hot ids and the expansion's sizes + seed; the "
        "loader makes the bags as it reads (6x fewer bytes at MLPerf's sizes). ids: write "
        "every id of every bag",
    )

    ip = dsub.add_parser("info", help="print a dataset's metadata")
    ip.add_argument("path", type=Path)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        print(f"recscale data: unexpected arguments {printable(' '.join(extra))}", file=sys.stderr)
        return 2
    if args.data_command == "preprocess":
        from recscale.dataprep.preprocess import BadDataError, PreprocessOptions, preprocess

        try:
            hs = str(args.hash_size)
            sizes = [] if hs == "auto" else [int(s) for s in hs.split(",")]
        except ValueError:
            print(
                f"recscale: error: --hash-size must be integers, got {args.hash_size!r}",
                file=sys.stderr,
            )
            return 2
        opts = PreprocessOptions(
            inputs=args.input,
            out=args.out,
            input_format=args.format,
            id_mode=args.mode,
            hash_sizes=sizes,
            min_count=args.min_count,
            split=args.split,
            test_files=args.test,
            val_files=args.val,
            max_bad_fraction=args.max_bad_fraction,
            threads=args.threads,
            chunk_bytes=args.chunk_mb * (1 << 20),  # validate() checks it
            parquet_out=args.parquet_out,
        )
        try:
            preprocess(opts)
        except (BadDataError, ValueError) as e:
            print_error(e)
            return 1
        return 0
    if args.data_command == "synth-tsv":
        from recscale.dataprep.criteo_tsv import write_tsv

        try:
            n = write_tsv(args.out, args.lines, seed=args.seed, distinct_blocks=args.cycle_blocks)
        except ValueError as e:  # bad arguments, more than the disk or the memory holds
            print_error(e)
            return 1
        print(f"wrote {args.lines:,} lines ({n / 1e6:.1f} MB of text) to {args.out}")
        opt = json.loads(Path(str(args.out) + ".optimum.json").read_text())["kaggle_test"]
        auc = "undefined" if opt["auc"] is None else f"{opt['auc']:.4f}"  # one class only
        print(
            f"the click model itself scores AUC {auc}, logloss {opt['logloss']:.4f} on the "
            f"{opt['lines']:,} lines --split kaggle makes the test split (the ceiling; "
            f"{args.out}.optimum.json)"
        )
        return 0
    if args.data_command == "multihot":
        from recscale.data.dataset import DatasetError
        from recscale.data.multihot import MLPERF_BAG_SIZES
        from recscale.dataprep.multihot import to_multihot

        try:
            sizes = (
                list(MLPERF_BAG_SIZES)
                if args.bag_sizes == "mlperf"
                else [int(x) for x in args.bag_sizes.split(",")]
            )
        except ValueError:
            print(
                "recscale: error: --bag-sizes takes whole numbers (one, or one a feature, "
                f"comma-separated) or mlperf, got {args.bag_sizes!r}",
                file=sys.stderr,
            )
            return 1
        try:
            to_multihot(args.input, args.out, sizes, args.seed, layout=args.layout)
        except (DatasetError, ValueError) as e:
            print_error(e)
            return 1
        return 0
    from recscale.data.columns import DATASET_FIELDS, read_metadata

    # checked as training opens it: a FIFO is refused, not read; damaged fields named
    print(json_text(_readable(read_metadata(args.path, DATASET_FIELDS)), indent=2))
    return 0


def _readable(meta: dict) -> dict:
    """The metadata as ``data info`` prints it: the id profile's hit curves (10 points a
    table) one line a table - "rows share: lookups share" - instead of 40 lines."""
    profile = meta.get("id_profile")
    curves = profile.get("hit_curves") if isinstance(profile, dict) else None
    if not isinstance(curves, list):
        return meta
    try:
        lines = [", ".join(f"{x:.1%}: {y:.3f}" for x, y in c) for c in curves]
    except (TypeError, ValueError):  # a hand-edited curve: printed as it is
        return meta
    names = meta.get("feature_names") or []
    keys = names if len(names) == len(lines) else [f"table {i}" for i in range(len(lines))]
    return {**meta, "id_profile": {**profile, "hit_curves": dict(zip(keys, lines))}}
