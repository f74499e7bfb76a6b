"""Compressed tables (embedding.compression = qr | mixed_dim | tt): lookups and
gradients against dense references built from the same factors, the optimizers against
their dense formulas, sizes, training quality, checkpoints, sharding, config errors."""

import pytest
import torch
import torch.nn.functional as F
from helpers import RESUME_BASE, assert_resume_identical

from recscale import native
from recscale.config import ConfigError, load_config
from recscale.embedding.compressed import MixedDimStorage, QRStorage, TTStorage
from recscale.embedding.compression_shapes import compressed_rows, mixed_dims, tt_shape
from recscale.embedding.optimizers import SparseAdam, SparseRowwiseAdagrad, SparseSGD
from recscale.planner.from_config import plan_for, table_infos
from recscale.train.run import train

QUIET = dict(echo=lambda *_: None)
N, D = 1000, 16


def _storages(opt):
    return {
        "qr_mult": QRStorage(N, D, 16, "mult", opt),
        "qr_add": QRStorage(N, D, 16, "add", opt),
        "qr_concat": QRStorage(N, D, 16, "concat", opt),
        "mixed_dim": MixedDimStorage(N, D, 4, opt),
        "tt": TTStorage(N, D, 3, opt),
    }


def _dense_rows(name, f):
    """Every virtual row from the factors with plain torch (indexing and loops)."""
    i = torch.arange(N)
    if name.startswith("qr"):
        q, r = f["q"][i // 16], f["r"][i % 16]
        return {"qr_mult": q * r, "qr_add": q + r, "qr_concat": torch.cat([q, r], 1)}[name]
    if name == "mixed_dim":
        return f["w"] @ f["proj"]
    (n1, n2, n3), (d1, d2, d3) = tt_shape(N, D)
    rank = f["g1"].shape[1] // d1
    rows = []
    for x in range(N):
        a = f["g1"][x // (n2 * n3)].view(d1, rank)
        b = f["g2"][(x // n3) % n2].view(rank, d2 * rank)
        c = f["g3"][x % n3].view(rank, d3)
        rows.append(((a @ b).view(d1 * d2, rank) @ c).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["qr_mult", "qr_add", "qr_concat", "mixed_dim", "tt"])
def test_lookup_and_gradient_match_the_dense_reference(name):
    torch.manual_seed(0)
    s = _storages(SparseSGD(1.0))[name]
    s.init_factors(seed=3, feature=0)
    params = {k: torch.nn.Parameter(f.weight.clone()) for k, f in s.factors.items()}
    rows = torch.tensor([0, 17, 17, 999, 500, 3, 64, 640])
    offsets = torch.tensor([0, 3, 3, 6, 8])
    psw = torch.rand(8)
    ref = F.embedding_bag(
        rows,
        _dense_rows(name, params),
        offsets,
        mode="sum",
        per_sample_weights=psw,
        include_last_offset=True,
    )
    torch.testing.assert_close(s.lookup(rows, offsets, psw), ref)
    torch.testing.assert_close(s.read_rows(rows), _dense_rows(name, params)[rows])
    # the gradient of sum(pooled * G) reaches each factor as autograd's does (SGD, lr 1)
    g = torch.randn(4, D)
    (ref * g).sum().backward()
    bag = torch.repeat_interleave(torch.arange(4), offsets[1:] - offsets[:-1])
    s.apply_pooled_gradients(rows, torch.tensor([0, 8]), bag, psw, g)
    for k, f in s.factors.items():
        torch.testing.assert_close(
            f.weight, params[k].detach() - params[k].grad, atol=1e-6, rtol=1e-5
        )


@pytest.mark.parametrize("name", ["qr_mult", "qr_add", "qr_concat", "mixed_dim", "tt"])
def test_the_written_out_combine_backward_is_autograds_to_the_bit(name):
    s = _storages(SparseSGD(1.0))[name]
    s.init_factors(seed=5, feature=1)
    rows = torch.randint(0, N, (300,))
    _, parts = s._gather(rows)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in parts.items()}
    g = torch.randn(300, D)
    want = torch.autograd.grad(s._combine(leaves), list(leaves.values()), g)
    got = s._combine_backward(parts, g)
    for k, w in zip(leaves, want):
        assert torch.equal(got[k], w), k


@pytest.mark.skipif(native.library() is None, reason=native.status())
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_factors_updated_by_the_native_pass_match_torchs_ops(opt, precision):
    """Factors and hot rows whose width the C update takes (model.kernels auto) get one
    fused pass over their ids, duplicates merged there; torch's ops (kernels=torch) are
    the reference."""
    make = {"sgd": lambda: SparseSGD(0.5), "rowwise_adagrad": lambda: SparseRowwiseAdagrad(0.1)}
    make["adam"] = lambda: SparseAdam(0.01)
    fast, ref = (
        TTStorage(N, D, 4, make[opt](), None, precision, 40, kernel=k) for k in ("auto", "torch")
    )
    # the factors (widths 8, 32, 16) and the hot rows (16)
    assert {f.backward_kernel() for f in [*fast.factors.values(), fast.hot]} == {"native"}
    assert {f.backward_kernel() for f in [*ref.factors.values(), ref.hot]} == {"torch"}
    for s in (fast, ref):
        s.init_factors(seed=2, feature=4)
        s.set_hot_ids(torch.arange(0, N, 25))  # 40 hot ids: some of the batches' ids
    hot_before = ref.hot.weight.float().clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        rows = torch.randint(0, N, (64,), generator=gen)  # ids repeat, and factor rows more
        g = torch.randn(16, D, generator=gen)
        bag = torch.repeat_interleave(torch.arange(16), 4)
        for s in (fast, ref):
            s.apply_pooled_gradients(rows, torch.tensor([0, 64]), bag, None, g)
    assert not torch.equal(ref.hot.weight.float(), hot_before)  # hot rows were trained too
    for a, b in [*((fast.factors[k], ref.factors[k]) for k in ref.factors), (fast.hot, ref.hot)]:
        a, b = a.weight.float(), b.weight.float()
        tol = 1e-3 * b.abs().max().item() if precision == "fp16" else 1e-6  # fp16: an ulp
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_rowwise_adagrad_on_factors_matches_its_dense_formula():
    torch.manual_seed(1)
    s = QRStorage(N, D, 16, "mult", SparseRowwiseAdagrad(0.1, eps=1e-8))
    s.init_factors(seed=0, feature=0)
    params = {k: torch.nn.Parameter(f.weight.clone()) for k, f in s.factors.items()}
    acc = {k: torch.zeros(f.num_rows) for k, f in s.factors.items()}
    for _ in range(3):
        rows = torch.randint(0, N, (20,))
        g = torch.randn(20, D)
        for p in params.values():
            p.grad = None
        (_dense_rows("qr_mult", params)[rows] * g).sum().backward()
        s.apply_gradients(*_merge(rows, g))
        with torch.no_grad():
            for k, p in params.items():  # dense Adagrad, one accumulator a row
                touched = p.grad.abs().sum(1) > 0
                acc[k][touched] += p.grad[touched].pow(2).mean(1)
                p -= 0.1 * p.grad / (acc[k].sqrt() + 1e-8).unsqueeze(1)
    for k, f in s.factors.items():
        torch.testing.assert_close(f.weight, params[k].detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(f.read_state(torch.arange(f.num_rows))["sum"], acc[k])


def _merge(rows, g):
    unique, inverse = torch.unique(rows, return_inverse=True)
    return unique, torch.zeros(len(unique), g.shape[1]).index_add_(0, inverse, g)


def test_sizes_and_the_mixed_dim_power_rule():
    s = _storages(SparseSGD(0.1))
    assert s["qr_mult"].stored_bytes() == 4 * (63 + 16) * D
    for name, st in s.items():
        assert st.stored_bytes() < 4 * N * D / 3, name
    assert s["tt"].stored_bytes() == 4 * compressed_rows("tt", N, D, tt_rank=3)
    assert mixed_dims([10, 1000, 100_000], 16, 0.25) == [16, 4, 1]
    assert mixed_dims([10, 1000], 16, 0.0) == [16, 16]
    assert tt_shape(1000, 16) == ([10, 10, 10], [2, 2, 4])


def test_planner_counts_compressed_bytes_and_places_them_whole():
    cfg = load_config("default", ["--embedding.compression=qr", "--embedding.qr_buckets=16"])
    plain, comp = table_infos(load_config("default")), table_infos(cfg)
    assert sum(t.bytes for t in comp) < sum(t.bytes for t in plain) / 10
    # tables under compress_min_rows (10,000) stay plain, with their plain bytes
    small = [i for i, t in enumerate(plain) if t.rows < 10_000]
    assert small and all(comp[i] == plain[i] for i in small)
    big = max(range(len(comp)), key=lambda i: plain[i].bytes)
    n, d = plain[big].rows, plain[big].dim
    q = -(-n // 16)
    assert comp[big].bytes == 4 * (q + 16) * d + 4 * (q + 16)  # factors + row-wise state
    kinds = {p.table: p.kind for p in plan_for(cfg, 2, 1 << 40).placements}
    for t in comp:
        if t.compressed_bytes:
            assert kinds[t.name] == "table_wise"


def test_bad_values_are_refused_naming_the_key():
    for over, key in (
        (["--embedding.compression=qr", "--embedding.qr_buckets=0"], "embedding.qr_buckets"),
        (["--embedding.compression=tt", "--embedding.tt_rank=0"], "embedding.tt_rank"),
        (["--embedding.compression=zip"], "embedding.compression"),
        (
            [
                "--embedding.compression=qr",
                "--embedding.qr_op=concat",
                "--model.embedding_dim=7",
                "--model.bottom_mlp=16,7",
            ],
            "embedding.qr_op",
        ),
        (
            ["--embedding.compression=tt", "--model.embedding_dim=7", "--model.bottom_mlp=16,7"],
            "embedding.compression",
        ),
        (["--embedding.table_compression=C99=qr"], "embedding.table_compression"),
        (["--embedding.table_compression=C1:qr"], "embedding.table_compression"),
        (
            ["--embedding.compression=qr", "--distributed.sharding=row_wise"],
            "embedding.compression",
        ),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("debug", over)


@pytest.fixture(scope="module")
def plain_auc():
    return train(load_config("debug", ["--train.progress=false"]), None, **QUIET)["auc"]


@pytest.mark.parametrize(
    "over",
    [
        ["--embedding.compression=qr"],
        ["--embedding.compression=mixed_dim"],
        ["--embedding.compression=tt"],
    ],
    ids=["qr", "mixed_dim", "tt"],
)
def test_debug_run_trains_within_001_auc_of_plain(over, plain_auc):
    """The issue's commands, defaults and all (the debug preset compresses its tables of
    500 rows and more)."""
    m = train(load_config("debug", ["--train.progress=false", *over]), None, **QUIET)
    assert m["auc"] >= plain_auc - 0.01, (m["auc"], plain_auc)


def test_resume_is_bitwise_identical_and_refuses_another_compression(tmp_path):
    extra = ["--embedding.compression=qr", "--embedding.table_compression=C1=none,C5=tt"]
    assert_resume_identical(tmp_path, extra)
    from recscale.checkpoint.format import CheckpointError

    with pytest.raises(CheckpointError, match="compress"):
        train(
            load_config("debug", [*RESUME_BASE, "--train.steps=80"]),
            tmp_path / "b",
            resume=tmp_path / "b",
            **QUIET,
        )


def test_sharded_compressed_tables_match_single_process():
    from dist_workers import compressed_reference, compressed_run

    from recscale.distributed.spawn import run_ranks

    ref = compressed_reference(4, 64)
    results = run_ranks(compressed_run, 2, 4, 64, timeout=240)
    preds = torch.cat([r[0] for r in results])
    torch.testing.assert_close(preds, ref, atol=1e-5, rtol=1e-4)
    kinds = results[0][1]
    assert kinds["C1"] == "table_wise" and kinds["C2"] == "table_wise"


def test_rows_of_a_compressed_table_cannot_be_written_one_by_one():
    s = QRStorage(N, D, 16, "mult", SparseSGD(0.1))
    with pytest.raises(TypeError, match="computed from its factors"):
        s.write_rows(torch.arange(2), torch.zeros(2, D))
    with pytest.raises(TypeError, match="lives in its factors"):
        s.write_state(torch.arange(2), {})


def test_small_batches_run_serially_with_the_same_rows_and_threads_restored():
    """Lookups under the serial threshold (one thread) and over it (all threads) give
    the same rows, and the thread count is restored, also when the body raises."""
    from recscale.embedding import compressed

    s = TTStorage(100_000, D, 4, SparseSGD(0.1))
    s.init_factors(seed=1, feature=2)
    big = torch.randint(0, 100_000, (compressed._SERIAL_BELOW // D + 7,))
    offsets = torch.arange(big.numel() + 1)
    threads = torch.get_num_threads()
    whole = s.lookup(big, offsets, None)
    parts = [s.lookup(c, torch.arange(c.numel() + 1), None) for c in big.split(1000)]
    torch.testing.assert_close(whole, torch.cat(parts), rtol=1e-6, atol=1e-7)
    assert torch.get_num_threads() == threads
    with pytest.raises(RuntimeError, match="boom"):
        with compressed.serial_if_small(10):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == threads
