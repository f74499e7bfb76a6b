import pytest
import torch
from helpers import random_jagged

from recscale.config.schema import EmbeddingConfig, ModelConfig
from recscale.models.dlrm import build_model
from recscale.modules.interaction import DotInteraction


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_matches_loops(self_interaction):
    torch.manual_seed(0)
    b, f, d = 3, 4, 5
    dense = torch.randn(b, d)
    pooled = torch.randn(b, f * d)
    inter = DotInteraction(f, d, has_dense=True, self_interaction=self_interaction)
    out = inter(dense, pooled)
    vecs = [dense] + [pooled[:, i * d : (i + 1) * d] for i in range(f)]
    for s in range(b):
        pairs = []
        for i in range(f + 1):
            for j in range(i if self_interaction else i + 1, f + 1):
                pairs.append(torch.dot(vecs[i][s], vecs[j][s]))
        expected = torch.cat([dense[s], torch.stack(pairs)])
        torch.testing.assert_close(out[s], expected)
    assert out.shape[1] == inter.out_dim


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
