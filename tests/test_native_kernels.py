"""The native C kernels (recscale.native) and the fused MLP, against reference paths.

The embedding lookup/update kernels are also covered by test_embedding_lookup.py and
test_sparse_optimizers.py (kernel "native"), and whole training runs by test_model.py.
"""

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import weight_grad_on_two_threads, wgrad_operands

from recscale import native
from recscale.modules import dot_interaction_cpu
from recscale.modules.interaction import DotInteraction
from recscale.modules.mlp import MLP


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2 " in flags and " fma " in flags


needs_native = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels: {native.status()}"
)


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpu_has_avx2(), reason="x86-64 with AVX2 only"
)
@pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), reason="no C compiler"
)
def test_library_is_built_and_loads_on_avx2_machines():
    """Where the kernels can be built and run they must be there: a broken build fails
    here rather than silently falling back (and every other native test skipping)."""
    assert native.library() is not None, native.status()
    assert native.status().startswith("loaded")


def test_env_var_disables_the_library():
    code = "from recscale import native; print(native.library() is None, native.status())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RECSCALE_NATIVE": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("True disabled by RECSCALE_NATIVE=0")


def test_parallel_for_covers_the_range_once_and_raises_worker_errors():
    seen: list[tuple[int, int]] = []
    native.parallel_for(10, lambda lo, hi: seen.append((lo, hi)), 3)
    covered = sorted(i for lo, hi in seen for i in range(lo, hi))
    assert covered == list(range(10)) and len(seen) == 3

    def fail(lo: int, hi: int) -> None:
        if lo > 0:
            raise ValueError("worker failed")

    with pytest.raises(ValueError, match="worker failed"):
        native.parallel_for(8, fail, 2)


def test_split_covers_the_range_with_every_part_non_empty():
    from recscale.native.parallel import split

    for n, parts, share in [(10, 2, 0.5), (10, 3, 0.9), (7, 2, 0.0), (7, 2, 1.0), (100, 4, 0.3)]:
        b = split(n, parts, share)
        assert b[0] == 0 and b[-1] == n and len(b) == parts + 1
        assert all(hi > lo for lo, hi in zip(b, b[1:]))
    assert split(100, 2, 0.3)[1] == 30 and split(100, 4, 0.4)[1:] == [40, 60, 80, 100]


def test_parallel_parts_learns_the_split_that_finishes_together(monkeypatch):
    """A worker whose units take twice as long: the caller's share moves from 1/2 toward
    2/3 (both threads then finish together); with ``adaptive=False`` it stays even."""
    import time

    from recscale.native import parallel

    monkeypatch.setattr(parallel, "_share", {})
    seen: list[list[int]] = []

    def work(part: int, lo: int, hi: int) -> None:
        seen[-1][part] = hi - lo
        time.sleep((hi - lo) * (0.002 if part else 0.001))  # sleeps drop the GIL, like ctypes

    for adaptive in (False, True):
        seen.clear()
        for _ in range(6):
            seen.append([0, 0])
            parallel.parallel_parts(40, work, 2, key="test", adaptive=adaptive)
        if not adaptive:
            assert all(s == [20, 20] for s in seen) and not parallel._share
    assert seen[0] == [20, 20] and 24 <= seen[-1][0] <= 30, seen  # 2/3 of 40 = 26.7


_DIMS = [(8, 3), (16, 26), (32, 5), (128, 4), (16, 1), (64, 26), (80, 6), (48, 3), (128, 1)]
# AVX-512's narrow kernels (d = 16, 32; k <= 32). k with dense features (one less
# without): 2, 17 (a row past the first 16), 27 (config A), 6, 32 (the most), 21, and 33
# and 41 (past 32: the AVX2 kernels; 32 without dense features)
_NARROW = [(16, 1), (16, 16), (16, 26), (32, 5), (16, 31), (32, 20), (16, 32), (32, 40)]


@needs_native
@pytest.mark.parametrize(
    "dim,num_f,wide_interaction",
    [(d, f, "avx2") for d, f in _DIMS]
    + [(d, f, kind) for d, f in _DIMS if d >= 64 for kind in ("wide", "wide-streamed", "tiles")]
    + [(d, f, "wide") for d, f in _NARROW],
    indirect=["wide_interaction"],
)  # 80: a 64-float block and a 16-float one; 48: below the tiles (d >= 64); 128 x 1 with
# dense features: k = 2, one tile mostly past k
@pytest.mark.parametrize("has_dense", [True, False])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("layout", ["flat", "feature_major"])
def test_native_dot_interaction_matches_torch(
    dim, num_f, has_dense, self_interaction, layout, wide_interaction
):
    b = 19  # not a multiple of the thread split
    g = torch.Generator().manual_seed(dim + num_f)
    dense0 = torch.randn(b, dim, generator=g)
    fbd = torch.randn(num_f, b, dim, generator=g)
    results = {}
    for kernel in ("native", "torch"):
        dense = dense0.clone().requires_grad_(True) if has_dense else None
        base = fbd.clone().requires_grad_(True)
        # flat: [B, F*D] contiguous; feature_major: the [B, F, D] view the lookup returns
        emb = (
            base.transpose(0, 1)
            if layout == "feature_major"
            else base.transpose(0, 1).reshape(b, -1)
        )
        inter = DotInteraction(num_f, dim, has_dense, self_interaction, kernel=kernel)
        assert (inter._fused(emb) is dot_interaction_cpu.NativeDotInteraction) == (
            kernel == "native"
        )
        out = inter(dense, emb)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * upstream).sum().backward()
        results[kernel] = (out.detach(), base.grad, dense.grad if has_dense else None)
    for got, ref in zip(results["native"], results["torch"]):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_training_step_takes_every_native_path(monkeypatch):
    """dim 16, sum pooling, fp32 CPU: lookup, interaction and update all run in C."""
    from recscale.config import load_config
    from recscale.embedding import cpu_kernels
    from recscale.models.dlrm import build_model
    from recscale.modules import embedding_bag_collection as ebc_mod
    from recscale.train.data_source import make_synthetic

    calls: dict[str, int] = {}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(
        ebc_mod, "native_pooled_lookup", spy("lookup", ebc_mod.native_pooled_lookup)
    )
    monkeypatch.setattr(cpu_kernels, "_native_update", spy("update", cpu_kernels._native_update))
    cls = dot_interaction_cpu.NativeDotInteraction
    monkeypatch.setattr(cls, "apply", spy("interaction", cls.apply))
    cfg = load_config("debug", ["--model.embedding_dim=16", "--model.bottom_mlp=32,16"])
    model = build_model(cfg.model, cfg.embedding, seed=0)
    batch = make_synthetic(cfg).batch(0, 64)
    torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
    assert calls == {"lookup": 1, "interaction": 1, "update": 1}


def _team_calls(monkeypatch) -> list[int]:
    """Spy on the OpenMP team's entry point: one element per call that ran on it."""
    lib = native.library()
    calls: list[int] = []
    run = lib.recscale_team_run

    def spy(*args):
        calls.append(args[1])  # parts
        return run(*args)

    monkeypatch.setattr(lib, "recscale_team_run", spy)
    return calls


@needs_native
def test_team_runs_a_training_step_bit_for_bit_like_the_python_pool(monkeypatch):
    """Every native kernel of a step (lookup, interaction both ways, the narrow layer,
    weight gradients split both ways, the sparse update) on torch's OpenMP team gives
    exactly the Python pool's results - the same parts, only other threads."""
    from recscale.config import load_config
    from recscale.models.dlrm import build_model
    from recscale.native import team
    from recscale.train.data_source import make_synthetic

    lib = native.library()
    if not team.team_available(lib):
        pytest.skip("torch's OpenMP runtime (libgomp) is not loaded here")
    cfg = load_config(
        "debug", ["--model.embedding_dim=16", "--model.bottom_mlp=64,16", "--model.top_mlp=64,1"]
    )
    batch = make_synthetic(cfg).batch(0, 512)
    results = {}
    for use_team in (True, False):
        monkeypatch.setattr(team, "USE_TEAM", use_team)
        calls = _team_calls(monkeypatch)
        model = build_model(cfg.model, cfg.embedding, seed=0)
        for _ in range(2):  # the second step reads the tables the first one updated
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
            model.zero_grad(set_to_none=True)
            loss.backward()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[use_team] = (loss.detach(), state, grads)
        assert bool(calls) == use_team and all(parts >= 1 for parts in calls)
    (loss_t, state_t, grads_t), (loss_p, state_p, grads_p) = results[True], results[False]
    assert torch.equal(loss_t, loss_p)
    assert state_t.keys() == state_p.keys() and grads_t.keys() == grads_p.keys()
    for k in state_t:
        assert torch.equal(state_t[k], state_p[k]), k
    for k in grads_t:
        assert torch.equal(grads_t[k], grads_p[k]), k


@needs_native
def test_parallel_call_returns_each_parts_code_and_serves_other_threads_from_the_pool(
    monkeypatch,
):
    """Part codes come back in part order (the lookup reports the first bad id of each
    part's features); a call from a thread other than the main one never enters the team
    (libgomp would give that thread a team of its own)."""
    import threading

    from recscale.embedding.lookup import native_pooled_lookup

    calls = _team_calls(monkeypatch)
    num_f, b = 4, 8
    table = torch.randn(40, 8)
    offsets = torch.arange(num_f * b + 1)
    row_offset = torch.arange(num_f) * 10
    sizes = torch.full((num_f,), 10)
    values = torch.randint(0, 10, (num_f * b,))
    values[3 * b + 5] = 10  # feature 3 (the second thread's part) reads past its table

    def run() -> object:
        return native_pooled_lookup(table, values, offsets, b, row_offset, sizes, None)

    assert run() == 3 * b + 5
    values[3 * b + 5] = 9
    expect_rows = values + row_offset.repeat_interleave(b)
    out: list = []
    worker = threading.Thread(target=lambda: out.append(run()))
    on_main = len(calls)
    worker.start()
    worker.join()
    assert len(calls) == on_main  # the other thread used the pool
    pooled, rows, _ = run()
    assert torch.equal(rows, expect_rows) and torch.equal(out[0][1], expect_rows)
    ref = table[expect_rows].view(num_f, b, 8).transpose(0, 1).reshape(-1, 8)
    assert torch.equal(pooled, ref) and torch.equal(out[0][0], ref)


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_runs_the_kernels_on_the_python_pool():
    """libgomp's team does not survive fork: a child of a process that used it must take
    the Python pool (on the team it would wait for workers it does not have)."""
    import time

    from recscale.embedding.lookup import native_pooled_lookup

    num_f, b = 4, 64
    table = torch.randn(400, 8)
    offsets = torch.arange(num_f * b + 1)
    row_offset, sizes = torch.arange(num_f) * 100, torch.full((num_f,), 100)
    values = torch.randint(0, 100, (num_f * b,))

    def lookup() -> torch.Tensor:
        return native_pooled_lookup(table, values, offsets, b, row_offset, sizes, None)[0]

    expected = lookup()  # the parent runs on the team (where it can be had)
    pid = os.fork()
    if pid == 0:  # the child: the same two-part call, then only an exit code
        code = 1
        try:
            code = 0 if torch.equal(lookup(), expected) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in a native call")


needs_avx512 = pytest.mark.skipif(
    not native.has_avx512(), reason=f"AVX-512 weight-gradient kernel: {native.status()}"
)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize(
    "batch,out,inp,strided",
    [
        (0, 7, 9, False),  # no samples: zero gradients
        (1, 1, 1, False),  # one sample, one edge tile of one row and one column
        (63, 6, 16, False),  # one full tile; the batch one short of a packed block (64)
        (127, 6, 16, False),  # a block and a 63-sample one
        (129, 13, 17, True),  # two blocks and one sample; edge tile rows 1, columns 1
        (300, 70, 130, True),  # split over two threads; 3 column blocks, the last 2 wide
        (257, 64, 50, False),  # 4-row edge tile, 4 vectors with the last 2 lanes
        (256, 512, 13, False),  # config A's first layer: a narrow input, operands swapped
        (129, 100, 7, True),  # narrow and strided, threads split its 7 rows
        (512, 16, 64, True),  # one full column block
        (600, 8, 20, False),  # samples split 256 + 344 (whole blocks, the rest to the last)
    ],
)
@pytest.mark.parametrize("split", ["outputs", "samples"])
def test_native_weight_grad_matches_fp64_reference(
    batch, out, inp, strided, bias_grad, split, isa, monkeypatch
):
    """dW = g^T x and db = g.sum(0) from the AVX2 and the AVX-512 kernel (every edge:
    partial tiles, partial column vectors, batch ranges across packed blocks and threads,
    rows with a stride wider than the row; threads splitting the outputs, or the samples
    with the partial results added) against float64 torch."""
    from recscale.modules import gemm

    if native.library() is None:
        pytest.skip(native.status())
    if isa == "avx512" and not native.has_avx512():
        pytest.skip(f"AVX-512 weight-gradient kernel: {native.status()}")
    monkeypatch.setattr(gemm, "MKL_FIRST", False)  # the kernel where MKL runs first too
    monkeypatch.setattr(gemm, "_WGRAD_ISA", {"avx2": 1, "avx512": 2}[isa])
    monkeypatch.setattr(gemm, "_WGRAD_MIN_OUT", 1)  # the kernel even where MKL is faster
    monkeypatch.setattr(gemm, "_WGRAD_MIN_MACS", 0)  # and threads on however little work
    monkeypatch.setattr(gemm, "_WGRAD_BATCH_SPLIT_BYTES", 0 if split == "outputs" else 1 << 40)
    parts = []
    real = gemm._native_at_b_batch_split
    monkeypatch.setattr(gemm, "_native_at_b_batch_split", lambda *a: parts.append(1) or real(*a))
    g, x = wgrad_operands(batch, out, inp, strided)
    assert gemm._native_wgrad_applies(g, x)
    dw, db = weight_grad_on_two_threads(g, x, bias_grad)
    want = g.double().t() @ x.double()
    assert dw.shape == (out, inp) and dw.is_contiguous()
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5 * (batch + 1))
    if bias_grad:
        torch.testing.assert_close(
            db.double(), g.double().sum(0), rtol=1e-5, atol=1e-5 * (batch + 1)
        )
    else:
        assert db is None
    # the sample split runs where there are two whole blocks of samples to share
    assert bool(parts) == (split == "samples" and batch >= 2 * gemm._WGRAD_KC)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize(
    "batch,out,inp,strided,threads",
    [
        (0, 7, 13, False, 1),  # no samples: zero gradients
        (1, 1, 1, False, 1),  # one sample, one lane of one output block
        (17, 37, 13, True, 1),  # a block of 16 samples and one; a 5-lane tail block
        (300, 512, 13, False, 2),  # config A's first layer, samples split over 2 threads
        (129, 48, 5, True, 2),  # a 16-lane tail; strided rows, split samples
        (64, 32, 9, False, 2),  # one whole output block
    ],
)
def test_native_narrow_weight_grad_matches_fp64_reference(
    batch, out, inp, strided, threads, masked, isa, monkeypatch
):
    """The first layer's dW and db with its ReLU mask applied on the way
    (native/narrow_layer.c: output blocks of 32 with tails, sample blocks of 16 with
    a remainder, strided rows, threads adding partial results) against float64 torch:
    g masked where the ReLU output is not > 0 - exactly threshold_backward's rule, the
    output's zeros included. Both widths: the AVX-512 kernel where the CPU has it, the AVX2
    one everywhere (8-output blocks; 37 and 48 outputs leave 5- and 0-lane tails)."""
    import ctypes

    from recscale.modules import gemm

    if native.library() is None:
        pytest.skip(native.status())
    if isa == "avx512" and not native.has_avx512():
        pytest.skip(f"AVX-512 narrow-layer kernel: {native.status()}")
    flag = ctypes.c_int.in_dll(native.library(), "recscale_narrow_isa")
    monkeypatch.setattr(flag, "value", {"avx2": 1, "avx512": 0}[isa])

    gen = torch.Generator().manual_seed(batch + out + inp)
    pad = 3 if strided else 0
    g = torch.randn(batch, out + pad, generator=gen)[:, pad:]
    h = torch.randn(batch, out + 2 * pad, generator=gen).relu_()[:, :out]  # half zeros
    x = torch.randn(batch, inp + pad, generator=gen)[:, pad:]
    mask = h if masked else None
    assert gemm.native_narrow_wgrad_applies(g, x)
    before = g.clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dw, db = gemm.narrow_weight_grad(g, x, mask, bias_grad=True)
        dw2, db2 = gemm.narrow_weight_grad(g, x, mask, bias_grad=False)
    finally:
        torch.set_num_threads(saved)
    gm = torch.ops.aten.threshold_backward(g, h, 0.0) if masked else g
    want = gm.double().t() @ x.double()
    assert dw.shape == (out, inp) and dw.is_contiguous() and db2 is None
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5 * (batch + 1))
    torch.testing.assert_close(db.double(), gm.double().sum(0), rtol=1e-5, atol=1e-5 * (batch + 1))
    torch.testing.assert_close(dw2, dw)
    assert torch.equal(g, before)  # the mask applies to this product only


@needs_avx512
@pytest.mark.parametrize("relu,bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize(
    "batch,out,inp,strided,threads",
    [
        (0, 7, 13, False, 1),  # no samples
        (1, 1, 1, False, 1),  # one sample, one lane
        (65, 37, 13, True, 1),  # a block of 64 samples and one; a 5-lane tail block
        (300, 512, 13, False, 2),  # config A's first layer, samples split over 2 threads
        (129, 48, 5, True, 2),  # a 16-lane tail; strided rows
    ],
)
def test_native_narrow_forward_matches_fp64_reference(
    batch, out, inp, strided, threads, relu, bias
):
    """The narrow first layer's forward (native/narrow_layer.c: output blocks of 32 with
    tails, sample blocks of 64, strided rows, bias or none, ReLU or none) against float64."""
    from recscale.modules import gemm

    gen = torch.Generator().manual_seed(batch + out + inp)
    pad = 2 if strided else 0
    x = torch.randn(batch, inp + pad, generator=gen)[:, pad:]
    w = torch.randn(out, inp + pad, generator=gen)[:, :inp]  # rows with a stride
    b = torch.randn(out, generator=gen) if bias else None
    assert gemm.native_narrow_forward_applies(x, w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = gemm.narrow_forward(x, w, b, relu)
    finally:
        torch.set_num_threads(saved)
    want = x.double() @ w.double().t() + (b.double() if bias else 0.0)
    want = want.relu() if relu else want
    assert h.shape == (batch, out) and h.is_contiguous()
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "in_dim,widths,final_relu,input_grad",
    [
        (13, [512, 256, 64, 16], True, False),  # config A's bottom MLP (narrow-input wgrad)
        (368, [512, 256, 1], False, True),  # config A's top MLP
        (7, [5], True, True),
        (7, [5], False, True),
        (20, [30, 3], True, True),
        (9, [1], False, True),  # a lone logit layer: its input gradient is not masked
        (20, [11, 1], False, False),  # a logit layer over 11 features (a 3-lane tail)
        (13, [40, 8], True, False),  # narrow first layer, its mask left to its kernel
        (13, [40, 8], True, True),  # ... not when the input needs a gradient
    ],
)
@pytest.mark.parametrize(
    "onednn,native_wgrad",
    [(True, True), (True, False), (False, False)],
    ids=["onednn-native", "onednn", "mkl"],
)
def test_fused_mlp_matches_sequential(
    in_dim, widths, final_relu, input_grad, onednn, native_wgrad, monkeypatch
):
    from recscale.modules import gemm

    if onednn and gemm.ONEDNN_LINEAR is None:
        pytest.skip("torch built without oneDNN")
    if native_wgrad and native.library() is None:
        pytest.skip(f"native weight-gradient kernel: {native.status()}")
    monkeypatch.setattr(gemm, "USE_ONEDNN", onednn)
    monkeypatch.setattr(gemm, "MKL_FIRST", False)  # the routes below on any host
    monkeypatch.setattr(gemm, "ONEDNN_MIN_MACS", 0)  # oneDNN at the test's 33 samples
    monkeypatch.setattr(gemm, "USE_NATIVE_WGRAD", native_wgrad)
    monkeypatch.setattr(gemm, "USE_NATIVE_NARROW_WGRAD", native_wgrad)
    monkeypatch.setattr(gemm, "USE_NATIVE_NARROW_FORWARD", native_wgrad)
    monkeypatch.setattr(gemm, "USE_NATIVE_LOGIT", onednn)  # native/logit.c (AVX2) or torch
    ref = MLP(in_dim, widths, final_relu, generator=torch.Generator().manual_seed(0), fused=False)
    fused = MLP(in_dim, widths, final_relu, fused=True)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(33, in_dim, generator=torch.Generator().manual_seed(2))
    results = []
    for m in (ref, fused):
        xx = x.clone().requires_grad_(input_grad)
        y = m(xx)
        upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        (y * upstream).sum().backward()
        results.append((y.detach(), xx.grad, [p.grad for p in m.parameters()]))
    (y_ref, gx_ref, gp_ref), (y_f, gx_f, gp_f) = results
    # oneDNN sums in another order than MKL: agreement to float rounding, not bits
    torch.testing.assert_close(y_f, y_ref, rtol=1e-5, atol=1e-6)
    if input_grad:
        torch.testing.assert_close(gx_f, gx_ref, rtol=1e-5, atol=1e-6)
    else:
        assert gx_f is None
    for got, want in zip(gp_f, gp_ref):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_throughput_benchmark_reports_rate_bound_and_kernels():
    """`recscale bench throughput` on the tiny preset: the fields the issue asks for."""
    from recscale.bench.throughput import format_report, run_throughput
    from recscale.config import load_config

    cfg = load_config("debug", ["--model.embedding_dim=16", "--model.bottom_mlp=32,16"])
    r = run_throughput(cfg, steps=3, warmup=1, echo=lambda _: None)
    assert r["samples_per_s"] > 0 and r["bound_samples_per_s"] > 0 and r["peak_rss_bytes"] > 0
    assert r["ratio_to_bound"] == pytest.approx(r["samples_per_s"] / r["bound_samples_per_s"])
    assert set(r["stage_ms"]) == {"lookup", "forward", "backward", "sparse", "dense_opt"}
    assert r["native"] == native.status()
    from recscale.native.team import team_status

    assert r["native_threads"] == team_status(native.library())
    assert r["native_threads"] in format_report("debug", r)
    assert "native C kernels" in format_report("debug", r)
    # the bound's step in its two terms, and the stages set against each
    parts = r["bound_ms"]
    bound_ms = 1e3 * r["batch_size"] / r["bound_samples_per_s"]
    assert parts["mlp_products"] + parts["embedding_rows"] == pytest.approx(bound_ms)
    assert parts["mlp_products"] == pytest.approx(
        1e3 * r["batch_size"] * r["mlp_gflop_per_sample"] / r["gemm_gflops"]
    )
    rows = r["stage_ms"]["lookup"] + r["stage_ms"]["sparse"]
    assert f"lookup + sparse {rows:.2f} ({parts['embedding_rows'] / rows:.2f})" in format_report(
        "debug", r
    )


@pytest.mark.parametrize("n", [0, 1, 7, 5000])
def test_unique_ids_matches_torch_unique_in_first_appearance_order(n):
    from recscale.embedding.cpu_kernels import unique_ids

    g = torch.Generator().manual_seed(n)
    # many repeats, negative and huge ids (hash collisions across the whole range)
    ids = torch.randint(-(2**40), 2**40, (max(n // 3, 1),), generator=g)
    ids = ids[torch.randint(0, ids.numel(), (n,), generator=g)]
    uniq, inverse = unique_ids(ids)
    assert torch.equal(uniq[inverse], ids)
    assert torch.equal(torch.sort(uniq).values, torch.unique(ids))
    first = {}
    for v in ids.tolist():
        first.setdefault(v, len(first))
    assert uniq.tolist() == list(first)  # no sort: the order ids first appear in
