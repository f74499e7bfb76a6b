"""Stacked QR tables (embedding/compressed_group.py) against each table in a storage of its
own: the same pooled vectors and the same factors, to the bit, step after step; their
members checkpoint as tables alone; tables that cannot stack keep their own storages."""

import pytest
import torch
from helpers import random_jagged

from recscale.config.schema import EmbeddingConfig
from recscale.embedding.compressed import QRStorage
from recscale.embedding.compressed_group import QRGroupStorage
from recscale.embedding.optimizers import SparseAdam, SparseRowwiseAdagrad, SparseSGD
from recscale.embedding.placement import device_storage_factory
from recscale.modules.embedding_bag_collection import EmbeddingBagCollection, TableSpec

# a plain table between QR ones, and a QR table with fewer rows than buckets
SIZES = [300, 20, 1000, 3, 517]
QR_TABLES = {0, 2, 3, 4}
OPTIMIZERS = {
    "sgd": lambda: SparseSGD(lr=0.5),
    "rowwise_adagrad": lambda: SparseRowwiseAdagrad(lr=0.3),
    "adam": lambda: SparseAdam(lr=0.05),
}


def _collection(op: str, optimizer: str, stack: bool, **cfg) -> EmbeddingBagCollection:
    tables = [
        TableSpec(f"C{f + 1}", n, 16, compression="qr" if f in QR_TABLES else "none")
        for f, n in enumerate(SIZES)
    ]
    e = EmbeddingConfig(qr_buckets=8, qr_op=op, **cfg)
    make = device_storage_factory(e, None, "auto", stack_qr=stack)
    return EmbeddingBagCollection(tables, "sum", OPTIMIZERS[optimizer], make_storage=make, seed=7)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("op", ["mult", "add", "concat"])
def test_stacked_qr_tables_train_as_each_table_alone_to_the_bit(op, optimizer):
    stacked = _collection(op, optimizer, stack=True)
    alone = _collection(op, optimizer, stack=False)
    assert len(stacked.groups) == 2 and isinstance(stacked.groups[1].storage, QRGroupStorage)
    assert len(alone.groups) == 5
    for step in range(4):
        batch = random_jagged(SIZES, 16, max_len=5, weighted=step % 2 == 1, seed=step)
        args = (batch.values, batch.offsets, 16, batch.weights)
        out, want = stacked.pooled_by_feature(*args), alone.pooled_by_feature(*args)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        (out * upstream).sum().backward()
        (want * upstream).sum().backward()
    for (p, mine, _), (q, theirs, _) in zip(stacked.local_parts(), alone.local_parts()):
        assert p == q
        if p.feature in QR_TABLES:  # what a checkpoint writes of the table
            got, ref = mine.factor_state(), theirs.factor_state()
            assert got.keys() == ref.keys()
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
            assert int(got["step"]) == 4  # each step applied once to each table


def test_a_member_restored_from_a_checkpoint_trains_on_in_the_stack():
    """``load_factor_state`` into a member (what a restore does) writes the group's
    stack: the next lookup sees the restored factors."""
    source = _collection("mult", "rowwise_adagrad", stack=False)
    stacked = _collection("mult", "rowwise_adagrad", stack=True)
    batch = random_jagged(SIZES, 8, seed=1)
    args = (batch.values, batch.offsets, 8, batch.weights)
    (source.pooled_by_feature(*args).sum()).backward()  # source's factors moved
    for (p, mine, _), (_, theirs, _) in zip(stacked.local_parts(), source.local_parts()):
        if p.feature in QR_TABLES:
            mine.load_factor_state(theirs.factor_state())
    qr = sorted(QR_TABLES)  # (the plain table was not restored)
    with torch.no_grad():
        got, want = stacked.pooled_by_feature(*args), source.pooled_by_feature(*args)
    assert not torch.equal(
        got, _collection("mult", "rowwise_adagrad", True).pooled_by_feature(*args)
    )
    torch.testing.assert_close(got[:, qr], want[:, qr], rtol=0, atol=0)


def test_members_follow_the_group_when_its_tensors_move():
    group = _collection("mult", "adam", stack=True).groups[1].storage
    group._apply(lambda t: t.clone())  # what .to(another device) does to every tensor
    q = group.factors["q"].weight
    lo = 0
    for m in group.members:
        w = m.factors["q"].weight
        assert w.data_ptr() == q[lo:].data_ptr()  # a view of the group's new tensor
        lo += w.shape[0]
    assert all(m.step is group.step for m in group.members)


@pytest.mark.parametrize(
    "cfg", [dict(hot_fraction=0.1), dict(row_precision="fp16")], ids=["hot_rows", "fp16"]
)
def test_qr_tables_that_cannot_stack_keep_a_storage_each(cfg):
    ebc = _collection("mult", "sgd", stack=True, **cfg)
    assert len(ebc.groups) == 5
    assert all(isinstance(s, QRStorage) for s in ebc.storages()[1:])


def test_a_group_refuses_members_that_do_not_stack():
    opt = SparseSGD(lr=0.1)
    with pytest.raises(ValueError, match="share dim and op"):
        QRGroupStorage([QRStorage(50, 8, 4, "mult", opt), QRStorage(50, 8, 4, "add", opt)])
    with pytest.raises(ValueError, match="hot rows"):
        QRGroupStorage([QRStorage(50, 8, 4, "mult", opt, hot_rows=2)])
