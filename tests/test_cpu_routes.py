"""Which CPU path runs, chosen by the host: the fp32 GEMM route by CPU vendor and
product size (``modules/gemm.py``), and subnormals flushed on every thread of torch's
OpenMP team (``native/team.c``)."""

from __future__ import annotations

import platform

import pytest
import torch

from recscale import native

needs_native = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels: {native.status()}"
)


@needs_native
def test_subnormals_are_flushed_on_every_thread_of_the_team():
    """``flush_denormals`` sets FTZ/DAZ on the OpenMP team's workers too: torch's own
    ``set_flush_denormal`` reaches the calling thread only, and a worker made by an
    earlier parallel region went on computing with subnormals (at 10-100x the cost of a
    normal operand: DCNv2's step 55 -> 500 ms). An elementwise op over 2 threads shows
    each thread's setting in its half of the result."""
    from recscale.native import team

    if platform.machine() not in ("x86_64", "AMD64") or not team.team_available(native.library()):
        pytest.skip("FTZ/DAZ on the team: x86 with torch's libgomp")
    lib = native.library()
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    # a subnormal fp32 (~1e-39) from its bits: a float fill would flush it where FTZ is on
    x = torch.full((1 << 20,), 0x000AE398, dtype=torch.int32).view(torch.float32)
    try:
        x.mul(1.0)  # the team exists: its worker was made by this region
        torch.set_flush_denormal(False)
        assert lib.recscale_team_flush_denormal(0, 2) == 0
        assert bool((x.mul(1.0) != 0).all())  # subnormals kept on both threads
        torch.set_flush_denormal(True)  # torch's switch: the calling thread only
        kept = x.mul(1.0) != 0
        assert bool(kept.any()) and not bool(kept.all())
        assert team.flush_denormals(lib) == "on"
        assert bool((x.mul(1.0) == 0).all())
    finally:
        team.flush_denormals(lib)
        torch.set_num_threads(saved)


@pytest.mark.parametrize("mkl_first", [True, False])
def test_linear_routes_by_vendor_and_size_and_both_routes_equal_torch(mkl_first, monkeypatch):
    """``gemm.linear``: MKL for every product where ``MKL_FIRST``; elsewhere
    oneDNN from ``ONEDNN_MIN_MACS`` multiply-adds and MKL below, where oneDNN's cost a call
    outweighs its gain. Every route equals torch's product."""
    from recscale.modules import gemm

    if gemm.ONEDNN_LINEAR is None:
        pytest.skip("torch built without oneDNN")
    calls = []
    real = gemm.ONEDNN_LINEAR
    monkeypatch.setattr(gemm, "ONEDNN_LINEAR", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(gemm, "MKL_FIRST", mkl_first)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    at_least = gemm.ONEDNN_MIN_MACS // (64 * 32)  # rows from which oneDNN runs
    for rows in (at_least - 1, at_least):
        x = torch.randn(rows, 64, generator=gen)
        want = torch.relu(x.double() @ w.double().t() + b.double()).float()
        torch.testing.assert_close(gemm.linear(x, w, b, relu=True), want, rtol=1e-5, atol=1e-5)
    assert calls == ([] if mkl_first else [at_least])


def test_mkl_runs_first_on_intel_and_where_no_avx512_and_only_with_mkl():
    """MKL picks its kernels by vendor (AVX2 ones on AMD); without AVX-512 every library
    runs AVX2 and MKL's were the fastest measured; an AMD CPU with AVX-512 takes oneDNN."""
    from recscale.modules.gemm import mkl_runs_first

    avx2, avx512 = "fpu sse2 avx avx2 fma f16c", "fpu sse2 avx avx2 fma avx512f avx512bw"
    assert mkl_runs_first("GenuineIntel", avx512, True)
    assert mkl_runs_first("GenuineIntel", avx2, True)
    assert mkl_runs_first("AuthenticAMD", avx2, True)
    assert not mkl_runs_first("AuthenticAMD", avx512, True)
    assert not mkl_runs_first("GenuineIntel", avx512, False)  # no MKL in this torch
    assert not mkl_runs_first("", "", False)  # ARM: no vendor line, no MKL


def test_the_native_weight_gradient_runs_only_where_mkl_is_not_first(monkeypatch):
    from recscale.modules import gemm

    if native.library() is None:
        pytest.skip(native.status())
    g, x = torch.randn(64, 32), torch.randn(64, 48)
    for mkl_first in (True, False):
        monkeypatch.setattr(gemm, "MKL_FIRST", mkl_first)
        assert gemm._native_wgrad_applies(g, x) is not mkl_first
        dw, db = gemm.weight_grad(g, x, bias_grad=True)
        torch.testing.assert_close(dw.double(), g.double().t() @ x.double(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-5, atol=1e-4)
