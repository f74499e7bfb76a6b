"""What a training framework does that changes a step (``forecast.System``): the
forecast is for recscale's own step (``RECSCALE``); the others describe the published
systems ``benchmarks/forecast_validation.py`` checks the forecast against, each field
from that system's own code or documentation (the notes say where) or, where it
publishes nothing, an assumption said as one.

Host time on a GPU (``host``): an eager framework dispatches ``host_ops_per_kernel``
framework ops (views, detaches and Python-side bookkeeping included) for each kernel
the step launches, each costing the host ``host_op_s`` (default
``forecast.EAGER_OP_S``, learned from recscale's own step). ``serial``: the step
waits on the device mid-step (``.item()``, sizes read back), so host and device time
add; ``overlap``: the host issues kernels while the device runs the earlier ones, so
only the host time beyond the device's shows - over the whole step when it waits once a
step, else in each part between its waits (``wait_before``: the stage at whose start
the step reads a value back); ``graph``: a captured CUDA graph, no host time.
"""

from __future__ import annotations

from dataclasses import dataclass

EPILOGUES = ("eager", "apex", "fused")
UPDATES = ("fused", "sparse_add")
HOSTS = ("serial", "overlap", "graph")
GRAMS = ("autograd", "padded")
WAITS = ("", "embedding_update", "dense_optimizer")
DENSE_OPTIMIZERS = ("fused", "torch")
EXCHANGES = ("pooled", "partials")
# The stages ``recscale bench throughput`` times on a device's stream, in a step's order:
# the lookup, the dense model's forward and backward, the tables' update, the dense
# optimizer (``step_kernels.StepKernels.bench``).
BENCH_STAGES = ("lookup", "forward", "backward", "sparse", "dense_opt")


@dataclass(frozen=True)
class System:
    name: str
    # bias + ReLU and their gradients: "eager" - separate ReLU, dReLU and bias-grad
    # kernels; "apex" - one bias+ReLU kernel forward, one dReLU+bias-grad kernel back;
    # "fused" - inside the GEMM's epilogue (cuBLASLt RELU_BIAS / DRELU_BGRAD)
    epilogue: str = "eager"
    fused_interaction: bool = False  # one dot-interaction kernel forward, one backward
    concat_features: bool = False  # the interaction's input is stacked by a copy first
    # an unfused dot interaction's Gram matrix T T^T: "autograd" - torch.bmm as it comes
    # (K = 27 rows: leading dimensions cuBLAS cannot run on tensor cores) and autograd's
    # backward, two bmm's and a strided add; "padded" - rows padded to 16 bytes on a GPU
    # and one bmm back, (dZ + dZ^T) T (modules/interaction.py)
    gram: str = "autograd"
    # the tables' update: "fused" - ids sorted, each row updated once in place (FBGEMM
    # TBE, recscale's Triton kernel, HugeCTR); "sparse_add" - a sparse gradient
    # materialised in fp32 and added into the table by index_add_ (torch.optim.SGD)
    embedding_update: str = "fused"
    pooled_in_act: bool = False  # the lookup writes pooled vectors in the activation dtype
    # hybrid parallel as DLE runs it: the bottom MLP on rank 0 over the global batch,
    # rank 0 holding no table beyond 4 ranks
    bottom_on_one_rank: bool = False
    comm_overlap: float = 0.0  # share of the all-to-all hidden behind compute
    table_bytes: int = 4  # bytes a stored embedding value
    # bytes of optimizer state a stored value where the system keeps its own whatever the
    # config's sparse optimizer (None: the config's - row-wise Adagrad's 4 bytes a row)
    table_state_bytes: int | None = None
    wire_bytes: int | None = None  # bytes a pooled value / dense gradient sent (None:
    # the precision's activation bytes - 2 under bf16/fp16, else 4)
    host: str = "serial"
    host_ops_per_kernel: float = 0.0
    # host seconds an op of this system costs (None: ``forecast.EAGER_OP_S``, learned
    # from recscale's own step); a framework's ops differ in the Python around them
    host_op_s: float | None = None
    # "overlap" with a read-back mid-step: the stage at whose start the host waits for
    # the device ("" - none: one wait a step); the stages from there on
    # (``forecast.AFTER_WAIT``) are the step's second part
    wait_before: str = ""
    # fp16 under torch's GradScaler: its step reads found_inf back (.item()), a wait
    # mid-step, so host and device time add whatever ``host`` says
    scaler_waits: bool = False
    # the host time of a kernel in each bench stage (step_kernels.BENCH_STAGES: lookup,
    # forward, backward, sparse, dense_opt) against the step's mean, which
    # host_ops_per_kernel x host_op_s prices (None: the same in every stage)
    host_stage_weights: tuple[float, ...] | None = None
    # bench stages that read a value back after their first kernel, before their last
    serial_stages: tuple[str, ...] = ()
    # the MLPs' optimizer on a GPU: "fused" - one pass over the parameters; "torch" -
    # torch.optim as recscale builds it (train/optimizers.py): fused kernels for SGD and
    # Adam, Adagrad as torch's foreach passes (it has no fused CUDA kernel)
    dense_optimizer: str = "fused"
    # the tables' traffic between ranks: "pooled" - the plan's all-to-all (ids to the
    # tables' ranks, pooled vectors back, their gradients out again); "partials" - every
    # table's rows over all ranks by id modulo the world, every rank scanning the global
    # batch's ids, partial sums forward and each id's gradient back (perfmodel/exchange.py)
    exchange: str = "pooled"
    # input work a step on the training thread, for the global batch: seconds a one-hot
    # id on one core (serial), and core-seconds a multi-hot id spread over the device's
    # cores; on a CPU the step waits for it (the forecast's ``host`` stage)
    input_serial_s_per_id: float = 0.0
    input_parallel_s_per_id: float = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        for key, value, allowed in (
            ("epilogue", self.epilogue, EPILOGUES),
            ("embedding_update", self.embedding_update, UPDATES),
            ("host", self.host, HOSTS),
            ("gram", self.gram, GRAMS),
            ("wait_before", self.wait_before, WAITS),
            ("dense_optimizer", self.dense_optimizer, DENSE_OPTIMIZERS),
            ("exchange", self.exchange, EXCHANGES),
        ):
            if value not in allowed:
                raise ValueError(f"System.{key}: {value!r} is not one of {', '.join(allowed)}")
        weights = self.host_stage_weights
        if weights is not None and (
            len(weights) != len(BENCH_STAGES) or not all(w > 0 for w in weights)
        ):
            raise ValueError(
                f"System.host_stage_weights: one positive weight a bench stage "
                f"({', '.join(BENCH_STAGES)}), got {weights!r}"
            )
        for stage in self.serial_stages:
            if stage not in BENCH_STAGES:
                raise ValueError(
                    f"System.serial_stages: {stage!r} is not one of {', '.join(BENCH_STAGES)}"
                )


# recscale on a GPU: eager PyTorch (separate ReLU / dReLU / bias-grad kernels, a bmm
# interaction over rows padded to tensor-core alignment), the Triton lookup and fused
# update, fp32 tables and wire, no overlap.
# Host: one training step of config A dispatches 195 aten ops (counted on the CPU by
# benchmarks/count_host_ops.py, kernels=torch: 194, plus the Gram rows' zero padding a
# GPU adds) for the 56 kernels this forecast lists. It waits on the device three times
# a step (benchmarks/gpu_syncs.py on an H200, 2026-11-26, configs A and B, DLE's and
# MLPerf's models alike): the ids' bounds check at the lookup's start - the step's own
# wait - and the fused update's two read-backs (the distinct ids' count; the rows'
# bounds and the largest row count) after the backward. So the host's time hides
# behind the device's in the forward and backward, and again in the update and the
# optimizer, each apart.
# A kernel's host time differs by stage (host_stage_weights): the lookup's and the
# update's few kernels carry Python bookkeeping and read-backs (6 and 6 ops a kernel,
# count_host_ops.py --stages), the forward's run through modules and autocast, the
# backward's through autograd's C++ engine, the optimizer's one fused update through
# torch.optim's Python. Learned from config A at batch 16,384 in TF32 on three H200
# boxes (trees f2be6a5, ce18e55, ec9e6b3; host-bound, so a stage's event time is its
# host time, the update's 0.04 ms of device work aside): the stages' shares of the
# step 0.150-0.155, 0.258-0.286, 0.397-0.418, 0.113-0.126, 0.048-0.049 over 3, 18, 31,
# 3 and 1 of the forecast's 56 kernels. The update reads back twice after sorting its
# ids, before its fused kernel (serial_stages). Config B, DLE's model and DCNv2 are
# held out (benchmarks/forecast_stages.py, docs/perfmodel.md).
RECSCALE = System(
    "recscale",
    gram="padded",
    wire_bytes=4,
    host="overlap",
    host_ops_per_kernel=195 / 56,
    wait_before="embedding_update",
    host_stage_weights=(2.87, 0.85, 0.74, 2.22, 2.74),
    serial_stages=("sparse",),
    dense_optimizer="torch",
    note="eager PyTorch: unfused epilogues, bmm interaction, fp32 tables and wire",
)

# NVIDIA DeepLearningExamples, PyTorch DLRM (github.com/NVIDIA/DeepLearningExamples,
# PyTorch/Recommendation/DLRM, dlrm/scripts/main.py and dlrm/nn): apex's MLP (cuBLAS
# GEMM, then one bias+ReLU kernel; back, one dReLU+bias-grad kernel), the CUDA dot
# interaction over the bottom output and embeddings stacked by torch.cat, one joint
# table gathered by a CUDA kernel that writes the activation dtype, whose backward
# copies the pooled gradient into an fp32 sparse tensor that torch.optim.SGD adds into
# the table (index_add_), GradScaler unscaling it under AMP; hybrid parallel with the
# bottom MLP on rank 0 (dlrm/utils/distributed.py::get_device_mapping), all-to-all not
# overlapped; torch.cuda.synchronize() once a step, and under AMP GradScaler.step's
# found_inf read-back mid-step. Assumed: recscale's host ops a
# kernel (an eager PyTorch step).
DLE = System(
    "dle",
    epilogue="apex",
    fused_interaction=True,
    concat_features=True,
    embedding_update="sparse_add",
    pooled_in_act=True,
    bottom_on_one_rank=True,
    host="overlap",
    host_ops_per_kernel=195 / 56,
    scaler_waits=True,
    note="NVIDIA DeepLearningExamples PyTorch DLRM: apex MLP, CUDA interaction, sparse SGD",
)
# HugeCTR's MLPerf DLRM-DCNv2 (MLCommons training results v4.0 / v5.0, NVIDIA's
# submission; HugeCTR release notes: fused GEMM + bias + ReLU forward and GEMM + dReLU +
# bias-grad backward, embedding and bottom-MLP overlap, whole-iteration CUDA graph).
# Assumed: half the all-to-all hidden, fp32 tables, fp16 pooled vectors and wire.
HUGECTR = System(
    "hugectr",
    epilogue="fused",
    fused_interaction=True,
    pooled_in_act=True,
    comm_overlap=0.5,
    host="graph",
    note="HugeCTR (MLPerf): fused epilogues, CUDA graph, embedding / bottom-MLP overlap",
)
# TorchRec's DLRM example (pytorch/torchrec examples/dlrm, FBGEMM TBE lookup and fused
# update, TrainPipelineSparseDist: the ids' all-to-all of batch t+1 overlaps step t;
# InteractionArch: torch.bmm over the stacked features, autograd's backward).
# Host: a step of TorchRec 1.8's DLRM (26 one-hot tables, 8 ranks, gloo) dispatches 391
# ops on rank 0 (benchmarks/count_host_ops.py; 373 on 2 ranks, 379 on 4) for the 61
# kernels listed here, 16 of them reading a value back (.item(): the all-to-alls'
# splits), so host and device time add. Its host time an op is learned from its own
# host-bound point (8 GPUs at 256 samples each: 7.20 ms a step published against
# 0.4 ms of device work forecast): 16.7 us - less than recscale's 25.3, its count
# holding more views and detaches around each kernel. Assumed: the ids' share of the
# all-to-all hidden (~10%).
TORCHREC = System(
    "torchrec",
    comm_overlap=0.1,
    wire_bytes=4,
    host="serial",
    host_ops_per_kernel=391 / 61,
    host_op_s=16.7e-6,
    note="TorchRec DLRM example: eager PyTorch, FBGEMM TBE, pipelined input dist",
)
# Intel's MLPerf DLRM-DCNv2 on Xeon (MLCommons training results v3.1, Intel's
# submission, Intel/benchmarks/dlrm_v2/torchrec_cpu: IPEX, bf16 on AMX, oneDNN GEMMs
# with fused post-ops). On a CPU the host is the device: every op pays its dispatch
# (Efficiency.kernel_s). Its embedding (ipex.patch, MergFreqEmbeddingBag and its
# spsfwd/spsbwd kernels): every table's rows over the 8 ranks by id modulo 8 (the
# forecast's modulo_plan), fp32 rows under element-wise Adagrad with a bf16 sum
# (table_state_bytes), every rank scanning the global batch's ids, partial sums sent
# forward and each id's gradient back in bf16 with int64 indices (exchange="partials").
# Its input (data/single_hot_criteo.py, multi_hot.py): every rank loads the global batch
# (rank 0 of world size 1) - the ids hashed (% the table sizes) and transposed by numpy
# on the training thread, 5.2-6.0 ns a one-hot id on one core of host A (python
# benchmarks/ipex_input.py, four runs, 2026-11-29; their median below); then expanded to
# multi-hot ids by 26 F.embedding gathers from int32 tables and widened to int64, torch
# ops spread over the socket: 3.8-6.6 core-ns a multi-hot id there. Not priced: the hash
# maps' per-id work (robin_hood maps keyed by (sample, table) forward and by id
# backward) and the backward's scan, in which every thread reads all the rank's ids and
# keeps those of its own share (two 64-bit divisions an id on each thread).
IPEX = System(
    "ipex",
    epilogue="fused",
    exchange="partials",
    table_state_bytes=2,
    input_serial_s_per_id=5.8e-9,
    input_parallel_s_per_id=5.9e-9,
    note="Intel Extension for PyTorch (MLPerf): bf16 AMX GEMMs with fused post-ops, "
    "row-wise-by-modulo tables with partial sums exchanged",
)

SYSTEMS = {s.name: s for s in (RECSCALE, DLE, HUGECTR, TORCHREC, IPEX)}
