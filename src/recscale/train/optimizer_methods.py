"""torch's dense optimizers without the import of ``torch._dynamo`` their first calls make.

torch wraps four methods of ``torch.optim.Optimizer`` - ``add_param_group`` (which
``__init__`` calls), ``zero_grad``, ``state_dict`` and ``load_state_dict`` - in
``torch._disable_dynamo``, so that ``torch.compile`` never traces them, and each
optimizer's ``step`` in ``_use_grad_for_differentiable`` (autograd off during the step,
plus graph breaks for ``torch.compile``). Both import ``torch._dynamo`` when first
called: 1.8 s on this project's 2-vCPU EPYC (``import torch`` itself takes 1.8), paid
by every ``recscale train`` and ``bench`` before its first step (a one-step
``criteo_kaggle`` run and its evaluation: 7.6-7.7 s with it, 4.3-4.7 without, in
docs/performance.md). recscale never compiles
an optimizer, and outside ``torch.compile`` those wrappers add nothing but the import
(the graph breaks do nothing): :func:`without_dynamo_import` gives a subclass whose
methods are the functions underneath - ``step`` with autograd set as torch's wrapper
sets it - the same code, state and results. A method another torch version wraps
otherwise stays as torch has it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
# where torch defines its two wrappers: _disable_dynamo's closure ``inner`` and
# _use_grad_for_differentiable's ``_use_grad``
_DISABLE_DYNAMO_FILE = os.path.join("torch", "_compile.py")
_USE_GRAD_FILE = os.path.join("torch", "optim", "optimizer.py")

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


def _wrapped_by(method: object, wrapper: str, path: str) -> Callable | None:
    """The function under ``method`` where ``method`` is torch's closure ``wrapper``
    (defined in the file ending in ``path``), else None."""
    code = getattr(method, "__code__", None)
    func = getattr(method, "__wrapped__", None)
    if func is None or code is None or code.co_name != wrapper:
        return None
    return func if code.co_filename.endswith(path) else None


def _plain_step(func: Callable) -> Callable:
    """``func`` (an optimizer's step) with autograd set as ``_use_grad_for_differentiable``
    sets it, without that wrapper's import."""

    def plain(self, closure=None):  # noqa: ANN001 - torch's contract
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return func(self, closure)

    return functools.update_wrapper(plain, func)


def without_dynamo_import(cls: type[OptimizerT]) -> type[OptimizerT]:
    """A subclass of the optimizer ``cls`` (same name) whose wrapped methods are the
    functions underneath (module doc)."""
    methods: dict[str, object] = {}
    for name in _WRAPPED:
        plain = _wrapped_by(getattr(cls, name), "inner", _DISABLE_DYNAMO_FILE)
        if plain is not None:
            methods[name] = plain
    step = _wrapped_by(cls.step, "_use_grad", _USE_GRAD_FILE)
    if step is not None:
        methods["step"] = _plain_step(step)
    methods.update(__doc__=cls.__doc__, __module__=__name__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), methods)


SGD = without_dynamo_import(torch.optim.SGD)
Adam = without_dynamo_import(torch.optim.Adam)
Adagrad = without_dynamo_import(torch.optim.Adagrad)
