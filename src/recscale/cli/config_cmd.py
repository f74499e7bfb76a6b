"""``recscale config``: print the fully resolved config (preset + overrides) as TOML."""

from __future__ import annotations

import argparse

from recscale.config.loader import config_to_toml, load_config, preset_names


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the resolved config as TOML")
    p.add_argument(
        "--config", default=None, help=f"preset ({', '.join(preset_names())}) or TOML path"
    )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    print(config_to_toml(load_config(args.config, overrides)), end="")
    return 0
