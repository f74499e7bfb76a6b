"""Compile every Triton kernel variant that training can launch, for real GPU targets,
on a machine without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) checks their
arithmetic, not their compilation: a kernel that the GPU compiler rejects passes the
interpreter and fails on the first GPU. This check runs the compiler itself
(``triton.compile`` on an ``ASTSource`` for a ``GPUTarget``: Python AST -> TTIR ->
TTGIR -> LLVM -> PTX -> cubin, with the ptxas that ships inside Triton), so it needs
no driver.

A variant is what makes Triton compile a kernel anew:

    constexprs     HAS_PSW, OPT, HAS_DIRTY, BLOCK_*    (each one the wrappers can pass)
    dtypes         fp32 weights/state, int64 rows/offsets/bags; the pointer passed in
                   place of an absent optional tensor (``rows``: *i64, ``dirty``: *u8)
    specialization Triton marks an int argument divisible by 16 (and a pointer 16-byte
                   aligned) when it is; a dim D that is a multiple of 16 therefore
                   compiles differently (vectorized loads) from one that is not, and
                   the count of bags may be either (the backward's counts are marked
                   ``do_not_specialize``)

``python -m recscale.embedding.triton_compile`` prints one line a variant (registers
from ``ptxas -v``, shared memory from Triton's metadata) and exits 1 on any failure.
``tests/test_triton_compile.py`` runs it under the installed Triton; ``.ci/run`` runs
it again under Triton 3.6, the version beside torch 2.11 on the GPU images.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from recscale.embedding import triton_kernels as tk
from recscale.embedding.optimizers import ADAM_KIND, ROWWISE_ADAGRAD_KIND, SGD_KIND

# Embedding dims the checks cover: every power of two 4-256 (BLOCK_D) and dims that are
# not multiples of 16 (masked columns, no 16-divisibility of D).
DIMS = (4, 8, 16, 24, 32, 64, 128, 256)
ARCHS = (90, 80)
OPTIMIZERS = {"sgd": SGD_KIND, "rowwise_adagrad": ROWWISE_ADAGRAD_KIND, "adam": ADAM_KIND}

_LOOKUP_SIG = {
    "weight_ptr": "*fp32",
    "rows_ptr": "*i64",
    "offsets_ptr": "*i64",
    "psw_ptr": "*fp32",
    "out_ptr": "*fp32",
    "num_bags": "i32",
    "D": "i32",
    "num_rows": "i32",
}
_UPDATE_SIG = {
    "weight_ptr": "*fp32",
    "s1_ptr": "*fp32",
    "s2_ptr": "*fp32",
    "unique_ptr": "*i64",
    "seg_ptr": "*i64",
    "order_ptr": "*i64",
    "bag_ptr": "*i64",
    "psw_ptr": "*fp32",
    "grad_ptr": "*fp32",
    "dirty_ptr": "*u8",
    "partial_ptr": "*fp32",
    "U": "i32",
    "D": "i32",
    "lr": "fp32",
    "eps": "fp32",
    "b1": "fp32",
    "b2": "fp32",
    "step_size": "fp32",
}
_PIECE_SIG = {
    "seg_ptr": "*i64",
    "inverse_ptr": "*i64",
    "order_ptr": "*i64",
    "bag_ptr": "*i64",
    "psw_ptr": "*fp32",
    "grad_ptr": "*fp32",
    "partial_ptr": "*fp32",
    "N": "i32",
    "D": "i32",
}


@dataclass(frozen=True)
class Variant:
    """One compilation of one kernel: its name, the launch's constexprs and signature, and
    which int arguments Triton's specialization marks divisible by 16."""

    kernel: str
    dim: int
    constexprs: dict
    signature: dict
    divisible: tuple[str, ...]

    @property
    def label(self) -> str:
        flags = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel:<14} D={self.dim:<4} {flags} div16={','.join(self.divisible)}"


@dataclass(frozen=True)
class Compiled:
    variant: Variant
    arch: int
    ok: bool
    registers: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    seconds: float = 0.0
    error: str = ""


def variants(dims=DIMS) -> list[Variant]:
    """Every (kernel, constexprs, divisibility) that ``pooled_lookup`` / ``fused_update``
    (with its ``piece_sum``) can launch for the given embedding dims."""
    out: list[Variant] = []
    for dim in dims:
        block_b, block_d = tk._blocks(dim)
        d16 = ("D",) if dim % 16 == 0 else ()
        for has_psw, count16 in itertools.product((False, True), (False, True)):
            sig = dict(_LOOKUP_SIG)
            if not has_psw:  # the wrapper passes ``rows`` in the absent tensor's place
                sig["psw_ptr"] = "*i64"
            ce = {"HAS_PSW": has_psw, "BLOCK_B": block_b, "BLOCK_D": block_d}
            div = (("num_bags",) if count16 else ()) + d16
            out.append(Variant("pooled_lookup", dim, ce, sig, div))
        block_u, block_d = tk._blocks(dim)
        for opt, has_psw, has_dirty, heavy in itertools.product(
            OPTIMIZERS.values(), (False, True), (False, True), (False, True)
        ):
            sig = dict(_UPDATE_SIG)
            if not has_psw:
                sig["psw_ptr"] = "*i64"
            if not has_dirty:
                sig["dirty_ptr"] = "*i64"
            if opt == SGD_KIND:  # no state: the wrapper passes the weight twice
                sig["s1_ptr"] = sig["s2_ptr"] = "*fp32"
            ce = {
                "OPT": opt,
                "HAS_PSW": has_psw,
                "HAS_DIRTY": has_dirty,
                "HEAVY": heavy,
                "BLOCK_U": block_u,
                "BLOCK_D": block_d,
                "LIGHT": tk.LIGHT,
                "W": tk.W,
            }
            out.append(Variant("fused_update", dim, ce, sig, d16))  # counts not specialized
        for has_psw in (False, True):
            sig = dict(_PIECE_SIG)
            if not has_psw:
                sig["psw_ptr"] = "*i64"
            ce = {"HAS_PSW": has_psw, "LIGHT": tk.LIGHT, "W": tk.W, "SUB": tk._sub(block_d)}
            out.append(Variant("piece_sum", dim, {**ce, "BLOCK_D": block_d}, sig, d16))
    return out


def sample(every: list[Variant]) -> list[Variant]:
    """A covering sample of ``every``: per kernel and dim, the variants (in order) that
    each add a constexpr value or an argument's 16-divisibility not yet taken - every
    branch a constexpr selects compiled once, not in every combination (the 30 variants
    of a dim become 11)."""
    out: list[Variant] = []
    seen: dict[tuple[str, int], set] = {}
    for v in every:
        taken = seen.setdefault((v.kernel, v.dim), set())
        new = {*v.constexprs.items(), *((n, True) for n in v.divisible)} - taken
        if new or not taken:
            out.append(v)
            taken |= new
    return out


def _attrs(v: Variant) -> dict:
    """Triton's specialization attributes: every pointer 16-byte aligned (torch's
    allocations are), the named int arguments divisible by 16."""
    names = list(v.signature)
    aligned = [i for i, n in enumerate(names) if v.signature[n].startswith("*")]
    aligned += [names.index(n) for n in v.divisible]
    return {(i,): [["tt.divisibility", 16]] for i in sorted(aligned)}


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill stores) of the PTX's kernel from the ptxas inside Triton."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory(prefix="recscale-ptxas-") as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run(
            [ptxas, "-v", f"--gpu-name={sm}", str(src), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None)


def compile_variant(v: Variant, arch: int) -> Compiled:
    fn = {
        "pooled_lookup": tk._pooled_lookup_kernel,
        "fused_update": tk._fused_update_kernel,
        "piece_sum": tk._piece_sum_kernel,
    }[v.kernel]
    sig = {**v.signature, **dict.fromkeys(v.constexprs, "constexpr")}
    t = time.perf_counter()
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(v.constexprs), attrs=_attrs(v))
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    except Exception as e:  # noqa: BLE001 - any compiler failure is the result
        first = next((ln for ln in str(e).splitlines() if "error" in ln), str(e).splitlines()[0])
        return Compiled(v, arch, False, seconds=time.perf_counter() - t, error=first[:300])
    regs, spills = _ptxas_usage(k.asm["ptx"], arch)
    return Compiled(v, arch, True, regs, spills, int(k.metadata.shared), time.perf_counter() - t)


def _compile_job(job: tuple[Variant, int]) -> Compiled:
    return compile_variant(*job)


def compile_all(
    archs=ARCHS, dims=DIMS, echo=print, jobs: int | None = None, only_sample: bool = False
) -> list[Compiled]:
    """Compile every variant (or the :func:`sample`) for every arch on ``jobs`` processes
    (default: the cores)."""
    chosen = sample(variants(dims)) if only_sample else variants(dims)
    todo = [(v, arch) for arch in archs for v in chosen]
    jobs = jobs or os.cpu_count() or 1
    results = []
    with (
        ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"))
        if jobs > 1
        else nullcontext() as pool
    ):
        done = pool.map(_compile_job, todo, chunksize=8) if pool else map(_compile_job, todo)
        for r in done:
            v, arch = r.variant, r.arch
            results.append(r)
            if r.ok:
                echo(
                    f"sm_{arch} ok   {v.label}  regs={r.registers} spill={r.spills} "
                    f"smem={r.shared_bytes}B  {r.seconds:.2f}s"
                )
            else:
                echo(f"sm_{arch} FAIL {v.label}  {r.error}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m recscale.embedding.triton_compile",
        description="Compile every Triton kernel variant for GPU targets (no GPU needed).",
    )
    p.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90")
    p.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    p.add_argument("--jobs", type=int, default=0, help="processes (default: the cores)")
    p.add_argument(
        "--sample",
        action="store_true",
        help="each constexpr value and specialization once per kernel and dim, not every "
        "combination",
    )
    args = p.parse_args(argv)
    archs, dims = tuple(args.arch or ARCHS), tuple(args.dims)
    results = compile_all(archs, dims, jobs=args.jobs or None, only_sample=args.sample)
    bad = [r for r in results if not r.ok]
    print(
        f"triton {triton.__version__}: {len(results) - len(bad)} of {len(results)} "
        f"variants compiled for {', '.join(f'sm_{a}' for a in archs)}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
