"""``recscale bench sweep``: training throughput over a grid of config values.

The Zion study's characterization (Acun et al., HPCA 2021), for any config key::

    recscale bench sweep --vary model.embedding_dim=16,32,64 --vary train.batch_size=512,2048 \\
        [--config NAME] [--steps N] --out DIR

Every point of the grid (the product of the ``--vary`` lists) runs ``recscale bench
throughput`` in a fresh process (so its peak memory is its own, and a point that fails
- out of memory, an impossible config - is recorded and the sweep goes on). Results::

    DIR/results.csv     one row per point: the knobs, samples/s, the bound, ms/step, the
                        stage times (data, lookup, bottom MLP, interaction, top MLP,
                        backward, sparse update, dense optimizer, communication), peak
                        memory, or the error; appended as each point finishes, so an
                        interrupted sweep resumes where it stopped
    DIR/throughput_vs_<knob>.png, DIR/stages.png, DIR/heatmap.png   (matplotlib)
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recscale.config.errors import ConfigError, counted
from recscale.config.loader import load_config, set_key
from recscale.config.small_files import open_log, write_bytes_atomic

STAGE_COLUMNS = (
    "data",
    "lookup",
    "bottom_mlp",
    "interaction",
    "top_mlp",
    "backward",
    "sparse",
    "dense_opt",
    "communication",
)
RESULT_COLUMNS = (
    "samples_per_s",
    "bound_samples_per_s",
    "ratio_to_bound",
    "ms_per_step",
    *(f"{s}_ms" for s in STAGE_COLUMNS),
    "peak_rss_bytes",
    "peak_device_bytes",
    "device",
    "error",
)


def point_overrides(config: str | None, point: dict[str, str]) -> list[str]:
    """The overrides of one grid point, plus what keeps the model valid: with the dot
    interaction the bottom MLP must end at the embedding dim, so when the dim varies its
    last layer follows (as in the Zion study's sweeps)."""
    over = [f"--{k}={v}" for k, v in point.items()]
    if "model.embedding_dim" in point and "model.bottom_mlp" not in point:
        base = load_config(config, [o for o in over if not o.startswith("--model.embedding_dim")])
        set_key(base, "model.embedding_dim", point["model.embedding_dim"])  # "a": names it
        if base.model.interaction == "dot" and base.model.bottom_mlp:
            mlp = [*base.model.bottom_mlp[:-1], base.model.embedding_dim]
            over.append(f"--model.bottom_mlp={','.join(map(str, mlp))}")
    return over


def _split_values(spec: str, values: str) -> list[str]:
    """``"16,32"`` -> ``["16", "32"]``; a list value keeps its own commas:
    ``"[512,256,16],[256,16]"`` -> ``["[512,256,16]", "[256,16]"]``."""
    vals, depth, start = [], 0, 0
    for i, c in enumerate(values + ","):
        depth += (c == "[") - (c == "]")
        if depth < 0:
            break
        if c == "," and depth == 0:
            vals.append(values[start:i].strip())
            start = i + 1
    if depth != 0:
        raise ConfigError("--vary", f"{spec!r}: unbalanced [ ] in its values")
    return [v for v in vals if v]


def parse_vary(specs: list[str], config: str | None) -> list[tuple[str, list[str]]]:
    """``["model.embedding_dim=16,32", ...]`` -> ``[("model.embedding_dim", ["16", "32"])]``
    (a list-valued key in brackets: ``model.top_mlp=[256,1],[512,256,1]``), each key and
    value checked against the config schema now (not one point at a time)."""
    out = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        vals = _split_values(spec, values) if sep else []
        if not key or not vals:
            raise ConfigError("--vary", f"{spec!r}: expected section.key=v1,v2,...")
        if key in {k for k, _ in out}:
            raise ConfigError("--vary", f"{key} is varied twice")
        out.append((key, vals))
    if not out:
        raise ConfigError("--vary", "give at least one --vary section.key=v1,v2,...")
    for point in grid(out):  # every point checked now (raises naming the key)
        load_config(config, point_overrides(config, point))
    return out


def grid(varies: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    keys = [k for k, _ in varies]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in varies))]


def _row(point: dict[str, str], r: dict[str, Any] | None, error: str = "") -> dict[str, Any]:
    row: dict[str, Any] = dict(point)
    if r is None:
        row.update({c: "" for c in RESULT_COLUMNS})
        row["error"] = error
        return row
    stages = {**r.get("stage_detail_ms", {}), **r["stage_ms"]}
    stages.setdefault("communication", 0.0)  # one process: no collectives
    row.update(
        {
            "samples_per_s": round(r["samples_per_s"], 1),
            "bound_samples_per_s": round(r["bound_samples_per_s"], 1),
            "ratio_to_bound": round(r["ratio_to_bound"], 4),
            "ms_per_step": round(r["ms_per_step"], 4),
            **{f"{s}_ms": round(float(stages.get(s, 0.0)), 4) for s in STAGE_COLUMNS},
            "peak_rss_bytes": r["peak_rss_bytes"],
            "peak_device_bytes": r.get("peak_device_bytes") or "",
            "device": r.get("device", "cpu"),
            "error": "",
        }
    )
    return row


def run_point(
    config: str | None, point: dict[str, str], steps: int, warmup: int, extra: list[str]
) -> dict[str, Any]:
    """One ``recscale bench throughput --json`` in a fresh process; its result or error."""
    cmd = [
        sys.executable,
        "-m",
        "recscale",
        "bench",
        "throughput",
        "--json",
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        *(["--config", config] if config else []),
        *extra,
        *point_overrides(config, point),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return _row(point, None, (lines[-1] if lines else f"exit code {p.returncode}")[:300])
    return _row(point, json.loads(p.stdout))


def _done(csv_path: Path, keys: list[str]) -> dict[tuple[str, ...], dict[str, str]]:
    if not csv_path.exists():
        return {}
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and set(keys) - set(rows[0]):
        raise ConfigError("--out", f"{csv_path} holds a sweep over other knobs; use another --out")
    return {tuple(r[k] for k in keys): r for r in rows}


def run_sweep(
    config: str | None,
    varies: list[tuple[str, list[str]]],
    out: Path,
    steps: int = 20,
    warmup: int = 5,
    extra: list[str] | None = None,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every point not already in ``out/results.csv``; returns all rows, in grid order."""
    out.mkdir(parents=True, exist_ok=True)
    keys = [k for k, _ in varies]
    points = grid(varies)
    csv_path = out / "results.csv"
    done = _done(csv_path, keys)
    todo = [p for p in points if tuple(p.values()) not in done]
    if done:
        echo(f"recscale: {len(points) - len(todo)} of {len(points)} points already in {csv_path}")
    from tqdm import tqdm

    bar = tqdm(todo, desc="sweep", unit="point", disable=not progress or not todo)
    for point in bar:
        bar.set_postfix_str(", ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()))
        row = run_point(config, point, steps, warmup, extra or [])
        new = not csv_path.exists()
        # one finished point at a time: resumable; never appended through a planted link
        with open_log(csv_path, append=True) as f:
            w = csv.DictWriter(f, fieldnames=[*keys, *RESULT_COLUMNS])
            if new:
                w.writeheader()
            w.writerow(row)
        done[tuple(point.values())] = {k: str(v) for k, v in row.items()}
        if row["error"]:
            echo(f"recscale: point {point} failed: {row['error']}")
    bar.close()
    rows = [done[tuple(p.values())] for p in points]
    for name in plot(rows, varies, out):
        echo(f"wrote {out / name}")
    echo(f"wrote {csv_path} ({counted(len(rows), 'point')})")
    return rows


def _save(fig, path: Path) -> None:
    """A figure's PNG, renamed into place: never written through a link planted at its
    name (savefig(path) had overwritten the file a ``stages.png`` link pointed to)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    write_bytes_atomic(path, buf.getvalue())


def plot(rows: list[dict[str, Any]], varies: list[tuple[str, list[str]]], out: Path) -> list[str]:
    """Throughput vs each knob, stage breakdown bars, and a heatmap of the first two knobs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "recscale: matplotlib is not installed: results.csv only "
            "(pip install 'recscale[bench]' for the plots)",
            file=sys.stderr,
        )
        return []
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        return []
    keys = [k for k, _ in varies]
    label = lambda r: ", ".join(f"{k.split('.')[-1]}={r[k]}" for k in keys)  # noqa: E731
    written = []
    for knob, values in varies:
        fig, ax = plt.subplots(figsize=(6, 4))
        others = [k for k in keys if k != knob]
        series: dict[tuple, list] = {}
        for r in ok:
            series.setdefault(tuple(r[k] for k in others), []).append(r)
        for rest, rs in list(series.items())[:12]:
            rs = sorted(rs, key=lambda r: values.index(r[knob]))
            ax.plot(
                [r[knob] for r in rs],
                [float(r["samples_per_s"]) for r in rs],
                marker="o",
                label=", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(others, rest)) or None,
            )
        ax.set_xlabel(knob)
        ax.set_ylabel("samples/s")
        ax.set_title(f"throughput vs {knob}")
        if others:
            ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"throughput_vs_{knob.replace('.', '_')}.png"
        _save(fig, out / name)
        plt.close(fig)
        written.append(name)
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(ok)), 4))
    bottom = [0.0] * len(ok)
    # the step's own stages: "data" is made by the loader thread beside the step, so it
    # is not part of the step's time and is left out of the stack
    for s in (c for c in STAGE_COLUMNS if c != "data"):
        v = [float(r[f"{s}_ms"] or 0) for r in ok]
        ax.bar(range(len(ok)), v, bottom=bottom, label=s)
        bottom = [a + b for a, b in zip(bottom, v)]
    ax.set_xticks(range(len(ok)), [label(r) for r in ok], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title("a step's stages (batches come from the loader thread)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    _save(fig, out / "stages.png")
    plt.close(fig)
    written.append("stages.png")
    if len(varies) >= 2:
        (k1, v1), (k2, v2) = varies[0], varies[1]
        cell: dict[tuple[str, str], list[float]] = {}
        for r in ok:
            cell.setdefault((r[k1], r[k2]), []).append(float(r["samples_per_s"]))
        grid_ = [
            [sum(cell.get((a, b), [0])) / max(1, len(cell.get((a, b), []))) for b in v2] for a in v1
        ]
        fig, ax = plt.subplots(figsize=(6, 5))
        im = ax.imshow(grid_, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(v2)), v2)
        ax.set_yticks(range(len(v1)), v1)
        ax.set_xlabel(k2)
        ax.set_ylabel(k1)
        for i, row in enumerate(grid_):
            for j, val in enumerate(row):
                ax.text(j, i, f"{val:,.0f}", ha="center", va="center", color="w", fontsize=7)
        fig.colorbar(im, label="samples/s")
        fig.tight_layout()
        _save(fig, out / "heatmap.png")
        plt.close(fig)
        written.append("heatmap.png")
    return written
