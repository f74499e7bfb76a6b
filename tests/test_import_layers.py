"""Imports point one way: the layer order in docs/architecture.md ("## Layers") against
every import of every module under src/recscale, function-level imports included.

A unit is a subpackage (``recscale/embedding/``) or a top-level module
(``recscale/kernels.py``); the block lists them top floor first, several on a line when
they share a floor (and then they may not import each other either).
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = "recscale"


def read_layers(doc: Path) -> dict[str, int]:
    """unit -> floor (0 = the bottom) from the first code block under ``## Layers``."""
    text = doc.read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    floors: dict[str, int] = {}
    for i, line in enumerate(reversed(lines)):
        for m in re.finditer(r"(?:^|\s)([a-z_]+)(?:/|\.py)(?=\s|$)", line.split("  ")[0]):
            assert m.group(1) not in floors, f"{m.group(1)} listed twice"
            floors[m.group(1)] = i
    return floors


def _module_name(src: Path, f: Path) -> str:
    rel = f.relative_to(src).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports(src: Path, f: Path) -> list[tuple[str, int]]:
    """(absolute module imported, line) for every import statement in ``f``, at any depth;
    ``from a import b`` gives ``a.b`` too (b may be a module)."""
    me = _module_name(src, f)
    out = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")
                base = base[: len(base) - node.level + (1 if f.name == "__init__.py" else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == PKG and len(parts) > 1 else None


def units_present(src: Path) -> set[str]:
    root = src / PKG
    found = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in root.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return found


def upward_imports(src: Path, floors: dict[str, int]) -> list[str]:
    """Every import that does not point to a lower floor, as ``file:line: a -> b`` (one
    entry a statement and target unit)."""
    bad: dict[tuple[str, str], str] = {}
    for f in sorted((src / PKG).rglob("*.py")):
        me = _module_name(src, f)
        unit = _unit(me) if "." in me else None
        if me == f"{PKG}.__main__":
            unit = "cli"  # `python -m recscale` is the command line
        for mod, line in _imports(src, f):
            target = _unit(mod)
            if target is None or target == unit or target not in floors:
                continue
            where = f"{f.relative_to(src)}:{line}"
            if unit is None:  # recscale/__init__.py runs before everything: imports nothing
                bad.setdefault((where, target), f"{where}: the package's __init__ imports {mod}")
            elif floors[target] >= floors[unit]:
                bad.setdefault(
                    (where, target),
                    f"{where}: {unit} (floor {floors[unit]}) -> "
                    f"{target} (floor {floors[target]}) via {mod}",
                )
    return list(bad.values())


def module_cycles(src: Path) -> list[list[str]]:
    """Import cycles between modules (any depth of import; a module importing its own
    package's ``__init__`` is not counted)."""
    files = {_module_name(src, f): f for f in (src / PKG).rglob("*.py")}
    edges = {
        me: {
            m for m, _ in _imports(src, f) if m in files and m != me and not me.startswith(m + ".")
        }
        for me, f in files.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in files:
        if v not in index:
            visit(v)
    return cycles


FLOORS = read_layers(ROOT / "docs" / "architecture.md")


def test_every_package_has_a_floor():
    present = units_present(SRC)
    assert not present - set(FLOORS), "packages missing from docs/architecture.md's layers"
    assert not set(FLOORS) - present, "layers name packages that do not exist"


def test_imports_point_down_only():
    assert upward_imports(SRC, FLOORS) == []


def test_no_import_cycle_between_modules():
    assert module_cycles(SRC) == []


def test_a_planted_upward_import_is_caught(tmp_path):
    shutil.copytree(SRC / PKG, tmp_path / PKG, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = tmp_path / PKG / "embedding" / "storage.py"
    target.write_text(
        target.read_text() + "\n\ndef _sneaky():\n    from recscale.train import run\n"
    )
    bad = upward_imports(tmp_path, FLOORS)
    assert len(bad) == 1 and "embedding/storage.py" in bad[0] and "-> train" in bad[0]
    side = tmp_path / PKG / "kernels.py"  # kernels and metrics share a floor
    side.write_text(side.read_text() + "\nfrom recscale import metrics  # noqa\n")
    assert len(upward_imports(tmp_path, FLOORS)) == 2


def test_a_planted_cycle_is_caught(tmp_path):
    shutil.copytree(SRC / PKG, tmp_path / PKG, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    cols = tmp_path / PKG / "data" / "columns.py"
    cols.write_text(cols.read_text() + "\n\ndef _late():\n    from recscale.data import dataset\n")
    (cycle,) = module_cycles(tmp_path)
    assert {"recscale.data.columns", "recscale.data.dataset"} <= set(cycle)
