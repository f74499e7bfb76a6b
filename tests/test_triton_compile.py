"""The Triton kernels compile for real GPUs (sm_90, sm_80) with no GPU present.

The interpreter tests (test_triton_kernels.py) check the kernels' arithmetic; these run
the GPU compiler itself (``recscale.embedding.triton_compile``), in a subprocess because
conftest sets ``TRITON_INTERPRET=1`` for this one: its covering sample (every constexpr
value and specialization of each kernel once) at two dims (one a multiple of 16, one
not: the two code shapes Triton's specialization makes). ``.ci/run`` compiles every
variant, every combination, under Triton 3.6, the version on the GPU images.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from recscale.embedding import kernels

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, check=False
    )


def test_a_sample_of_every_kernel_compiles_for_hopper_and_ampere():
    args = ("--dims", "16", "24", "--sample", "--jobs", "2")
    r = _run("-m", "recscale.embedding.triton_compile", *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("sm_")]
    # 2 dims x (3 lookup + 6 update + 2 piece-sum variants) x 2 archs, a line each
    assert len(lines) == 44
    assert {ln.split()[0] for ln in lines} == {"sm_90", "sm_80"}
    assert all(" ok " in ln and "regs=" in ln and "smem=" in ln for ln in lines)
    assert "44 of 44 variants compiled" in r.stdout


def test_the_sample_takes_every_constexpr_value_and_specialization_once():
    from recscale.embedding import triton_compile as tc

    every = tc.variants((16, 24))
    chosen = tc.sample(every)
    assert len(every) == 60 and len(chosen) == 22 and all(v in every for v in chosen)

    def values(vs, kernel, dim):
        return {
            (k, str(x))
            for v in vs
            if (v.kernel, v.dim) == (kernel, dim)
            for k, x in [*v.constexprs.items(), *((n, "div16") for n in v.divisible)]
        }

    for kernel in ("pooled_lookup", "fused_update", "piece_sum"):
        for dim in (16, 24):
            assert values(chosen, kernel, dim) == values(every, kernel, dim)
    opts = {v.constexprs["OPT"] for v in chosen if v.kernel == "fused_update"}
    assert opts == set(tc.OPTIMIZERS.values())


def test_a_variant_the_compiler_rejects_is_reported_not_passed():
    # BLOCK_D must be a power of two: tl.arange(0, 12) is rejected by the compiler
    script = textwrap.dedent("""
        from dataclasses import replace
        from recscale.embedding import triton_compile as tc
        v = next(v for v in tc.variants((12,)) if v.kernel == "pooled_lookup")
        bad = replace(v, constexprs={**v.constexprs, "BLOCK_D": 12})
        r = tc.compile_variant(bad, 90)
        print("ok" if r.ok else "FAILED:" + r.error)
    """)
    r = _run("-c", script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("FAILED:") and len(r.stdout.strip()) > len("FAILED:")
