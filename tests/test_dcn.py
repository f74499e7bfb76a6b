"""DCNv2 cross layers against a plain-torch reference of the full-rank formula."""

from __future__ import annotations

import pytest
import torch

from recscale.config import ConfigError, load_config
from recscale.modules.dcn import DCNv2Interaction
from recscale.train.run import train


def _reference(x0: torch.Tensor, layers) -> torch.Tensor:
    """x_{l+1} = x0 * (W_l x_l + b_l) + x_l with W_l = U_l V_l materialized."""
    x = x0
    for v, u, b in layers:
        w = u @ v  # [d, d]
        x = x0 * (x @ w.t() + b) + x
    return x


@pytest.mark.parametrize("has_dense", [True, False])
@pytest.mark.parametrize("path", ["fused-onednn", "fused-mkl", "plain"])
def test_forward_and_gradients_match_the_full_rank_formula(has_dense, path, monkeypatch):
    from recscale.modules import gemm

    if path == "fused-onednn" and gemm.ONEDNN_LINEAR is None:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(gemm, "USE_ONEDNN", path != "fused-mkl")
    monkeypatch.setattr(gemm, "MKL_FIRST", False)  # the fused routes on any host
    monkeypatch.setattr(gemm, "ONEDNN_MIN_MACS", 0)  # oneDNN at the test's 6 samples
    # fused-onednn takes the AVX-512 weight-gradient kernel where the CPU has it
    monkeypatch.setattr(gemm, "USE_NATIVE_WGRAD", path != "fused-mkl")
    torch.manual_seed(0)
    b, f, dim = 6, 3, 4
    dense_dim = 5 if has_dense else 0
    m = DCNv2Interaction(
        f * dim,
        dense_dim,
        num_layers=3,
        rank=2,
        generator=torch.Generator().manual_seed(1),
        fused=path != "plain",
    )
    with torch.no_grad():
        for bias in m.b:  # nonzero biases, so their gradients are exercised too
            bias.normal_()
    dense = torch.randn(b, dense_dim, requires_grad=True) if has_dense else None
    pooled = torch.randn(b, f, dim, requires_grad=True)
    out = m(dense, pooled)
    assert out.shape == (b, f * dim + dense_dim) == (b, m.out_dim)
    grad = torch.randn_like(out)
    params = [p for layer in zip(m.V, m.U, m.b) for p in layer]
    inputs = [pooled] + ([dense] if has_dense else [])
    got = torch.autograd.grad(out, inputs + params, grad)

    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    x0 = ref_inputs[0].reshape(b, -1)
    if has_dense:
        x0 = torch.cat([ref_inputs[1], x0], 1)
    ref = _reference(x0, [ref_params[i : i + 3] for i in range(0, len(ref_params), 3)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(ref, ref_inputs + ref_params, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_dcnv2_trains_like_the_dot_interaction():
    base = ["--train.progress=false", "--train.steps=200", "--data.eval_samples=8192"]
    dot = train(load_config("debug", base), None, echo=lambda *_: None)
    dcn = train(
        load_config(
            "debug",
            [*base, "--model.interaction=dcnv2", "--model.dcn_rank=16", "--model.dcn_layers=2"],
        ),
        None,
        echo=lambda *_: None,
    )
    assert dcn["auc"] > dot["auc"] - 0.01


@pytest.mark.parametrize("key", ["model.dcn_rank", "model.dcn_layers"])
def test_bad_dcn_values_name_the_key(key):
    with pytest.raises(ConfigError, match=key):
        load_config("debug", ["--model.interaction=dcnv2", f"--{key}=0"])


def test_the_mlperf_preset_loads():
    cfg = load_config("criteo_multihot_dcnv2")
    assert cfg.model.interaction == "dcnv2" and cfg.model.dcn_rank == 512
    assert cfg.model.embedding_dim == 128 and len(cfg.model.table_sizes) == 26


def test_the_fused_stack_keeps_nothing_for_a_backward_under_no_grad(monkeypatch):
    """Evaluation runs under ``torch.no_grad()``, where the one-node CPU stack still kept
    every layer's input, low-rank product and output until its last layer (1,000 layers
    at an eval batch of 8,192: 31 GB, the run killed). Under no_grad it now keeps none,
    with the same output bit for bit; the memory estimate follows (one layer's values a
    sample, whatever the depth)."""
    from recscale.modules import dcn
    from recscale.train.parallel import batch_bytes_per_sample

    kept = []
    forward = dcn._CrossStack.forward

    def spy(ctx, x0, keep, *params):
        out = forward(ctx, x0, keep, *params)
        kept.append(len(ctx.to_save) - 1 - len(params))  # x0 and params aside
        return out

    monkeypatch.setattr(dcn._CrossStack, "forward", staticmethod(spy))
    g = torch.Generator().manual_seed(0)
    m = DCNv2Interaction(24, 8, num_layers=4, rank=6, generator=g)
    dense, pooled = torch.randn(5, 8), torch.randn(5, 24)
    with torch.no_grad():
        quiet = m(dense, pooled)
    loud = m(dense, pooled)
    assert kept == [0, 3 * 4] and torch.equal(quiet, loud)
    loud.sum().backward()  # the kept values still serve the backward
    assert all(p.grad is not None for p in m.parameters())
    deep = [load_config("criteo_multihot_dcnv2", [f"--model.dcn_layers={n}"]) for n in (3, 300)]
    assert batch_bytes_per_sample(deep[0], True) == batch_bytes_per_sample(deep[1], True)
    assert batch_bytes_per_sample(deep[0]) < batch_bytes_per_sample(deep[1])
