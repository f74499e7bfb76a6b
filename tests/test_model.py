import pytest
import torch
from helpers import random_jagged

from recscale.config.schema import EmbeddingConfig, ModelConfig
from recscale.models.dlrm import build_model
from recscale.modules import interaction
from recscale.modules.dot_interaction_cpu import NativeDotInteraction, bf16_edges_available
from recscale.modules.interaction import DotInteraction, SymmetricGram, gram_row_multiple


@pytest.mark.parametrize("kernel", ["torch", "numba"])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("has_dense", [False, True])
def test_dot_interaction_matches_loops(kernel, self_interaction, has_dense):
    torch.manual_seed(0)
    b, f, d = 3, 4, 5
    dense = torch.randn(b, d) if has_dense else None
    pooled = torch.randn(b, f * d)
    inter = DotInteraction(f, d, has_dense, self_interaction, kernel=kernel)
    out = inter(dense, pooled)
    assert out.shape == (b, inter.out_dim) and inter.out_dim % 8 == 0
    vecs = ([dense] if has_dense else []) + [pooled[:, i * d : (i + 1) * d] for i in range(f)]
    k = len(vecs)
    for s in range(b):
        pairs = [
            torch.dot(vecs[i][s], vecs[j][s])
            for i in range(k)
            for j in range(i if self_interaction else i + 1, k)
        ]
        expected = torch.cat(([dense[s]] if has_dense else []) + [torch.stack(pairs)])
        torch.testing.assert_close(out[s, : expected.numel()], expected)
        assert torch.all(out[s, expected.numel() :] == 0)  # zero padding


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("has_dense", [False, True])
def test_fused_interaction_gradient_matches_torch(self_interaction, has_dense):
    torch.manual_seed(1)
    b, f, d = 7, 6, 8
    grads = {}
    for kernel in ("torch", "numba"):
        dense = torch.randn(b, d, generator=torch.Generator().manual_seed(2)) if has_dense else None
        pooled = torch.randn(b, f * d, generator=torch.Generator().manual_seed(3))
        if dense is not None:
            dense.requires_grad_(True)
        pooled.requires_grad_(True)
        inter = DotInteraction(f, d, has_dense, self_interaction, kernel=kernel)
        out = inter(dense, pooled)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        (out * upstream).sum().backward()
        grads[kernel] = (out.detach(), pooled.grad, None if dense is None else dense.grad)
    for a, c in zip(grads["torch"], grads["numba"]):
        if a is not None:
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_symmetric_gram_gradient_is_autograds_bmm_gradient():
    t = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SymmetricGram.apply, (t,))
    dz = torch.randn(3, 5, 5, dtype=torch.float64)
    (SymmetricGram.apply(t) * dz).sum().backward()
    ours, t.grad = t.grad, None
    (torch.bmm(t, t.transpose(1, 2)) * dz).sum().backward()
    torch.testing.assert_close(ours, t.grad)


def test_symmetric_gram_under_autocast_returns_the_inputs_dtype():
    t = torch.randn(4, 6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = SymmetricGram.apply(t)
    assert z.dtype == torch.bfloat16
    z.float().sum().backward()
    assert t.grad.dtype == torch.float32
    ref = 2 * torch.ones(4, 6, 6) @ t.detach()  # d/dT sum(T T^T) = (1 + 1^T) T
    torch.testing.assert_close(t.grad, ref, rtol=2e-2, atol=2e-2)


def test_gram_rows_padded_to_tensor_core_alignment_on_accelerators_only():
    assert gram_row_multiple(torch.empty(2)) == 1
    assert gram_row_multiple(torch.empty(2, device="meta")) == 4  # fp32 / TF32: 16 bytes
    assert gram_row_multiple(torch.empty(2, device="meta", dtype=torch.bfloat16)) == 8


@pytest.mark.parametrize("multiple", [4, 8])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("has_dense", [False, True])
def test_padded_gram_rows_change_no_output_and_no_gradient(
    monkeypatch, multiple, self_interaction, has_dense
):
    """The GPU pads T's rows (27 -> 28 or 32) with zeros; the pairs and every gradient
    are the unpadded ones (here on the CPU, the padding forced)."""
    b, f, d = 6, 5, 8  # k = 5 or 6 rows: padded either way
    results = []
    for m in (1, multiple):
        monkeypatch.setattr(interaction, "gram_row_multiple", lambda x, m=m: m)
        g = torch.Generator().manual_seed(7)
        dense = torch.randn(b, d, generator=g, dtype=torch.float64).requires_grad_(has_dense)
        pooled = torch.randn(b, f * d, generator=g, dtype=torch.float64, requires_grad=True)
        inter = DotInteraction(f, d, has_dense, self_interaction, kernel="torch")
        out = inter(dense if has_dense else None, pooled)
        (out * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
        results.append((out.detach(), pooled.grad, dense.grad if has_dense else None))
    for a, c in zip(*results):
        if a is not None:
            torch.testing.assert_close(a, c)


def test_under_cpu_autocast_the_interaction_runs_the_fp32_kernel_on_bf16_inputs():
    """bf16 on a CPU: the bottom MLP's bf16 output and the fp32 pooled rows go through
    the fp32 fused kernel (exactly its fp32 result, rounded to bf16 for the top MLP
    where the native kernel writes its row in bf16); the gradients come back in each
    input's own dtype."""
    b, f, d = 5, 4, 8
    dense = torch.randn(b, d, generator=torch.Generator().manual_seed(5))
    pooled = torch.randn(b, f * d, generator=torch.Generator().manual_seed(6))
    inter = DotInteraction(f, d, True, kernel="auto")
    want = inter(dense.bfloat16().float(), pooled)
    x = dense.bfloat16().requires_grad_(True)
    p = pooled.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = inter(x, p)
    bf16_row = inter._fused(p) is NativeDotInteraction and bf16_edges_available()
    assert out.dtype == (torch.bfloat16 if bf16_row else torch.float32)
    assert torch.equal(out, want.to(out.dtype))
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and p.grad.dtype == torch.float32


def _cfg(**kw):
    base = dict(table_sizes=[10, 20, 5], embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1])
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"interaction_self": True},
        {"pooling": "mean"},
        {"interaction": "cat", "table_dims": [2, 6, 4], "bottom_mlp": [8, 3]},
        {"num_dense_features": 0, "bottom_mlp": []},
    ],
)
def test_dlrm_forward_backward(kw):
    cfg = _cfg(**kw)
    cfg.validate()
    model = build_model(cfg, EmbeddingConfig(optimizer="sgd", lr=0.1))
    batch = random_jagged(cfg.table_sizes, 6, seed=2, hot_ids=False)
    batch.dense = batch.dense[:, : cfg.num_dense_features]
    logits = model(batch)
    assert logits.shape == (6,)
    before = [g.storage.weight.clone() for g in model.embeddings.groups]
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    assert all(p.grad is not None for p in model.dense_parameters() if p.numel())
    changed = any(
        not torch.equal(b0, g.storage.weight) for b0, g in zip(before, model.embeddings.groups)
    )
    assert changed, "the fused optimizer must have updated touched rows"


def test_same_seed_same_model():
    cfg = _cfg()
    a = build_model(cfg, EmbeddingConfig(), seed=3).state_dict()
    b = build_model(cfg, EmbeddingConfig(), seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "optimizer,lr,atol",
    # Adam divides by sqrt(v) with v ~ 1e-9 for rarely hit rows, which amplifies
    # summation-order differences; its tolerance is a small fraction of one step (lr).
    [("sgd", 0.1, 1e-5), ("rowwise_adagrad", 0.1, 1e-5), ("adam", 0.01, 1e-4)],
)
def test_fused_kernels_train_like_reference_path(optimizer, lr, atol):
    """K training steps with the numba kernels, and with the native (C) ones, == the
    straightforward torch path (dim 16: every native kernel applies)."""
    from recscale.config import load_config
    from recscale.train.data_source import make_synthetic

    states = {}
    for kernels in ("torch", "numba", "native"):
        cfg = load_config(
            "debug",
            [
                f"--model.kernels={kernels}",
                "--model.embedding_dim=16",
                "--model.bottom_mlp=32,16",
                f"--embedding.optimizer={optimizer}",
                f"--embedding.lr={lr}",
                "--data.max_ids_per_feature=3",
                "--data.min_ids_per_feature=0",
            ],
        )
        model = build_model(cfg.model, cfg.embedding, seed=0)
        opt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
        data = make_synthetic(cfg)
        for i in range(8):
            batch = data.batch(i, 64)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        states[kernels] = model.state_dict()
    for key, ref in states["torch"].items():
        for kernels in ("numba", "native"):
            got = states[kernels][key]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=atol, msg=f"{kernels}: {key}")
