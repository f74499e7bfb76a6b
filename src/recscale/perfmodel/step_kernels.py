"""The kernels of one rank's step, stage by stage, as the forecast (``forecast.py``)
charges them: each kernel the longer of its arithmetic and its memory traffic, plus a
fixed cost; a GEMM by tiles and waves (NeuSight), its output tile's store after its
main loop; the MLPs, the interaction and the loss of a rank's samples as a framework
(``systems.System``) runs them. Pure arithmetic, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recscale.config.schema import Config
from recscale.modules.interaction_padding import PAD_MULTIPLE, gram_multiple
from recscale.perfmodel.devices import DeviceSpec
from recscale.perfmodel.systems import BENCH_STAGES, System

STAGES = (
    "mlp_gemm",
    "mlp_elementwise",
    "interaction",
    "embedding_forward",
    "embedding_update",
    "all_to_all",
    "all_reduce",
    "dense_optimizer",
    "loss",
    "host",
)
COLLECTIVES = ("all_to_all", "all_reduce")
# A kernel's bench stage (systems.BENCH_STAGES): an embedding or optimizer kernel's is
# its own stage's; the dense model's is the phase its caller names (StepKernels.phase).
_BENCH_OF = {
    "embedding_forward": "lookup",
    "embedding_update": "sparse",
    "dense_optimizer": "dense_opt",
}


@dataclass(frozen=True)
class Efficiency:
    gemm: float  # share of the peak a full wave of tiles reaches (cuBLAS / oneDNN)
    tile: tuple[int, int]  # the output tile one unit computes at a time
    stream: float  # share of the memory rate a streaming kernel reaches
    granule: int  # bytes the memory serves at least per random access (sector / line)
    gather: float  # share of the streaming rate random rows reach (of the bytes fetched)
    cache_speedup: float  # rows of a table that fits in L2 / last-level cache: x faster
    kernel_s: float  # added to every kernel: GPU launch gap and tail, CPU op dispatch
    link: float  # share of a link a collective reaches (NCCL bus bandwidth / peak)
    latency_s: float  # a collective's fixed cost within a node
    network_latency_s: float
    # share of the streaming rate torch.cat reaches stacking [B, 1, D] and [B, F, D]
    # along dim 1 (the dot interaction's input): an H200 profile of DLE's shape ran
    # CatArrayBatchedCopy at 1.66 TB/s (0.35 of HBM's peak, 0.41 of the streaming rate;
    # docs/perfmodel.md); on a CPU no such measurement: the streaming rate
    stack: float = 1.0


# Sources of the GPU terms: cuBLAS reaches ~0.7-0.8 of the dense tensor-core peak on
# large GEMMs (NVIDIA's published cuBLAS figures; 0.7 taken); HBM streams at ~0.85-0.9
# of its peak (STREAM-like kernels) and random 128-512 byte rows at ~0.6-0.7 of it
# (FBGEMM's TBE benchmarks report that range); a kernel boundary (launch gap + the tail
# of the last wave) costs a few microseconds. CPU terms: oneDNN ~0.65 of the FMA peak,
# STREAM ~0.75 of the DDR peak, random rows ~0.6 of that, ~10 us an eager op's dispatch.
GPU = Efficiency(0.70, (128, 128), 0.85, 32, 0.75, 2.0, 2e-6, 0.80, 15e-6, 30e-6, 0.41)
CPU = Efficiency(0.65, (64, 64), 0.75, 64, 0.60, 2.0, 10e-6, 0.70, 40e-6, 60e-6)
EFFICIENCY = {"gpu": GPU, "cpu": CPU}


class StepKernels:
    """Kernels of one rank's step, stage by stage."""

    def __init__(self, dev: DeviceSpec, eff: Efficiency, precision: str) -> None:
        self.dev, self.eff = dev, eff
        self.gemm_precision = "fp32" if dev.kind == "cpu" and precision == "tf32" else precision
        self.act = 2 if precision in ("bf16", "fp16", "fp8") else 4  # activation bytes
        self.bw = dev.memory_gbps * 1e9
        self.stages: dict[str, float] = {s: 0.0 for s in STAGES}
        self.stage_kernels: dict[str, int] = dict.fromkeys(STAGES, 0)
        # the same kernels by bench stage (BENCH_STAGES): seconds and counts
        self.bench: dict[str, float] = dict.fromkeys(BENCH_STAGES, 0.0)
        self.bench_kernels: dict[str, int] = dict.fromkeys(BENCH_STAGES, 0)
        self.bench_first: dict[str, float] = dict.fromkeys(BENCH_STAGES, 0.0)  # its first kernel's
        self.phase = "forward"  # the dense model's kernels: "forward" or "backward"
        self.a2a = self.ar = 0.0  # bytes this rank sends: all-to-all, all-reduce (tables)
        # the all-to-all's bytes as they travel, where a system's exchange sets them
        # (System.exchange = "partials"); None: ``a2a``, counted in fp32, at the wire's
        self.a2a_bytes: float | None = None

    @property
    def kernels(self) -> int:
        """Kernels this rank's step launches."""
        return sum(self.stage_kernels.values())

    def absorb(self, other: StepKernels) -> None:
        """Add ``other``'s kernels and bytes sent to this rank's."""
        for k, v in other.stages.items():
            self.stages[k] += v
        for k, v in other.stage_kernels.items():
            self.stage_kernels[k] += v
        for k in BENCH_STAGES:
            self.bench[k] += other.bench[k]
            self.bench_kernels[k] += other.bench_kernels[k]
            self.bench_first[k] = self.bench_first[k] or other.bench_first[k]
        self.a2a += other.a2a
        self.ar += other.ar

    def kernel(self, stage: str, seconds: float, forward_share: float | None = None) -> None:
        """One kernel of ``stage`` taking ``seconds`` plus the fixed cost of a kernel;
        ``forward_share``: a dense kernel whose work is that share forward, the rest
        backward (counted as a backward kernel)."""
        t = seconds + self.eff.kernel_s
        self.stages[stage] += t
        self.stage_kernels[stage] += 1
        bench = _BENCH_OF.get(stage, self.phase)
        if forward_share is not None and bench in ("forward", "backward"):
            self.bench["forward"] += t * forward_share
            self.bench["backward"] += t * (1.0 - forward_share)
            bench = "backward"
        else:
            self.bench[bench] += t
        if not self.bench_kernels[bench]:
            self.bench_first[bench] = t
        self.bench_kernels[bench] += 1

    def stream(
        self, stage: str, nbytes: float, share: float = 1.0, forward_share: float | None = None
    ) -> None:
        """A kernel moving ``nbytes`` at the streaming rate (``share`` of it)."""
        self.kernel(stage, nbytes / (self.bw * self.eff.stream * share), forward_share)

    def gemm(self, stage: str, m: int, n: int, k: int) -> None:
        """One GEMM C[m, n] = A[m, k] B[k, n] by tiles and waves: the main loops (the
        waves' arithmetic, or the operands' bytes if longer), then the output's store -
        a tile's epilogue writes after its own main loop, so the store adds (split-K:
        the partial sums written, read back and the sum written)."""
        e, units = self.eff, self.dev.units
        tm, tn = e.tile
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        split = 1
        if tiles < units:  # split the reduction over idle units, >= 128 deep a part
            split = max(1, min(units // tiles, k // 128))
        waves = math.ceil(tiles * split / units)
        per_unit = self.dev.peak_flops(self.gemm_precision) * e.gemm / units
        compute = waves * 2.0 * tm * tn * math.ceil(k / split) / per_unit
        rate = self.bw * e.stream
        loads = (m * k + k * n) * self.act / rate
        store = m * n * self.act * (1 if split == 1 else 3) / rate
        self.kernel(stage, max(compute, loads) + store)

    def batched(self, stage: str, flops: float, nbytes: float, aligned: bool = True) -> None:
        """A batched small-matrix product (the dot interaction): its bytes or its flops
        at half the GEMM rate (small tiles fill a tensor core / vector unit poorly).
        ``aligned=False``: leading dimensions not a multiple of 16 bytes, which cuBLAS
        runs on the FP32 cores whatever the precision (an H200 profile: 27 x 27 x 128
        batches in TF32 at 15-17 TFLOP/s, FP32 FFMA kernels)."""
        precision = self.gemm_precision if aligned or self.dev.kind == "cpu" else "fp32"
        rate = self.dev.peak_flops(precision) * self.eff.gemm * 0.5
        self.kernel(stage, max(flops / rate, nbytes / (self.bw * self.eff.stream)))

    def gather(self, stage: str, rows: float, row_bytes: float, cached: float = 0.0) -> None:
        """``rows`` random rows of ``row_bytes`` (``cached`` of them from a table that
        fits in the last-level cache), fetched in whole granules."""
        g = self.eff.granule
        fetched = math.ceil(row_bytes / g) * g
        rate = self.bw * self.eff.stream * self.eff.gather
        t = (rows - cached) * fetched / rate + cached * fetched / (rate * self.eff.cache_speedup)
        self.kernel(stage, t)


def _mlp(
    s: StepKernels, sysm: System, b: int, k: int, widths: list[int], first_dgrad: bool, relu=True
) -> int:
    """An MLP's kernels (with ``relu``: a ReLU after every layer but a last width-1 one,
    the logit); its parameters. The bias rides in the GEMM; what the epilogue does not
    fuse (``System.epilogue``) reads and writes the layer's output again."""
    params = 0
    for i, n in enumerate(widths):
        act = relu and not (i == len(widths) - 1 and n == 1)
        out = b * n * s.act
        s.phase = "forward"
        s.gemm("mlp_gemm", b, n, k)
        if act and sysm.epilogue != "fused":
            s.stream("mlp_elementwise", 2 * out)  # (bias +) ReLU: read, write
        s.phase = "backward"
        if i > 0 or first_dgrad:
            s.gemm("mlp_gemm", b, k, n)  # data gradient
        s.gemm("mlp_gemm", k, n, b)  # weight gradient
        if sysm.epilogue == "eager":
            if act:
                s.stream("mlp_elementwise", 3 * out)  # dReLU: read 2, write 1
            s.stream("mlp_elementwise", out)  # bias gradient: a reduction
        elif sysm.epilogue == "apex":  # dReLU and the bias gradient in one kernel
            s.stream("mlp_elementwise", (3 if act else 1) * out)
        params += k * n + n
        k = n
    s.phase = "forward"
    return params


def bottom_mlp(s: StepKernels, cfg: Config, sysm: System, b: int) -> int:
    """The bottom MLP over ``b`` samples; its parameters."""
    m = cfg.model
    if not m.num_dense_features:
        return 0
    return _mlp(s, sysm, b, m.num_dense_features, m.bottom_mlp, False)


def dense_side(
    s: StepKernels, cfg: Config, sysm: System, b: int, dims: list[int], bottom: bool = True
) -> tuple[int, int]:
    """MLPs (``bottom``: the bottom one too), interaction, loss of a rank's B samples;
    (parameters, activation values)."""
    m = cfg.model
    f = len(dims)
    dense = m.bottom_mlp[-1] if m.num_dense_features and m.bottom_mlp else 0
    params = bottom_mlp(s, cfg, sysm, b) if bottom else 0
    emb = sum(dims)
    acts = sum(m.bottom_mlp) + sum(m.top_mlp)
    gpu = s.dev.kind != "cpu"
    if m.interaction == "dot":
        d = dims[0]
        k = f + (1 if dense else 0)
        pairs = k * (k - 1) // 2 + (k if m.interaction_self else 0)
        width = -(-(pairs + (d if dense else 0)) // PAD_MULTIPLE) * PAD_MULTIPLE
        if sysm.fused_interaction:
            x = b * k * d * s.act
            if sysm.concat_features:
                s.stream("interaction", 2 * x, s.eff.stack)  # the features stacked by a copy
            s.batched("interaction", 2.0 * b * k * k * d, x + b * width * s.act)
            s.phase = "backward"
            s.batched("interaction", 4.0 * b * k * k * d, 2 * x + b * width * s.act)
        else:
            # rows padded as modules/interaction.gram_row_multiple pads them
            mult = gram_multiple(sysm.gram == "padded" and gpu, s.act == 2)
            kp = -(-k // mult) * mult
            aligned = kp * s.act % 16 == 0
            x, z = b * kp * d * s.act, b * kp * kp * s.act
            s.stream("interaction", 2 * x, s.eff.stack)  # stack the features (torch.cat)
            # Z = T T^T: the GEMM loads T as both operands, two streams of its tiles
            s.batched("interaction", 2.0 * b * kp * kp * d, 2 * x + z, aligned)
            s.stream("interaction", z + 2 * b * width * s.act)  # triangle gather + concat
            s.phase = "backward"
            s.stream("interaction", z + b * width * s.act)  # its gradient scattered
            if sysm.gram == "padded":
                s.stream("interaction", 3 * z)  # dZ + dZ^T
                s.batched("interaction", 2.0 * b * kp * kp * d, 2 * x + z, aligned)
            else:  # a bmm for each operand, then their T gradients added (one strided)
                s.batched("interaction", 4.0 * b * kp * kp * d, 2 * (x + z), aligned)
                s.stream("interaction", 3 * x)
            s.stream("interaction", 2 * x)  # split the features' gradients
        acts += k * d + k * k + width
    elif m.interaction == "dcnv2":
        width = emb + dense
        s.stream("interaction", 2 * b * width * s.act)  # the concatenation
        for _ in range(m.dcn_layers):
            # a cross layer's two low-rank products, no activation between them
            params += _mlp(s, sysm, b, width, [m.dcn_rank], True, relu=False)
            params += _mlp(s, sysm, b, m.dcn_rank, [width], True, relu=False)
            passes = 4 if sysm.epilogue == "fused" else 12  # x0 * y + x and its gradients
            s.stream("interaction", passes * b * width * s.act, forward_share=1 / 3)
            acts += 2 * width + m.dcn_rank
        acts += width
    else:
        width = emb + dense
        s.stream("interaction", 4 * b * width * s.act, forward_share=0.5)
        acts += width
    s.phase = "forward"
    params += _mlp(s, sysm, b, width, m.top_mlp, True)
    for phase in ("forward", "backward", "forward"):  # sigmoid BCE forward, backward, mean
        s.phase = phase
        s.stream("loss", 4 * b * 4)
    s.phase = "forward"
    return params, acts
