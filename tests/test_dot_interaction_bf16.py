"""The native dot interaction's bf16 edges (``native/dot_interaction_bf16.c``): its row
written in bf16 is the fp32 kernel's row rounded as torch casts it, and its backward
from a bf16 gradient gives the fp32 kernel's gradients for that gradient widened - bit
for bit, on every kernel path, over blocks of samples and threads. Skips on a CPU
without AVX512-BF16 (where the bf16 step keeps an fp32 row)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from recscale import native
from recscale.modules import dot_interaction_cpu
from recscale.modules.dot_interaction_cpu import NativeDotInteraction
from recscale.modules.interaction import DotInteraction

BF16 = torch.bfloat16


def _needs_bf16_edges() -> None:
    if not dot_interaction_cpu.bf16_edges_available():
        pytest.skip(f"no AVX512-BF16 here: {native.status()}")


def _run(dense0, emb0, num_f, dim, self_interaction, out_dim, bf16, upstream):
    dense = dense0.clone().requires_grad_(True) if dense0 is not None else None
    emb = emb0.clone().requires_grad_(True)
    out = NativeDotInteraction.apply(dense, emb, num_f, dim, self_interaction, out_dim, bf16)
    out.backward(upstream if bf16 else upstream.float())
    return out.detach(), emb.grad, dense.grad if dense is not None else None


_DIMS = [(16, 26), (8, 3), (80, 6), (128, 4)]  # config A's; short; a 64 + 16 block; B's D


@pytest.mark.parametrize(
    "dim,num_f,wide_interaction",
    [(d, f, "avx2") for d, f in _DIMS]
    + [(d, f, kind) for d, f in _DIMS if d >= 64 for kind in ("wide", "wide-streamed", "tiles")],
    indirect=["wide_interaction"],
)
@pytest.mark.parametrize("has_dense", [True, False])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_row_and_gradient_are_the_fp32_kernels_bit_for_bit(
    dim, num_f, has_dense, self_interaction, threads, wide_interaction
):
    _needs_bf16_edges()
    b = 77  # blocks of 32 samples: two whole and a short one (per thread too)
    gen = torch.Generator().manual_seed(dim * num_f + has_dense)
    dense = torch.randn(b, dim, generator=gen) if has_dense else None
    emb = torch.randn(b, num_f * dim, generator=gen)
    emb[3, :dim] = float("nan")  # a NaN row: the bf16 row holds torch's NaN
    inter = DotInteraction(num_f, dim, has_dense, self_interaction)
    upstream = torch.randn(b, inter.out_dim, generator=gen).to(BF16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args = (num_f, dim, self_interaction, inter.out_dim)
        out32, emb32, dense32 = _run(dense, emb, *args, False, upstream)
        out16, emb16, dense16 = _run(dense, emb, *args, True, upstream)
    finally:
        torch.set_num_threads(before)
    assert out16.dtype == BF16 and out16.shape == out32.shape
    want = out32.to(BF16)
    nan = torch.isnan(want)  # torch's NaN bits differ by path: NaN for NaN
    assert nan.any() and torch.equal(torch.isnan(out16), nan)
    assert torch.equal(out16[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert emb16.dtype == torch.float32
    assert torch.equal(emb16.view(torch.int32), emb32.view(torch.int32))
    if has_dense:
        assert torch.equal(dense16.view(torch.int32), dense32.view(torch.int32))


def test_part_sized_streaming_holds_when_the_part_runs_in_blocks():
    """The backward streams its stores by the size of the caller's part, not of the
    block of 32 samples it hands the fp32 kernel: with a threshold between the two the
    results stay the fp32 kernel's."""
    _needs_bf16_edges()
    if not native.has_avx512():
        pytest.skip(f"AVX-512 interaction kernels: {native.status()}")
    lib = native.library()
    stream = ctypes.c_int64.in_dll(lib, "recscale_dot_stream_bytes")
    saved = stream.value
    b, num_f, dim = 200, 4, 128
    stream.value = 64 * (num_f + 1) * dim * 4  # more than a block's rows, less than a part's
    try:
        gen = torch.Generator().manual_seed(0)
        dense, emb = torch.randn(b, dim, generator=gen), torch.randn(b, num_f * dim, generator=gen)
        out_dim = DotInteraction(num_f, dim, True).out_dim
        upstream = torch.randn(b, out_dim, generator=gen).to(BF16)
        args = (num_f, dim, False, out_dim)
        want = _run(dense, emb, *args, False, upstream)
        got = _run(dense, emb, *args, True, upstream)
    finally:
        stream.value = saved
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_the_interaction_writes_bf16_under_cpu_autocast(monkeypatch):
    """Under CPU bf16 autocast the native interaction hands the top MLP a bf16 row (where
    the CPU has AVX512-BF16), or an fp32 one with the switch off; either way its
    gradients reach the embeddings and the bottom MLP's output in their own dtypes."""
    _needs_bf16_edges()
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(40, 16, generator=gen).to(BF16).requires_grad_(True)
    emb = torch.randn(40, 26 * 16, generator=gen).requires_grad_(True)
    inter = DotInteraction(26, 16, True)
    for on, dtype in ((True, BF16), (False, torch.float32)):
        monkeypatch.setattr(dot_interaction_cpu, "USE_BF16_EDGES", on)
        with torch.autocast("cpu", dtype=BF16):
            out = inter(dense, emb)
        assert out.dtype == dtype
        out.float().sum().backward()
        assert dense.grad.dtype == BF16 and emb.grad.dtype == torch.float32
        dense.grad = emb.grad = None


@pytest.fixture
def avx512_interaction():
    """The AVX-512 (and narrow) kernels for bf16 T, not the AMX tiles, whose sums run in
    another order (tests/test_dot_interaction_amx.py checks those)."""
    flag = ctypes.c_int.in_dll(native.library(), "recscale_dot_amx")
    saved, flag.value = flag.value, 0
    yield
    flag.value = saved


def _needs_bf16_pooled(dim: int, rows: int) -> None:
    _needs_bf16_edges()
    if not dot_interaction_cpu.bf16_pooled_available(dim, rows):
        pytest.skip(f"bf16 pooled vectors of dim {dim} are not read here: {native.status()}")


# the tiles (d >= 64) and the narrow kernels (d = 16, 32; 31 features + the dense row: 32)
@pytest.mark.parametrize(
    "dim,num_f", [(128, 4), (64, 26), (96, 3), (16, 26), (32, 5), (16, 31), (16, 2)]
)
@pytest.mark.parametrize("has_dense", [True, False])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("feature_major", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_pooled_vectors_are_the_fp32_kernels_on_them_widened(
    dim, num_f, has_dense, self_interaction, feature_major, threads, avx512_interaction
):
    """T in bf16 (the lookup's bf16 sums, the bf16 bottom MLP's row): the row is the fp32
    kernel's on T widened, rounded as torch casts it; T's gradients are the fp32
    kernel's rounded to bf16 - bit for bit, in T's own layout (a feature-major view too),
    over blocks of samples and threads."""
    _needs_bf16_pooled(dim, num_f + has_dense)
    b = 77
    gen = torch.Generator().manual_seed(dim + num_f + has_dense)
    dense = torch.randn(b, dim, generator=gen).to(BF16) if has_dense else None
    emb = torch.randn(num_f, b, dim, generator=gen).to(BF16).transpose(0, 1)
    emb = emb if feature_major else emb.contiguous()  # [B, F, D], either layout
    emb[3, 0] = float("nan")
    inter = DotInteraction(num_f, dim, has_dense, self_interaction)
    upstream = torch.randn(b, inter.out_dim, generator=gen).to(BF16)
    args = (num_f, dim, self_interaction, inter.out_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide = (dense.float() if has_dense else None, emb.float().reshape(b, num_f * dim))
        out32, emb32, dense32 = _run(*wide, *args, True, upstream)
        out16, emb16, dense16 = _run(dense, emb, *args, True, upstream)
    finally:
        torch.set_num_threads(before)
    assert out16.dtype == BF16 and emb16.dtype == BF16
    assert emb16.shape == emb.shape and emb16.stride() == emb.stride()
    nan = torch.isnan(out32)
    assert nan.any() and torch.equal(torch.isnan(out16), nan)
    assert torch.equal(out16[~nan].view(torch.int16), out32[~nan].view(torch.int16))
    want = emb32.view(b, num_f, dim).to(BF16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(emb16), nan)
    assert torch.equal(emb16[~nan].view(torch.int16), want[~nan].view(torch.int16))
    if has_dense:
        want = dense32.to(BF16)
        nan = torch.isnan(want)
        assert dense16.dtype == BF16 and torch.equal(torch.isnan(dense16), nan)
        assert torch.equal(dense16[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_the_interaction_takes_bf16_pooled_vectors_under_cpu_autocast(
    monkeypatch, avx512_interaction
):
    """Under CPU bf16 autocast the interaction says it reads bf16 pooled vectors (B's D =
    128, A's 16), reads them so and gives them a bf16 gradient; with the switch off, or
    for a shape no kernel reads so (D = 48; D = 16 with 40 vectors), it says no, and bf16
    vectors handed to it anyway are widened (fp32 kernel, fp32 gradient after autograd's
    cast back)."""
    _needs_bf16_pooled(128, 7)
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(40, 128, generator=gen).to(BF16).requires_grad_(True)
    emb = torch.randn(40, 6, 128, generator=gen).to(BF16).requires_grad_(True)
    inter = DotInteraction(6, 128, True)
    assert not inter.takes_bf16_pooled(torch.device("cpu"))  # no autocast
    with torch.autocast("cpu", dtype=BF16):
        assert inter.takes_bf16_pooled(torch.device("cpu"))
        assert DotInteraction(26, 16, True).takes_bf16_pooled(torch.device("cpu"))
        assert not DotInteraction(6, 48, True).takes_bf16_pooled(torch.device("cpu"))
        assert not DotInteraction(40, 16, True).takes_bf16_pooled(torch.device("cpu"))
        out = inter(dense, emb)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert emb.grad.dtype == BF16 and dense.grad.dtype == BF16
    want = emb.grad.clone()
    emb.grad = dense.grad = None
    monkeypatch.setattr(dot_interaction_cpu, "USE_BF16_POOLED", False)
    with torch.autocast("cpu", dtype=BF16):
        assert not inter.takes_bf16_pooled(torch.device("cpu"))
        out = inter(dense, emb)
    out.float().sum().backward()
    assert emb.grad.dtype == BF16  # autograd casts the fp32 kernel's gradient back
    assert torch.equal(emb.grad, want)  # the same sums, rounded once either way


def test_a_bf16_run_pools_in_bf16_and_learns_as_with_fp32_pools(monkeypatch):
    """A bf16 run whose interaction reads bf16 pooled vectors (dim 64) has the lookup
    write them so every step, and reaches the AUC of the same run with fp32 pooled
    vectors (the sums and their gradient rounded as autocast's bmm would round them)."""
    _needs_bf16_pooled(64, 27)
    from recscale.config import load_config
    from recscale.modules import embedding_bag_collection as ebc_mod
    from recscale.train.run import train

    seen: list[bool] = []
    real = ebc_mod.native_pooled_lookup

    def spy(*args, **kw):
        seen.append(bool(args[7] if len(args) > 7 else kw.get("bf16_out", False)))
        return real(*args, **kw)

    monkeypatch.setattr(ebc_mod, "native_pooled_lookup", spy)
    over = [
        "--train.progress=false",
        "--train.precision=bf16",
        "--model.embedding_dim=64",
        "--model.bottom_mlp=[32,64]",
        "--train.steps=150",
    ]
    quiet = {"echo": lambda *_: None}
    with_bf16 = train(load_config("debug", over), None, **quiet)
    trained = list(seen)
    seen.clear()
    monkeypatch.setattr(dot_interaction_cpu, "USE_BF16_POOLED", False)
    with_fp32 = train(load_config("debug", over), None, **quiet)
    assert trained.count(True) >= 150 and not any(seen)
    assert abs(with_bf16["auc"] - with_fp32["auc"]) <= 0.005, (with_bf16["auc"], with_fp32["auc"])


def test_rows_of_mixed_dtypes_are_refused_not_read_past_their_end():
    """The kernels read both row sets at one width: a bf16 dense row beside fp32
    embeddings (or fp16 rows) is a clear error, never a read of half-sized rows as fp32."""
    if native.library() is None:
        pytest.skip(native.status())
    dense = torch.randn(8, 16).to(BF16)
    emb = torch.randn(8, 3 * 16)
    with pytest.raises(ValueError, match="one dtype"):
        NativeDotInteraction.apply(dense, emb, 3, 16, False, 24, False)
    with pytest.raises(ValueError, match="one dtype"):
        NativeDotInteraction.apply(None, emb.half(), 3, 16, False, 8, False)
    with pytest.raises(ValueError, match="bf16 output"):
        NativeDotInteraction.apply(dense, emb.to(BF16), 3, 16, False, 24, False)
