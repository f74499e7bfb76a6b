"""TOML presets + ``--section.key=value`` overrides -> a validated :class:`Config`.

Resolution order: dataclass defaults, then the TOML file (a preset name from
``configs/`` or a path), then command-line overrides. Unknown sections or keys and
values of the wrong type raise :class:`ConfigError` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from recscale.config.errors import ConfigError
from recscale.config.inert_keys import drop_inert_values, refuse_inert_keys
from recscale.config.schema import Config
from recscale.config.small_files import loads_toml, read_small_text


def preset_dir() -> Path:
    return Path(str(resources.files("recscale") / "configs"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.toml"))


def _resolve_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ConfigError("--config", f"file not found: {path}")
        return path
    preset = preset_dir() / f"{name_or_path}.toml"
    if not preset.exists():
        raise ConfigError(
            "--config",
            f"'{name_or_path}' is neither a file nor a preset ({', '.join(preset_names())})",
        )
    return preset


def _int64(key: str, value: int) -> int:
    """``value`` if it fits a signed 64-bit integer (what TOML and every tensor index
    hold), else a ConfigError naming ``key``."""
    if not -(2**63) <= value < 2**63:
        raise ConfigError(key, f"{value} does not fit a 64-bit integer")
    return value


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check/convert one TOML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str):  # command line: "512,256,1", "[512, 256, 1]", "" empty
            text = value.replace(" ", "")
            if text.startswith("[") and text.endswith("]"):  # as the TOML file writes it
                text = text[1:-1]
            value = text.split(",") if text else []
            if value and not value[-1]:  # one trailing comma, as TOML allows
                value.pop()
            if "" in value:  # "32,,8" is a typo, not [32, 8]
                raise ConfigError(key, f"an empty entry in {text!r}")
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported config annotation {annotation}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return _int64(key, value)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)  # TOML's 9e9
        if isinstance(value, str):
            try:
                whole = int(value.replace("_", ""))
            except ValueError:
                whole = None
            if whole is not None:
                return _int64(key, whole)
            try:  # "9e9" (bytes, rows): a whole number in scientific notation
                number = float(value)
            except ValueError:
                number = math.nan
            if number.is_integer() and abs(number) < 2**63:
                return int(number)
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            try:  # a path of bytes that are not UTF-8 arrives as lone surrogates (argv)
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(
                    key,
                    f"{value!r} holds bytes that are not UTF-8, which the run's config.toml "
                    "cannot record: rename it, or reach it through a link of a UTF-8 name",
                ) from None
            return value
        raise ConfigError(key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {annotation}")


def _section_types(section_obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(section_obj))


def set_key(cfg: Config, dotted: str, value: Any) -> None:
    """Set ``section.key`` on ``cfg`` with type checking; unknown names are errors."""
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(dotted, "keys have the form section.key (e.g. model.embedding_dim)")
    section, key = parts
    sections = {f.name for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise ConfigError(
            dotted, f"unknown section '{section}' (sections: {', '.join(sorted(sections))})"
        )
    obj = getattr(cfg, section)
    types_ = _section_types(obj)
    if key not in types_:
        raise ConfigError(dotted, f"unknown key (keys of [{section}]: {', '.join(sorted(types_))})")
    setattr(obj, key, _coerce(dotted, value, types_[key]))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--model.embedding_dim=64", "--train.steps", "10"]`` -> ``[(key, raw value), ...]``."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(arg, "overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(arg[2:], "is missing its value")
            key, value = arg[2:], args[i + 1]
            i += 1
        out.append((key, value))
        i += 1
    return out


def load_config(
    name_or_path: str | None = None, overrides: list[str] | None = None, saved: bool = False
) -> Config:
    """Defaults <- TOML (preset name or path) <- overrides; then validate. ``saved``: the
    TOML is a run's own config.toml, read back to evaluate or resume it: a key that acts
    only under another's setting is refused where the overrides give it; where the file
    has it (written before the rule: a run was trained so, and stays readable) it is set
    back to its default, which is what it did."""
    cfg = Config()
    if name_or_path:
        path = _resolve_path(name_or_path)
        # A byte-order mark (some Windows editors write one) is not TOML: read past it.
        text = read_small_text(path, "--config").removeprefix("\ufeff")
        try:
            data = loads_toml(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"{path} is not valid TOML: {e}") from e
        layer = []
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(section, f"top-level entries of {path} must be [sections]")
            for key, value in table.items():
                set_key(cfg, f"{section}.{key}", value)
                layer.append((f"{section}.{key}", value))
        _steps_or_epochs(cfg, layer, str(path))
    parsed = parse_overrides(overrides or [])
    for key, value in parsed:
        set_key(cfg, key, value)
    _steps_or_epochs(cfg, parsed, "the command line")
    if not saved:
        return cfg.validate()
    cfg.validate(inert_keys=False)
    refuse_inert_keys(cfg, only=(key for key, _ in parsed))
    drop_inert_values(cfg)  # the file's: so every later validate() of the run passes
    return cfg


def _steps_or_epochs(cfg: Config, layer: list[tuple[str, Any]], where: str) -> None:
    """``train.steps`` and ``train.epochs`` say the same thing: one layer (a TOML file, or
    the command line) may set one of them, and it wins over what a lower layer set."""
    keys = {k for k, _ in layer}
    epochs = dict(layer).get("train.epochs")
    steps = dict(layer).get("train.steps")
    if float(epochs or 0) > 0 and int(steps or 0) > 0:
        raise ConfigError(
            "train.epochs",
            f"{where} sets both train.steps and train.epochs; set one (steps are derived from "
            "epochs and the dataset's rows)",
        )
    if "train.epochs" in keys and float(epochs or 0) > 0:
        cfg.train.steps = 0  # derived from the data when the run starts
    elif "train.steps" in keys and "train.epochs" not in keys:
        cfg.train.epochs = 0.0  # a layer's epochs of 0 or less stays, for validate to judge


# Written escaped in a TOML basic string: the backslash, the quote, and the controls TOML
# forbids raw (U+0000-U+001F, U+007F) - a path holding one wrote a config.toml that
# `eval` and `--resume` could not read back.
_TOML_STRING_ESCAPES = {
    **{c: f"\\u{c:04x}" for c in (*range(0x20), 0x7F)},
    ord("\\"): "\\\\",
    ord('"'): '\\"',
}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a basic string: TOML forbids its control characters raw
        return '"' + v.translate(_TOML_STRING_ESCAPES) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v)} to TOML")


def config_to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML; loading it back gives an equal Config."""
    lines: list[str] = []
    for f in dataclasses.fields(cfg):
        lines.append(f"[{f.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, f.name)).items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
