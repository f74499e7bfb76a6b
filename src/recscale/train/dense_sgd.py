"""torch's SGD for the dense parameters on a CPU, its step one native pass
(``native/dense_sgd.c``) that also writes the bf16 copies the bf16 node's next forward
reads (``modules/bf16_weights.py``) for the weights a forward read in bf16.

Where the native pass runs: the native library on a CPU with AVX2 (or AVX-512), every
parameter with a gradient fp32, contiguous and on the CPU, no momentum, Nesterov,
maximize or tensor learning rate, and no closure. Elsewhere it is ``torch.optim.SGD``'s
own step. Either way the weights come out bit for bit as ``torch.optim.SGD`` leaves them
(tested), each with its version counter bumped as an in-place op bumps it, and the
``state_dict`` is SGD's.

Why: on 2 vCPUs (host A, docs/performance.md) config A's step with torch's SGD took
0.37 ms (15 ``add_`` on one thread) and in bf16 the forward's 15 casts to bf16 another
0.27; the pass takes 0.24 in fp32 and, writing the copies, ~0.45 for both. Config B:
1.1 -> 0.51 ms in fp32, 2.1 -> 0.9 in bf16 (two threads).
"""

from __future__ import annotations

import ctypes

import torch
from torch.autograd.graph import increment_version

from recscale import native
from recscale.modules import bf16_weights
from recscale.torch_threads import torch_threads_set
from recscale.train.optimizer_methods import SGD

USE = True  # False: torch's step and the forward's casts (tests; benchmarks/step_ab.py)
BLOCK = 16384  # elements a unit of the parallel split
# Below this many parameters one thread runs the native pass (the other thread's
# hand-off costs more than it saves: config A's 476k, 2 vCPUs), and below
# ONE_THREAD_BELOW torch's own step (a parallel region per tensor: there Adam on A's
# parameters took 0.95 -> 0.35 ms on one thread, SGD 0.30 -> 0.12; at 5M parameters in
# four tensors two threads win by 7-15%).
_MIN_PARALLEL = 1 << 20
ONE_THREAD_BELOW = 1 << 22


class SGDWithBF16Copies(SGD):
    """``torch.optim.SGD`` (same arguments, state and results) with the native step
    above where it applies; torch's step on one thread for fewer than
    ``ONE_THREAD_BELOW`` parameters."""

    def step(self, closure=None):  # noqa: D102 - torch's contract
        params = self._native_params() if closure is None else None
        if params is None:
            n = sum(p.numel() for g in self.param_groups for p in g["params"])
            if n >= ONE_THREAD_BELOW:
                return super().step(closure)
            with torch_threads_set(1):
                return super().step(closure)
        for group, ps in params:
            self._native_step(ps, float(group["lr"]), float(group["weight_decay"]))
        return None

    @staticmethod
    def _native_step(ps: list[torch.Tensor], lr: float, wd: float) -> None:
        """One ``recscale_sgd_bf16`` pass over ``ps``, keeping the copies it writes.
        (ctypes arrays, not tensors, carry the addresses: 4 tensors built from lists
        took 0.24 ms a step on 2 vCPUs, the pass itself 0.23.)"""
        addresses = ctypes.c_int64 * len(ps)
        copies = [
            torch.empty_like(p, dtype=torch.bfloat16) if bf16_weights.wanted(p) else None
            for p in ps
        ]
        sizes = [p.numel() for p in ps]
        arrays = (
            addresses(*[p.data_ptr() for p in ps]),
            addresses(*[p.grad.data_ptr() for p in ps]),
            addresses(*[c.data_ptr() if c is not None else 0 for c in copies]),
            addresses(*sizes),
        )
        ptrs = [ctypes.addressof(a) for a in arrays]
        units = sum(-(-n // BLOCK) for n in sizes)

        def args(_p: int, lo: int, hi: int) -> tuple:
            return (len(ps), *ptrs, BLOCK, lr, wd, lo, hi)

        threads = torch.get_num_threads() if sum(sizes) >= _MIN_PARALLEL else 1
        lib = native.library()
        if any(native.parallel_call(lib, "recscale_sgd_bf16", units, args, threads, "sgd")):
            raise RuntimeError("recscale_sgd_bf16 declined on a CPU with AVX2")
        increment_version(ps)  # as an in-place op would (autograd's checks, the kept copies)
        for p, c in zip(ps, copies):
            if c is not None:
                bf16_weights.keep(p, c)

    def _native_params(self) -> list[tuple[dict, list[torch.Tensor]]] | None:
        """Each group with its parameters that have gradients, where the native step
        applies to all of them; else None."""
        if not (USE and native.cpu_features() & native.CPU_AVX2):
            return None
        out = []
        for group in self.param_groups:
            if (
                group["momentum"] != 0
                or group["nesterov"]
                or group["maximize"]
                or group.get("differentiable", False)
                or isinstance(group["lr"], torch.Tensor)
            ):
                return None
            ps = [p for p in group["params"] if p.grad is not None]
            for p in ps:
                g = p.grad
                if not (
                    p.device.type == "cpu"
                    and p.dtype == torch.float32
                    and p.is_contiguous()
                    and not g.is_sparse
                    and g.dtype == torch.float32
                    and g.is_contiguous()
                    and g.shape == p.shape
                ):
                    return None
            out.append((group, ps))
        return out
