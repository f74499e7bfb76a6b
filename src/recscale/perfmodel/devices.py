"""The device catalogue of the forecast (``devices.toml`` beside this file, plus a
user's TOML file of the same shape): public figures of GPUs and CPU sockets, each
entry with its sources. Plain data, no torch.

    name -> DeviceSpec(kind "gpu" | "cpu", peak_tflops {precision: TFLOP/s dense},
                       memory_gbps, memory_gb, units (SMs / CUs / cores), l2_mb,
                       intra_node_gbps, devices_per_node, network_gbps, sources)

``this`` is not an entry: it names the calibrated host (``recscale bench calibrate``),
whose forecast is the performance model's own prediction.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from recscale.config.errors import ConfigError
from recscale.config.small_files import loads_toml, read_small_text

CATALOGUE = Path(__file__).with_name("devices.toml")
THIS = "this"
KINDS = ("gpu", "cpu")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
# key -> (type, must be > 0)
_NUMBERS = {
    "memory_gbps": float,
    "memory_gb": float,
    "units": int,
    "l2_mb": float,
    "intra_node_gbps": float,
    "devices_per_node": int,
    "network_gbps": float,
}


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str
    description: str
    peak_tflops: dict[str, float]
    memory_gbps: float
    memory_gb: float
    units: int
    l2_mb: float
    intra_node_gbps: float
    devices_per_node: int
    network_gbps: float
    sources: dict[str, str] = field(default_factory=dict)

    def peak_flops(self, precision: str) -> float:
        """FLOP/s at ``precision`` (one line naming the device's precisions if it has
        none such)."""
        if precision not in self.peak_tflops:
            raise ConfigError(
                "--precision",
                f"{self.name} has no {precision} rate in the catalogue "
                f"(it lists {', '.join(self.peak_tflops)})",
            )
        return self.peak_tflops[precision] * 1e12


def _entry(name: str, d: dict, where: str) -> DeviceSpec:
    key = f"{where}: [{name}]"
    if not isinstance(d, dict):
        raise ConfigError(key, "an entry is a table of keys")
    known = {"kind", "description", "peak_tflops", "sources", *_NUMBERS}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key (keys: {', '.join(sorted(known))})")
    for k in ("kind", "peak_tflops", *_NUMBERS):
        if k not in d:
            raise ConfigError(f"{key}.{k}", "missing (every device needs it for a forecast)")
    if d["kind"] not in KINDS:
        raise ConfigError(f"{key}.kind", f"{d['kind']!r} is not one of {', '.join(KINDS)}")
    peaks = d["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        raise ConfigError(f"{key}.peak_tflops", "a table {precision = TFLOP/s}")
    for p, v in peaks.items():
        if p not in PRECISIONS:
            raise ConfigError(f"{key}.peak_tflops.{p}", f"precisions: {', '.join(PRECISIONS)}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ConfigError(f"{key}.peak_tflops.{p}", f"a number > 0, got {v!r}")
    nums = {}
    for k, typ in _NUMBERS.items():
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ConfigError(f"{key}.{k}", f"a number > 0, got {v!r}")
        if typ is int and v != int(v):
            raise ConfigError(f"{key}.{k}", f"a whole number, got {v!r}")
        nums[k] = typ(v)
    sources = d.get("sources", {})
    if not isinstance(sources, dict):
        raise ConfigError(f"{key}.sources", "a table {figure = where it is published}")
    return DeviceSpec(
        name,
        d["kind"],
        str(d.get("description", name)),
        {p: float(v) for p, v in peaks.items()},
        sources={str(k): str(v) for k, v in sources.items()},
        **nums,
    )


def _read(path: Path) -> dict[str, DeviceSpec]:
    try:
        data = loads_toml(read_small_text(path, "--device-file"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--device-file", f"{path}: not TOML ({e})") from None
    if THIS in data:
        raise ConfigError(f"{path}: [{THIS}]", f"{THIS!r} names the calibrated host")
    return {n: _entry(n, d, str(path)) for n, d in data.items()}


def catalogue(extra: str | Path | None = None) -> dict[str, DeviceSpec]:
    """The shipped catalogue, with ``extra``'s entries added (replacing same names)."""
    devices = _read(CATALOGUE)
    if extra:
        devices.update(_read(Path(extra)))
    return devices


def device_spec(name: str, extra: str | Path | None = None) -> DeviceSpec:
    """The entry ``name`` (one line naming the catalogue's entries if there is none)."""
    devices = catalogue(extra)
    if name not in devices:
        raise ConfigError(
            "--device", f"unknown device {name!r} (entries: {', '.join([*devices, THIS])})"
        )
    return devices[name]
