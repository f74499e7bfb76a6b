"""``recscale checkpoint inspect PATH [--json]``: what a checkpoint holds and whether it is
valid."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from recscale.cli.output import print_error, printable
from recscale.config.errors import counted
from recscale.config.small_files import json_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect checkpoints")
    csub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    ip = csub.add_parser(
        "inspect", help="step, config, plan, tables, sizes, kind, precision, validity"
    )
    ip.add_argument(
        "path", type=Path, help="a checkpoint, a run directory or its checkpoints/ folder"
    )
    ip.add_argument("--json", action="store_true")


def _describe(path: Path) -> dict:
    from recscale.checkpoint.format import CheckpointError, read_manifest, verify
    from recscale.checkpoint.manager import chain_of
    from recscale.checkpoint.trainer_files import load_dense, trainer_state

    info: dict = {"path": str(path)}
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return {**info, "valid": False, "error": str(e)}
    info.update(
        {k: manifest.get(k) for k in ("kind", "step", "parent", "precision", "plan", "config")}
    )
    info["bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    info["tables"] = [
        {"name": t["name"], "rows": t["num_rows"], "dim": t["dim"], "stored_rows": t["stored_rows"]}
        for t in manifest["tables"]
    ]
    try:
        chain = chain_of(path)
        for p in chain:
            trainer_state(p, verify(p))  # its step the manifest's, its generator state one
            load_dense(p)  # loadable as plain tensors (a planted pickle is not valid)
        info.update(valid=True, chain=[p.name for p in chain])
    except CheckpointError as e:
        info.update(valid=False, error=str(e))
    return info


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:  # inspect reads what the checkpoint says; a config override changes nothing
        print(
            f"recscale checkpoint: unexpected arguments {printable(' '.join(extra))}",
            file=sys.stderr,
        )
        return 2
    # Imported here, not at the top: `recscale --help` and the other commands need
    # neither torch nor the training stack (seconds of imports).
    from recscale.checkpoint.manager import checkpoint_dirs

    path: Path = args.path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    paths = [path] if (path / "manifest.json").exists() else checkpoint_dirs(root)
    if not paths:
        why = (
            "does not exist"
            if not os.path.lexists(path)
            else "is not a directory"
            if not path.is_dir()
            else "holds no checkpoints (a run directory, its checkpoints/ or one step_N)"
        )
        print_error(f"{path} {why}")
        return 1
    infos = [_describe(p) for p in paths]
    if args.json:
        print(json_text(infos if len(infos) > 1 else infos[0], indent=2))
        return 0 if all(i["valid"] for i in infos) else 1
    for i in infos:
        status = "valid" if i["valid"] else f"INVALID: {i['error']}"
        if "kind" not in i:
            print(f"{i['path']}: {status}")
            continue
        rows = sum(t["stored_rows"] for t in i["tables"])
        print(
            f"{i['path']}: step {i['step']}, {i['kind']}"
            + (f" (parent {i['parent']})" if i["parent"] else "")
            + f", {i['precision']}, {i['bytes'] / 1e6:.1f} MB, {len(i['tables'])} tables, {rows:,} "
            f"rows stored; {status}"
        )
        plan = i.get("plan") or {}
        if plan.get("placements"):  # a sharded run: the plan it was written under (metadata only)
            kinds: dict[str, int] = {}
            for p in plan["placements"]:
                kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
            w = plan["world_size"]
            print(
                f"  written by {counted(w, 'rank')}: "
                + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
                + " (parts in table coordinates: loads at any world size and plan)"
            )
    return 0 if all(i["valid"] for i in infos) else 1
