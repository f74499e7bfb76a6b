"""The native library's one header (``native/recscale_native.h``) against the C files'
definitions, the loaded library and the ctypes bindings made from it."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from recscale import native

NATIVE = Path(native.__file__).parent
_DEF = re.compile(  # an optional attribute macro (RS_AVX2) or __attribute__ first
    r"^(?:[A-Z][A-Z0-9_]*\s+|__attribute__\(\(.*?\)\)\s*)?(int64_t|int|void)\s+(recscale_\w+)\s*\(([^)]*)\)\s*\{",
    re.M,
)
_DECL = re.compile(
    r"^(?:__attribute__\(\(.*?\)\)\s*)?(int64_t|int|void)\s+(recscale_\w+)\s*\(([^)]*)\)\s*;",
    re.M,
)


def _types(params: str) -> tuple[str, ...]:
    """``const float *dense, int64_t b0`` -> ``("const float*", "int64_t")``."""
    if params.strip() == "void":
        return ()
    out = []
    for p in params.split(","):
        p = " ".join(p.split())
        p = re.sub(r"\s*\b\w+$", "", p) if len(p.replace("*", " ").split()) > 1 else p
        out.append(p.replace(" *", "*").replace("* ", "*"))
    return tuple(out)


def definitions(text: str) -> list[tuple[str, tuple[str, tuple[str, ...]]]]:
    """Every definition (a function may have one per ``#if`` branch)."""
    return [(name, (ret, _types(params))) for ret, name, params in _DEF.findall(text)]


def declarations(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {name: (ret, _types(params)) for ret, name, params in _DECL.findall(text)}


def mismatches(header: str, sources: dict[str, str]) -> list[str]:
    """Each exported definition missing from the header or declared there otherwise."""
    declared = declarations(header)
    bad = []
    for fname, text in sources.items():
        for name, sig in definitions(text):
            if name not in declared:
                bad.append(f"{fname}: {name} is not declared in recscale_native.h")
            elif declared[name] != sig:
                bad.append(f"{fname}: {name} is {sig}, the header says {declared[name]}")
    return bad


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(NATIVE.glob("*.c"))}


def test_every_definition_is_declared_once_in_the_header():
    header = (NATIVE / "recscale_native.h").read_text()
    sources = _sources()
    assert mismatches(header, sources) == []
    for name, text in sources.items():  # each file sees the header, none repeats it
        assert '#include "recscale_native.h"' in text, name
        assert not declarations(text), f"{name} declares {sorted(declarations(text))}"
    defined = {name for t in sources.values() for name, _ in definitions(t)}
    assert set(declarations(header)) <= defined, "the header declares what no file defines"


def test_a_changed_signature_is_caught():
    header = (NATIVE / "recscale_native.h").read_text()
    sources = _sources()
    src = sources["logit.c"]
    sources["logit.c"] = src.replace("int64_t batch, int64_t n)", "int batch, int64_t n)", 1)
    sources["extra.c"] = "int recscale_new_kernel(const float *x) {\n    return 0;\n}\n"
    bad = mismatches(header, sources)
    assert any("recscale_logit_forward" in b for b in bad)
    assert any("recscale_new_kernel is not declared" in b for b in bad)


def test_bindings_are_the_headers_python_block():
    sigs = native.header_signatures()
    header = declarations((NATIVE / "recscale_native.h").read_text())
    assert {"recscale_pooled_lookup", "recscale_team_run", "recscale_cpu_features"} <= set(sigs)
    for name, (restype, argtypes) in sigs.items():
        ret, params = header[name]
        assert len(argtypes) == len(params), name
        for c, t in zip(params, argtypes):
            want = (
                (ctypes.c_char_p if "char" in c else ctypes.c_void_p)
                if "*" in c
                else {
                    "int64_t": ctypes.c_int64,
                    "int": ctypes.c_int,
                    "float": ctypes.c_float,
                    "double": ctypes.c_double,
                }[c.replace("const ", "")]
            )
            assert t is want, (name, c, t)
        assert restype is {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "void": None}[ret]
    with pytest.raises(ValueError, match="no ctypes type"):
        native.header_signatures("/* @python-begin */\nint recscale_x(long y);\n/* @python-end */")


def test_the_loaded_library_matches_the_header():
    lib = native.library()
    if lib is None:
        pytest.skip(f"native library: {native.status()}")
    assert lib.recscale_native_abi() == native.header_abi()
    for name, (restype, argtypes) in native.header_signatures().items():
        fn = getattr(lib, name)  # exported
        assert fn.restype is restype and list(fn.argtypes) == argtypes, name
    team = (NATIVE / "team.c").read_text()
    for kernel in re.findall(r'\] = "(recscale_\w+)"', team):
        assert kernel in native.header_signatures(), kernel
    assert native.cpu_features() & native.CPU_AVX2
