"""torch's dense optimizers without their first call's import of ``torch._dynamo``
(train/optimizer_methods.py): the same results as torch's own classes, and no import."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from recscale.train import optimizer_methods as om

CASES = [
    (torch.optim.SGD, om.SGD, {"lr": 0.1}),
    (torch.optim.SGD, om.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}),
    (torch.optim.Adam, om.Adam, {"lr": 1e-2}),
    (torch.optim.Adam, om.Adam, {"lr": 1e-2, "fused": True}),
    (torch.optim.Adagrad, om.Adagrad, {"lr": 1e-2, "weight_decay": 1e-3}),
]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(7, 5, generator=g)),
        torch.nn.Parameter(torch.randn(5, generator=g)),
    ]


@pytest.mark.parametrize("torch_cls,ours,kw", CASES)
def test_each_optimizer_steps_saves_and_loads_as_torchs_own(torch_cls, ours, kw):
    assert issubclass(ours, torch_cls) and ours.__name__ == torch_cls.__name__
    runs = {}
    for cls in (torch_cls, ours):
        params = _params(0)
        opt = cls(params, **kw)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            assert opt.step() is None
            assert torch.is_grad_enabled()  # autograd back on after the step
            assert all(p.grad_fn is None for p in params)
            opt.zero_grad()
            assert all(p.grad is None for p in params)
        runs[cls] = (params, opt.state_dict())
    (p_ref, sd_ref), (p_ours, sd_ours) = runs[torch_cls], runs[ours]
    for a, b in zip(p_ref, p_ours):
        assert torch.equal(a, b)
    assert sd_ref["param_groups"] == sd_ours["param_groups"]
    for i, state in sd_ref["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sd_ours["state"][i][key]))

    # torch's state into ours, and a step on from there matches torch's step on
    params = [torch.nn.Parameter(p.detach().clone()) for p in p_ref]
    resumed = ours(params, **kw)
    resumed.load_state_dict(copy.deepcopy(sd_ref))  # (a load keeps the tensors it gets)
    ref = torch_cls(p_ref, **kw)
    ref.load_state_dict(copy.deepcopy(sd_ref))
    for a, b in zip(params, p_ref):
        a.grad = b.grad = torch.full(a.shape, 0.5)
    resumed.step()
    ref.step()
    for a, b in zip(params, p_ref):
        assert torch.equal(a, b)


def test_a_method_torch_does_not_wrap_stays_as_it_is():
    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:  # not torch's wrapper
            raise RuntimeError("own")

    plain = om.without_dynamo_import(Own)
    assert plain.zero_grad is Own.zero_grad
    assert plain.add_param_group is not torch.optim.SGD.add_param_group  # unwrapped


CHILD = """
import sys, torch
from recscale.config import load_config
from recscale.train.optimizers import build_dense_optimizer

cfg = load_config("debug")
for name in ("sgd", "adam", "adagrad"):
    cfg.optimizer.name = name
    p = [torch.nn.Parameter(torch.randn(64, 32))]
    opt = build_dense_optimizer(cfg.optimizer, p)
    p[0].grad = torch.ones(64, 32)
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
# the same wrapper around a TorchDispatchMode's __torch_dispatch__: a bf16 run's GEMMs
# where the CPU has no bf16 instructions (train/precision.py)
from recscale.train.precision import EmulatedBF16Gemms

a = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
with EmulatedBF16Gemms():
    (a @ a).float().sum().backward()
print("torch._dynamo" in sys.modules)
"""


def test_the_dense_optimizers_and_emulated_bf16_gemms_never_import_dynamo():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]
