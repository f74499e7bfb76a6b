"""Check the forecast (``recscale plan --device``) against published training throughput
of DLRM-family models on machines this project does not have.

    python benchmarks/forecast_validation.py [--out DIR] [--no-plot]
    python benchmarks/forecast_validation.py --variants   # Intel's point, one term changed

Each point: a model (a preset and overrides that reproduce the published model), the
device and count, the precision, the system that ran it (``perfmodel/systems.py``: what
it does that the forecast models - fused epilogues, fused interaction, overlap, host
time) and the published samples/s with its source. Prints a table, the median and
worst |error| over the published points, and writes DIR/forecast_validation.csv and
DIR/forecast_predicted_vs_published.png (default DIR: docs/). recscale's own GPU
measurements are listed too, apart: config A set the recscale system's host time (so
it is not a check), config B is held out.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from recscale.config import load_config
from recscale.perfmodel.devices import device_spec
from recscale.perfmodel.exchange import partials_exchange_bytes
from recscale.perfmodel.forecast import EFFICIENCY, STAGES, StepKernels, forecast
from recscale.perfmodel.systems import RECSCALE, SYSTEMS
from recscale.planner.from_config import table_infos

# Criteo 1TB vocabularies (criteo_terabyte preset), capped: NVIDIA's "small" (frequency
# threshold 15, 15 GB of fp32 tables) and "large" (threshold 3, 82 GB) variants keep the
# 26 features and their order; the cap reproduces the published size at dim 128.
TB = load_config("criteo_terabyte").model.table_sizes


def capped(total_gb: float) -> list[str]:
    """--model.table_sizes with the large vocabularies capped so the fp32 dim-128 tables
    take ``total_gb``."""
    target = total_gb * 1e9 / (128 * 4)
    lo, hi = 1, max(TB)
    while lo < hi:  # the largest cap whose total stays within the target
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(min(n, mid) for n in TB) <= target else (lo, mid - 1)
    return ["--model.table_sizes=" + ",".join(str(min(n, lo)) for n in TB)]


DLE = (
    "NVIDIA DeepLearningExamples PyTorch DLRM README, Training performance: "
    "NVIDIA DGX A100 (8x A100 80GB)"
)
MLPERF = "MLCommons MLPerf Training results"
# DLE: SGD for both; hybrid parallel = every table whole on one GPU
DLE_MODEL = [
    "--optimizer.name=sgd",
    "--embedding.optimizer=sgd",
    "--distributed.sharding=table_wise",
]


# TorchRec's DLRM example (facebookresearch/dlrm, torchrec_dlrm/README.MD, "Preliminary
# Training Results": AWS p4d.24xlarge, 8x A100 40GB, CUDA 11.0, NCCL 2.10.3; its
# --num_embeddings_per_feature, 91 GiB of fp32 tables). The 1-GPU row (tables in host
# memory behind a UVM cache) is left out: the forecast has no UVM tier.
TORCHREC_DLRM = "TorchRec DLRM example README (torchrec_dlrm), AWS p4d, 8x A100 40GB"
TORCHREC_TABLES = "--model.table_sizes=" + ",".join(
    str(n)
    for n in (45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176)
    + (345138, 10, 2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104)
    + (12606, 104, 35)
)
# (GPUs, samples a GPU, published train records/s)
TORCHREC_POINTS = [(8, 256, 284_615), (4, 4096, 1_458_176), (8, 2048, 1_671_168)]
TORCHREC_POINTS += [(8, 8192, 5_373_952)]
# host-bound (its device work ~5% of the step): sets TorchRec's host time an op
# (systems.TORCHREC.host_op_s), so it is not among the checked points
TORCHREC_HOST_FIT = 256


# recscale as its own GPU points ran (trees up to da3844c): the interaction's Gram matrix
# through autograd's bmm over 27 unpadded rows; config A dispatched 197 ops a step
# (benchmarks/count_host_ops.py at that tree) for the 56 kernels this form lists
RECSCALE_UNPADDED = replace(
    RECSCALE, name="recscale-unpadded", gram="autograd", host_ops_per_kernel=197 / 56
)
SYSTEM_OF = {**SYSTEMS, RECSCALE_UNPADDED.name: RECSCALE_UNPADDED}


@dataclass(frozen=True)
class Point:
    label: str
    config: str
    overrides: list[str]
    device: str
    world_size: int
    precision: str
    system: str
    published: float  # samples/s
    source: str
    check: bool = True  # False: the number was used to set a term of the model
    # the published machine where it differs from the catalogue's entry: (field, value)
    # pairs replacing the device's (its interconnect, say), each with its source
    device_overrides: tuple[tuple[str, float], ...] = ()


POINTS = [
    Point(
        "DLE 1x A100-80GB TF32",
        "criteo_terabyte",
        [*capped(15), *DLE_MODEL, "--train.batch_size=65536"],
        "a100-80gb",
        1,
        "tf32",
        "dle",
        2.88e6,
        DLE + ", 1 GPU, batch 64k, small model",
    ),
    Point(
        "DLE 1x A100-80GB AMP",
        "criteo_terabyte",
        [*capped(15), *DLE_MODEL, "--train.batch_size=65536"],
        "a100-80gb",
        1,
        "fp16",
        "dle",
        4.02e6,
        DLE + ", 1 GPU, batch 64k, small model",
    ),
    Point(
        "DLE 8x A100-80GB TF32",
        "criteo_terabyte",
        [*capped(82), *DLE_MODEL, "--train.batch_size=65536"],
        "a100-80gb",
        8,
        "tf32",
        "dle",
        11.4e6,
        DLE + ", 8 GPUs, 8k a GPU, large model",
    ),
    Point(
        "DLE 8x A100-80GB AMP",
        "criteo_terabyte",
        [*capped(82), *DLE_MODEL, "--train.batch_size=65536"],
        "a100-80gb",
        8,
        "fp16",
        "dle",
        16.5e6,
        DLE + ", 8 GPUs, 8k a GPU, large model",
    ),
    # NVIDIA's MLPerf logs (training_results_v4.0 NVIDIA/results/eos_ngc24.04_merlin_hugectr
    # and h200_ngc24.04_merlin_hugectr, training_results_v5.0 NVIDIA/results/
    # nyx_n1_ngc25.03_hugectr; dlrm_dcnv2/result_0..9.txt, MLLOG lines): 0.05 epoch
    # (209.8 M samples) between evaluations, each evaluation 1.7-1.9 s (H100), 1.6 s
    # (H200), 1.0 s (B200). The rate is the training intervals' (eval_stop to the next
    # eval_start; the first from epoch_start): the median over a run's intervals, the
    # median over the 10 runs - as for Intel's point below. The "throughput" each log's
    # tracked_stats reports (13.74 M, 15.12 M, 22.85 M, the medians) divides the samples
    # by the training and the evaluations' time together: not the step forecast here.
    Point(
        "MLPerf v4.0 DLRMv2 8x H100",
        "criteo_multihot_dcnv2",
        ["--train.batch_size=55296"],
        "h100-sxm",
        8,
        "fp16",
        "hugectr",
        15.67e6,
        MLPERF + " v4.0, NVIDIA DGX H100, HugeCTR: training intervals of its logs",
    ),
    Point(
        "MLPerf v4.0 DLRMv2 8x H200",
        "criteo_multihot_dcnv2",
        ["--train.batch_size=55296"],
        "h200",
        8,
        "fp16",
        "hugectr",
        17.03e6,
        MLPERF + " v4.0, NVIDIA HGX H200, HugeCTR: training intervals of its logs",
    ),
    Point(
        "MLPerf v5.0 DLRMv2 8x B200",
        "criteo_multihot_dcnv2",
        ["--train.batch_size=55296"],
        "b200",
        8,
        "fp16",
        "hugectr",
        25.67e6,
        MLPERF + " v5.0, NVIDIA HGX B200, HugeCTR: training intervals of its logs",
    ),
    # Intel's v3.1 log (training_results_v3.1, Intel/results/4-nodes-SPR-pytorch/
    # dlrm_dcnv2/result_0.txt): global batch 65,536, an evaluation every 3,200 steps;
    # the 16 training intervals between evaluations took 631-654 s (median 642 s), so
    # 3,200 x 65,536 / 642 s = 326.7k samples/s - the training rate, evaluations apart
    # (235.7 min to target = 10,900 s of training + 17 evaluations of ~183 s + loading).
    Point(
        "MLPerf v3.1 DLRMv2 8x SPR 8480+",
        "criteo_multihot_dcnv2",
        ["--train.batch_size=65536"],
        "spr-8480",
        8,
        "bf16",
        "ipex",
        326.7e3,
        MLPERF + " v3.1, Intel, 8 Xeon 8480+ sockets: training intervals of its log",
        # Intel/systems/4-nodes-SPR-pytorch.json: 2 sockets a node, its network one
        # "Ethernet Controller E810-C for QSFP" - 100 Gb/s in all (the E810's ports split
        # 1x100, 2x50, 4x25 or 8x10 GbE), so 6.25 GB/s a socket, not the catalogue's port
        # a socket
        device_overrides=(("network_gbps", 6.25),),
    ),
    *[
        Point(
            f"TorchRec DLRM {w}x A100-40GB {local}/GPU"
            + (" (sets its host time)" if local == TORCHREC_HOST_FIT else ""),
            "criteo_terabyte",
            [TORCHREC_TABLES, "--embedding.optimizer=sgd", f"--train.batch_size={w * local}"],
            "a100-40gb",
            w,
            "tf32",
            "torchrec",
            published,
            TORCHREC_DLRM + f", {w} GPUs, batch {local} a GPU",
            check=local != TORCHREC_HOST_FIT,
        )
        for w, local, published in TORCHREC_POINTS
    ],
    Point(
        "recscale A 1x H100 TF32 (sets host time)",
        "A",
        ["--train.batch_size=16384"],
        "h100-sxm",
        1,
        "tf32",
        "recscale-unpadded",
        3.29e6,
        "docs/gpu.md, 2026-11-24: recscale bench throughput, H100 80GB HBM3",
        check=False,
    ),
    Point(
        "recscale B 1x H100 TF32",
        "B",
        ["--train.batch_size=16384"],
        "h100-sxm",
        1,
        "tf32",
        "recscale-unpadded",
        2.49e6,
        "docs/gpu.md, 2026-11-24: recscale bench throughput, H100 80GB HBM3",
        check=False,
    ),
]


def evaluate(points: list[Point] = POINTS) -> list[dict]:
    rows = []
    for p in points:
        cfg = load_config(p.config, p.overrides)
        dev = replace(device_spec(p.device), **dict(p.device_overrides))
        f = forecast(cfg, dev, p.world_size, p.precision, SYSTEM_OF[p.system])
        rows.append(
            {
                "point": p.label,
                "device": p.device,
                "world_size": p.world_size,
                "precision": p.precision,
                "system": p.system,
                "batch": cfg.train.batch_size,
                "published": p.published,
                "predicted": f.samples_per_s,
                "error": f.samples_per_s / p.published - 1.0,
                "step_ms": f.step_ms,
                # what the published step spends beyond the forecast's
                "unexplained_ms": cfg.train.batch_size / p.published * 1e3 - f.step_ms,
                **{f"{k}_ms": round(v, 4) for k, v in f.stage_ms.items()},
                "check": p.check,
                "source": p.source,
            }
        )
    return rows


def summary(rows: list[dict]) -> tuple[float, float]:
    errs = [abs(r["error"]) for r in rows if r["check"]]
    return statistics.median(errs), max(errs)


def intel_variants() -> list[tuple[str, float]]:
    """Intel's point (the ``ipex`` system) with one term of its forecast changed at a
    time: (variant, step ms). The rows that no ``System`` or device field expresses
    change the all-to-all's stage by arithmetic on its bytes."""
    p = next(q for q in POINTS if q.system == "ipex")
    cfg = load_config(p.config, p.overrides)
    dev = replace(device_spec(p.device), **dict(p.device_overrides))
    ipex = SYSTEM_OF["ipex"]

    def step(d=dev, system=ipex) -> float:
        return forecast(cfg, d, p.world_size, p.precision, system).step_ms

    f = forecast(cfg, dev, p.world_size, p.precision, ipex)
    w, a2a = p.world_size, f.stage_ms["all_to_all"]
    eff = EFFICIENCY[dev.kind]
    act = StepKernels(dev, eff, p.precision).act  # the activations' bytes
    tables = table_infos(cfg)
    _, backward = partials_exchange_bytes(
        cfg.train.batch_size,
        [t.pooling for t in tables],
        [t.dim for t in tables],
        w,
        ipex.wire_bytes or act,
    )
    wire_ms = 1e3 / (dev.network_gbps * 1e9 * eff.link)
    off_node = (w - dev.devices_per_node) / (w - 1)  # of a rank's peers, those on other nodes
    return [
        ("as checked", f.step_ms),
        ("only the other nodes' ranks behind the NIC", f.step_ms - a2a * (1 - off_node)),
        (
            "half the backward's ids repeated within a rank's samples",
            f.step_ms - backward / 2 * wire_ms,
        ),
        (
            "no input work",
            step(system=replace(ipex, input_serial_s_per_id=0, input_parallel_s_per_id=0)),
        ),
        ("the catalogue's network", step(d=device_spec(p.device))),
        (
            "the plan's pooled exchange instead of Intel's",
            step(system=replace(ipex, exchange="pooled")),
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--variants", action="store_true", help="Intel's point with one term changed at a time"
    )
    args = ap.parse_args()
    if args.variants:
        p = next(q for q in POINTS if q.system == "ipex")
        batch = load_config(p.config, p.overrides).train.batch_size
        for name, ms in intel_variants():
            print(f"{name:<58} {ms:8.1f} ms  {batch / ms * 1e3 / p.published - 1:+.1%}")
        return
    rows = evaluate()
    print(
        f"{'point':<42} {'published':>11} {'forecast':>11} {'error':>7} {'gap ms':>7}  "
        "largest stages (ms)"
    )
    for r in rows:
        stages = sorted(
            ((k[:-3], v) for k, v in r.items() if k.endswith("_ms") and k[:-3] in STAGES),
            key=lambda kv: -kv[1],
        )[:3]
        top = ", ".join(f"{k} {v:.2f}" for k, v in stages)
        print(
            f"{r['point']:<42} {r['published'] / 1e6:>10.3f}M {r['predicted'] / 1e6:>10.3f}M "
            f"{r['error']:>+7.1%} {r['unexplained_ms']:>7.2f}  {top}"
        )
    med, worst = summary(rows)
    n = sum(r["check"] for r in rows)
    print(f"published points: {n}, median |error| {med:.1%}, worst {worst:.1%}")
    out = Path(args.out)
    write_csv(rows, out / "forecast_validation.csv")
    if not args.no_plot:
        plot(rows, out / "img" / "forecast_predicted_vs_published.png")


def write_csv(rows: list[dict], path: Path) -> None:
    """The rows as CSV, one column a key (the first row's), the folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 6))
    for r in rows:
        mark = "o" if r["check"] else "s"
        ax.scatter(r["published"], r["predicted"], marker=mark)
        ax.annotate(r["point"], (r["published"], r["predicted"]), fontsize=6)
    lo = min(min(r["published"], r["predicted"]) for r in rows) / 1.5
    hi = max(max(r["published"], r["predicted"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.5)
    for f in (0.85, 1.15):
        ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.5)
    ax.set(xscale="log", yscale="log", xlabel="published samples/s", ylabel="forecast samples/s")
    ax.set_title("recscale forecast vs published DLRM training throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
