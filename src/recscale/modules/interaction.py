"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Inputs: ``dense_BD`` ``[B, D]`` (or None when there are no dense features) and
``pooled_BX`` ``[B, sum_f D_f]`` from :class:`EmbeddingBagCollection` -- or, for the dot
interaction, ``[B, F, D]`` with any strides (``pooled_by_feature``).
"""

from __future__ import annotations

import torch
from torch import nn

from recscale.config.schema import KERNELS
from recscale.embedding import kernels
from recscale.modules import dot_interaction_cpu
from recscale.modules.interaction_padding import PAD_MULTIPLE, gram_multiple


def gram_row_multiple(x: torch.Tensor) -> int:
    """The row count ``T`` is padded to a multiple of before its Gram matrix ``T T^T``.

    On a GPU, cuBLAS runs a batched GEMM on tensor cores only when its leading
    dimensions are 16-byte aligned: ``[B, 27, 27]`` (DLRM's 26 tables + dense) fell to
    FP32 FFMA kernels even in TF32 - on an H200, 2.3 ms of DLE's 12.6 ms of kernels a step
    (benchmarks/gpu_profile.py, docs/gpu.md). Zero rows add nothing to the real pairs.
    """
    if x.device.type == "cpu":
        return 1
    try:
        autocast = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        autocast = False
    return gram_multiple(True, autocast or x.dtype in (torch.bfloat16, torch.float16))


class SymmetricGram(torch.autograd.Function):
    """``Z = T T^T`` for ``T`` ``[B, K, D]``, with a backward of one batched GEMM:
    ``dT = (dZ + dZ^T) T``. Autograd's own bmm backward takes two GEMMs (one per operand,
    both ``T``) and adds a transposed ``[B, K, D]`` gradient to a contiguous one - a
    strided add over the step's largest activation."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, t_BKD: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(t_BKD)
        return torch.bmm(t_BKD, t_BKD.transpose(1, 2))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dz_BKK: torch.Tensor) -> torch.Tensor:
        (t_BKD,) = ctx.saved_tensors
        s_BKK = dz_BKK + dz_BKK.transpose(1, 2)
        if s_BKK.dtype != t_BKD.dtype and not torch.is_autocast_enabled(t_BKD.device.type):
            s_BKK = s_BKK.to(t_BKD.dtype)  # a forward under an autocast this backward lacks
        return torch.bmm(s_BKK, t_BKD)  # under CUDA autocast, in its dtype (as forward's)


_CPU_FP32 = torch.empty(0)  # what takes_bf16_pooled asks the kernel choice about


class DotInteraction(nn.Module):
    """DLRM's dot interaction: pairwise dot products of the F(+1) vectors.

    ``T = [dense; e_1; ...; e_F]`` is ``[B, K, D]``; the output is
    ``[dense, upper_triangle(T T^T), zero pad]`` with the diagonal only if
    ``self_interaction``, padded with zero columns to a multiple of 8.
    """

    def __init__(
        self,
        num_features: int,
        dim: int,
        has_dense: bool,
        self_interaction: bool = False,
        kernel: str = "auto",
    ):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.num_features, self.dim, self.has_dense = num_features, dim, has_dense
        self.self_interaction, self.kernel = self_interaction, kernel
        k = num_features + (1 if has_dense else 0)
        iu = torch.triu_indices(k, k, offset=0 if self_interaction else 1)
        # the pairs' rows and columns in T T^T; flattened per padded row count (_pairs)
        self.register_buffer("pair_rc", iu, persistent=False)
        self.num_rows, self.num_pairs = k, iu.shape[1]
        self._flat: dict[tuple[int, torch.device], torch.Tensor] = {}
        width = self.num_pairs + (dim if has_dense else 0)
        self.out_dim = -(-width // PAD_MULTIPLE) * PAD_MULTIPLE
        self.pad = self.out_dim - width

    def _fused(self, x: torch.Tensor):
        """The fused Function to run, or None for the torch path (``embedding/kernels.py``
        picks: native C where it applies, else numba, else torch)."""
        if torch.is_autocast_enabled(x.device.type):
            return None  # under autocast the torch ops, which autocast casts to bf16
        kernel = kernels.choose_once(self, self.kernel, "interaction", x, self.dim)
        if kernel == "native":
            return dot_interaction_cpu.NativeDotInteraction
        if kernel == "numba":
            return dot_interaction_cpu.FusedDotInteraction
        return None

    def takes_bf16_pooled(self, device: torch.device) -> bool:
        """Whether the pooled vectors may come in bf16 (``pooled_by_feature(bf16=True)``):
        under bf16 autocast on a CPU whose native kernel reads them so
        (``dot_interaction_cpu.bf16_pooled_available``)."""
        if device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return False
        if torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return False
        if not dot_interaction_cpu.bf16_pooled_available(self.dim, self.num_rows):
            return False
        # the kernel the fp32 row takes (chosen once per device and dtype)
        kernel = kernels.choose_once(self, self.kernel, "interaction", _CPU_FP32, self.dim)
        return kernel == "native"

    def forward(self, dense_BD: torch.Tensor | None, pooled_BX: torch.Tensor) -> torch.Tensor:
        if pooled_BX.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # bf16 on a CPU: the products here are a few % of the step's FLOPs, and
            # torch's bf16 bmm + gather took 9.7 ms of config B's 36.5 ms forward on an
            # AVX512-BF16 host; the fp32 fused kernel is faster and exact in fp32, and
            # on AVX512-BF16 the native one writes its row in bf16 for the top MLP
            # (rounded as the MLP's cast would round it) and reads its gradient in bf16 -
            # and takes bf16 pooled vectors (the sums rounded as autocast's bmm would
            # round them), giving their gradient in bf16 as autocast's would
            bf16_in = pooled_BX.dtype == torch.bfloat16 and self.takes_bf16_pooled(pooled_BX.device)
            with torch.autocast("cpu", enabled=False):
                if bf16_in:
                    d = dense_BD.to(torch.bfloat16) if dense_BD is not None else None
                    args = (self.num_features, self.dim, self.self_interaction, self.out_dim)
                    return dot_interaction_cpu.NativeDotInteraction.apply(d, pooled_BX, *args, True)
                d = dense_BD.float() if dense_BD is not None else None
                return self._interact(d, pooled_BX.float(), bf16_out=True)
        return self._interact(dense_BD, pooled_BX)

    def _interact(
        self, dense_BD: torch.Tensor | None, pooled_BX: torch.Tensor, bf16_out: bool = False
    ) -> torch.Tensor:
        fused = self._fused(pooled_BX)
        if fused is not None:
            args = (self.num_features, self.dim, self.self_interaction, self.out_dim)
            if fused is dot_interaction_cpu.NativeDotInteraction:
                bf16_out = bf16_out and dot_interaction_cpu.bf16_edges_available()
                return fused.apply(dense_BD, pooled_BX, *args, bf16_out)
            return fused.apply(dense_BD, pooled_BX, *args)
        b = pooled_BX.shape[0]
        emb_BFD = pooled_BX.reshape(b, self.num_features, self.dim)
        rows = [dense_BD.unsqueeze(1)] if self.has_dense else []
        rows.append(emb_BFD)
        m = gram_row_multiple(pooled_BX)
        kp = -(-self.num_rows // m) * m
        if kp > self.num_rows:
            rows.append(emb_BFD.new_zeros(b, kp - self.num_rows, self.dim))
        t_BKD = torch.cat(rows, dim=1) if len(rows) > 1 else emb_BFD
        z_BKK = SymmetricGram.apply(t_BKD)
        parts = [dense_BD] if self.has_dense else []
        parts.append(z_BKK.flatten(1).index_select(1, self._pairs(kp, z_BKK.device)))
        if self.pad:
            parts.append(pooled_BX.new_zeros(b, self.pad))
        return torch.cat(parts, dim=1)

    def _pairs(self, kp: int, device: torch.device) -> torch.Tensor:
        """The pairs' flat positions in a ``[kp, kp]`` Gram matrix."""
        key = (kp, device)
        if key not in self._flat:
            rc = self.pair_rc.to(device)
            self._flat[key] = rc[0] * kp + rc[1]
        return self._flat[key]


class CatInteraction(nn.Module):
    """Concatenation: ``[dense, e_1, ..., e_F]`` (dims may differ per table)."""

    def __init__(self, embedding_out_dim: int, dense_dim: int) -> None:
        super().__init__()
        self.out_dim = embedding_out_dim + dense_dim

    def forward(self, dense_BD: torch.Tensor | None, pooled_BX: torch.Tensor) -> torch.Tensor:
        return pooled_BX if dense_BD is None else torch.cat([dense_BD, pooled_BX], dim=1)
