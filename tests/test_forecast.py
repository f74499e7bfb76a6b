"""The forecast for devices this machine does not have: the catalogue and its errors, the
tile-and-wave GEMM against a hand count, each stage's response to the figure it
depends on, the plan made for the device, and ``recscale plan --device``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import error_line, run_cli

from recscale.config import load_config
from recscale.config.errors import ConfigError
from recscale.perfmodel.calibration import Calibration, Law
from recscale.perfmodel.devices import catalogue, device_spec
from recscale.perfmodel.forecast import (
    EAGER_OP_S,
    FOREACH_ADAGRAD_BYTES,
    GPU,
    OPT_BYTES,
    STAGES,
    StepKernels,
    _exposed_host,
    forecast,
    hybrid_plan,
)
from recscale.perfmodel.model import predict, standard_stages
from recscale.perfmodel.systems import RECSCALE, SYSTEMS
from recscale.planner.from_config import table_infos
from recscale.planner.plan import PlanError

NAMED = ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "a100-40gb", "b200", "mi300x")
NAMED += ("spr-8480", "epyc-9654")
REQUIRED_STAGES = ("mlp_gemm", "embedding_forward", "embedding_update", "interaction")
REQUIRED_STAGES += ("all_to_all", "all_reduce")

ENTRY = """
[tiny]
kind = "gpu"
description = "a made-up GPU"
peak_tflops = { fp32 = 1.0, tf32 = 4.0 }
memory_gbps = 100
memory_gb = 1
units = 4
l2_mb = 1
intra_node_gbps = 10
devices_per_node = 2
network_gbps = 1
[tiny.sources]
peak_tflops = "made up for a test"
"""


def test_every_named_device_is_catalogued_with_its_sources():
    devices = catalogue()
    for name in NAMED:
        d = devices[name]
        assert d.peak_tflops["fp32"] > 0 and d.memory_gbps > 0 and d.units > 0
        for figure in ("peak_tflops", "memory", "units", "interconnect"):
            assert d.sources.get(figure), (name, figure)
    assert devices["h100-sxm"].peak_tflops["bf16"] == pytest.approx(989.4)
    assert devices["h200"].memory_gb > devices["h100-sxm"].memory_gb


def test_a_device_file_adds_and_replaces_entries(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(ENTRY + ENTRY.replace("[tiny", "[h100-sxm").replace("= 100", "= 7"))
    devices = catalogue(f)
    assert devices["tiny"].units == 4
    assert devices["h100-sxm"].memory_gbps == 7  # the file's entry replaces the shipped one
    assert device_spec("tiny", f).peak_flops("tf32") == 4e12


@pytest.mark.parametrize(
    "change, key",
    [
        (("memory_gb = 1\n", ""), "memory_gb"),
        (("units = 4", "units = 0"), "units"),
        (("units = 4", "units = 2.5"), "units"),
        (('kind = "gpu"', 'kind = "tpu"'), "kind"),
        (("l2_mb = 1", "l2_mb = 1\nspeed = 3"), "speed"),
        (("fp32 = 1.0", "fp64 = 1.0"), "peak_tflops.fp64"),
        (("[tiny]", "[this]"), "this"),
    ],
)
def test_a_bad_device_entry_is_one_error_naming_the_key(tmp_path, change, key):
    f = tmp_path / "bad.toml"
    f.write_text(ENTRY.replace(*change))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        catalogue(f)


def test_unknown_device_and_missing_precision_name_the_choices():
    with pytest.raises(ConfigError, match="entries: h100-sxm, .*spr-8480.*this"):
        device_spec("h100")
    with pytest.raises(ConfigError, match="lists fp32, tf32, bf16, fp16"):
        device_spec("a100-80gb").peak_flops("fp8")


def _tiny(**kw):
    f = catalogue()["h100-sxm"]
    return replace(f, name="tiny", units=4, peak_tflops={"fp32": 1.0}, memory_gbps=1e6, **kw)


def test_gemm_time_is_waves_of_tiles_at_the_units_rate():
    dev = _tiny()
    eff = replace(GPU, kernel_s=0.0)
    one_tile = 2 * 128 * 128 * 1024 / (1e12 * eff.gemm / 4)  # s for one tile on one unit
    rate = 1e6 * 1e9 * eff.stream  # the memory's bytes/s
    # (130 rows are 2 row tiles: the partial one costs a whole tile's time); then the
    # output's store
    for m, n, waves in ((256, 256, 1), (256, 384, 2), (512, 512, 4), (128, 384, 1), (130, 384, 2)):
        s = StepKernels(dev, eff, "fp32")
        s.gemm("mlp_gemm", m, n, 1024)
        assert s.stages["mlp_gemm"] == pytest.approx(waves * one_tile + m * n * 4 / rate), (m, n)
    s = StepKernels(dev, eff, "fp32")  # one tile on 4 units: the reduction split 4 ways
    s.gemm("mlp_gemm", 128, 128, 1024)  # its 4 partial sums written, read, summed, written
    assert s.stages["mlp_gemm"] == pytest.approx(one_tile / 4 + 3 * 128 * 128 * 4 / rate)
    slow = replace(dev, memory_gbps=0.001)  # memory-bound: its bytes at the memory rate
    s = StepKernels(slow, eff, "fp32")
    s.gemm("mlp_gemm", 256, 256, 1024)
    nbytes = (256 * 1024 * 2 + 256 * 256) * 4
    assert s.stages["mlp_gemm"] == pytest.approx(nbytes / (1e6 * eff.stream))


def _fc(config="B", device="h100-sxm", world=1, precision="tf32", over=(), **dev):
    cfg = load_config(config, ["--train.batch_size=16384", *over])
    d = replace(catalogue()[device], **dev)
    return forecast(cfg, d, world, precision)


def test_each_stage_follows_the_figure_it_depends_on():
    base = _fc()
    assert set(REQUIRED_STAGES) <= set(base.stage_ms) and set(base.stage_ms) == set(STAGES)
    assert base.step_ms == pytest.approx(sum(base.stage_ms.values()))
    assert base.samples_per_s == pytest.approx(16384 / base.step_ms * 1e3)
    assert base.stage_ms["all_to_all"] == base.stage_ms["all_reduce"] == 0.0  # one device
    fast_mem = _fc(memory_gbps=2 * 3350)
    for stage in ("embedding_forward", "embedding_update", "dense_optimizer"):
        assert fast_mem.stage_ms[stage] < 0.6 * base.stage_ms[stage], stage
    assert fast_mem.stage_ms["mlp_gemm"] == pytest.approx(base.stage_ms["mlp_gemm"], rel=0.25)
    half = _fc(precision="bf16")  # twice the tensor-core rate, half the activation bytes
    assert half.stage_ms["mlp_gemm"] < 0.6 * base.stage_ms["mlp_gemm"]
    assert half.stage_ms["embedding_update"] == pytest.approx(base.stage_ms["embedding_update"])
    assert _fc(config="A").step_ms < base.step_ms  # dim 16, small MLPs


def test_ranks_add_collectives_and_a_node_boundary_costs_the_network():
    eight = _fc(config="criteo_multihot_dcnv2", world=8)
    assert eight.stage_ms["all_to_all"] > 0 and eight.stage_ms["all_reduce"] > 0
    sixteen = _fc(config="criteo_multihot_dcnv2", world=16)  # two nodes of 8
    # the network (50 GB/s a GPU) is 9x slower than NVLink: more than the halved bytes
    assert sixteen.stage_ms["all_reduce"] > 4 * eight.stage_ms["all_reduce"]
    assert sixteen.world_size == 16 and sixteen.plan.world_size == 16


def test_the_plan_is_made_for_the_devices_memory_and_costs():
    cfg = load_config("criteo_multihot_dcnv2")  # 105 GB of tables with their state
    f = forecast(cfg, device_spec("a100-40gb"), 4, "tf32")
    cap = 40e9
    assert max(f.plan.memory_per_rank) <= cap and f.memory_bytes <= cap
    assert f.table_bytes == max(f.plan.memory_per_rank)
    with pytest.raises(PlanError, match="missing"):
        forecast(cfg, device_spec("a100-40gb"), 2, "tf32")
    with pytest.raises(ConfigError, match="world-size"):
        forecast(cfg, device_spec("a100-40gb"), 0, "tf32")
    # a slow network between every pair of devices: rows of the big tables stay whole
    # on one device (a row-wise table sends every sample's partial sums everywhere)
    slow = replace(device_spec("h100-sxm"), devices_per_node=1, network_gbps=0.5)
    fast = device_spec("h100-sxm")
    kinds = lambda fc: {p.table: p.kind for p in fc.plan.placements}  # noqa: E731
    k_slow, k_fast = kinds(forecast(cfg, slow, 8, "bf16")), kinds(forecast(cfg, fast, 8, "bf16"))
    assert k_slow != k_fast
    assert list(k_slow.values()).count("row_wise") < list(k_fast.values()).count("row_wise") or (
        list(k_slow.values()).count("table_wise") > list(k_fast.values()).count("table_wise")
    )


def test_the_systems_change_what_they_say_they_change():
    # row-wise: every rank the same work, so the slowest rank is the same in each forecast
    over = ["--train.batch_size=55296", "--distributed.sharding=row_wise"]
    cfg = load_config("criteo_multihot_dcnv2", over)
    dev = device_spec("h100-sxm")
    plain = forecast(cfg, dev, 8, "fp16", RECSCALE)
    ew = {
        e: forecast(cfg, dev, 8, "fp16", replace(RECSCALE, epilogue=e)).stage_ms["mlp_elementwise"]
        for e in ("eager", "apex", "fused")
    }
    assert ew["fused"] == 0.0 < ew["apex"] < ew["eager"] == plain.stage_ms["mlp_elementwise"]
    hidden = forecast(cfg, dev, 8, "fp16", replace(RECSCALE, comm_overlap=0.5))
    assert hidden.stage_ms["all_to_all"] == pytest.approx(0.5 * plain.stage_ms["all_to_all"])
    graph = forecast(cfg, dev, 8, "fp16", replace(RECSCALE, host="graph"))
    assert graph.stage_ms["host"] == 0.0
    # serial: every op's host time adds to the device's
    host = plain.kernels * RECSCALE.host_ops_per_kernel * EAGER_OP_S * 1e3
    serial = forecast(cfg, dev, 8, "fp16", replace(RECSCALE, host="serial"))
    assert serial.stage_ms["host"] == pytest.approx(host)
    assert serial.step_ms - graph.step_ms == pytest.approx(host)
    # overlap, one wait a step: only what the host takes beyond the device's time
    once = replace(RECSCALE, host="overlap", wait_before="")
    over_ = forecast(cfg, dev, 8, "fp16", once)
    assert over_.stage_ms["host"] == pytest.approx(max(0.0, host - graph.step_ms))
    # recscale's read-back before the update: at least that, at most all of it
    assert RECSCALE.host == "overlap" and RECSCALE.wait_before == "embedding_update"
    assert over_.stage_ms["host"] <= plain.stage_ms["host"] <= host
    slow_host = replace(RECSCALE, host_ops_per_kernel=1000.0)
    f = forecast(cfg, dev, 8, "fp16", slow_host)
    assert f.step_ms == pytest.approx(f.kernels * 1000.0 * EAGER_OP_S * 1e3)
    # a system's own host time an op replaces the default
    own = forecast(cfg, dev, 8, "fp16", replace(slow_host, host_op_s=EAGER_OP_S / 2))
    assert own.step_ms == pytest.approx(f.step_ms / 2)
    assert set(SYSTEMS) >= {"recscale", "dle", "hugectr", "torchrec", "ipex"}
    with pytest.raises(ValueError, match="System.host"):
        replace(RECSCALE, host="sometimes")


def test_a_sparse_gradient_update_costs_more_than_the_fused_one_and_amp_unscales_it():
    cfg = load_config("A", ["--train.batch_size=65536"])
    dev = device_spec("a100-80gb")
    fused = forecast(cfg, dev, 1, "tf32", replace(RECSCALE, host="graph"))
    sparse = replace(RECSCALE, host="graph", embedding_update="sparse_add", pooled_in_act=True)
    tf32 = forecast(cfg, dev, 1, "tf32", sparse)
    assert tf32.stage_ms["embedding_update"] > fused.stage_ms["embedding_update"]
    # under fp16 the pooled gradient read is half the bytes, the unscale pass adds 8 a value
    fp16 = forecast(cfg, dev, 1, "fp16", sparse)
    values = 65536 * sum(1 for _ in cfg.model.table_sizes) * cfg.model.embedding_dim
    extra = (values * 8 - values * 2) / (dev.memory_gbps * 1e9 * GPU.stream) + GPU.kernel_s
    assert fp16.stage_ms["embedding_update"] - tf32.stage_ms["embedding_update"] == pytest.approx(
        extra * 1e3, rel=1e-6
    )


def test_torchs_gpu_adagrad_is_its_foreach_passes_sgd_and_the_cpu_one_pass():
    """recscale's dense optimizer is torch.optim's: on a GPU Adagrad runs five foreach
    passes (52 bytes a parameter) where a fused system streams 20; SGD is fused either
    way (12), and on a CPU torch's fused Adagrad runs (20)."""
    graph = replace(RECSCALE, host="graph")
    fused = replace(graph, dense_optimizer="fused")
    dev, cpu = device_spec("h100-sxm"), device_spec("spr-8480")
    adagrad = load_config("criteo_multihot_dcnv2", [*_capped_dcnv2(), "--train.batch_size=6912"])

    def opt_ms(cfg, d, system):
        return forecast(cfg, d, 1, "tf32", system).stage_ms["dense_optimizer"]

    # the same kernel's fixed cost on either side: the streamed time scales with the bytes
    kernel_ms = GPU.kernel_s * 1e3
    ratio = (opt_ms(adagrad, dev, graph) - kernel_ms) / (opt_ms(adagrad, dev, fused) - kernel_ms)
    assert ratio == pytest.approx(FOREACH_ADAGRAD_BYTES / OPT_BYTES["adagrad"])
    assert opt_ms(adagrad, cpu, graph) == opt_ms(adagrad, cpu, fused)
    sgd = load_config("A", ["--train.batch_size=16384"])
    assert opt_ms(sgd, dev, graph) == opt_ms(sgd, dev, fused)
    with pytest.raises(ValueError, match="System.dense_optimizer"):
        replace(RECSCALE, dense_optimizer="foreach")


def _capped_dcnv2() -> list[str]:
    """DCNv2's tables at 1/100 of their rows (the dense side, which this prices, is kept)."""
    sizes = load_config("criteo_multihot_dcnv2").model.table_sizes
    return [f"--model.table_sizes=[{','.join(str(max(1, n // 100)) for n in sizes)}]"]


def test_gradscaler_waits_split_the_host_time_at_the_optimizer():
    """One wait after the backward: host time beyond the device's before it is exposed
    even when the update after it (the device's) would have hidden it."""
    cfg = load_config("B", ["--train.batch_size=65536"])
    dev = device_spec("a100-80gb")
    base = replace(SYSTEMS["dle"], host_ops_per_kernel=12.0, host_op_s=20e-6)
    overlap = forecast(cfg, dev, 1, "fp16", replace(base, scaler_waits=False))
    waits = forecast(cfg, dev, 1, "fp16", base)
    assert overlap.stage_ms["host"] == 0.0 < waits.stage_ms["host"]
    op_ms = 12.0 * 20e-6 * 1e3
    assert waits.stage_ms["host"] < overlap.kernels * op_ms  # not all of it: one wait
    tf32 = forecast(cfg, dev, 1, "tf32", base)  # no scaler outside fp16: no wait
    assert tf32.stage_ms["host"] == 0.0


def test_a_read_back_before_the_update_exposes_the_host_of_each_part():
    """recscale waits on the device before its fused update (benchmarks/gpu_syncs.py):
    the update's and optimizer's host time cannot hide behind the backward's kernels.
    A step of 10 long GEMMs, then 5 update and 5 optimizer kernels; 0.1 ms of host an op."""
    dev = device_spec("h100-sxm")
    dense, emb = StepKernels(dev, GPU, "tf32"), StepKernels(dev, GPU, "tf32")
    dense.stages["mlp_gemm"], dense.stage_kernels["mlp_gemm"] = 10e-3, 10
    emb.stages["embedding_update"], emb.stage_kernels["embedding_update"] = 0.1e-3, 5
    dense.stages["dense_optimizer"], dense.stage_kernels["dense_optimizer"] = 0.05e-3, 5
    stages = {k: dense.stages[k] + emb.stages[k] for k in STAGES}
    sysm = replace(RECSCALE, host_ops_per_kernel=1.0, host_op_s=0.1e-3)
    # before the wait 1 ms of host under 10 of GEMMs: hidden; after it 1 ms of host
    # against 0.15 of device: 0.85 shows
    split = _exposed_host(dense, emb, stages, sysm, "tf32")
    assert split == pytest.approx(1.0e-3 - 0.15e-3)
    # one wait a step: 2 ms of host under 10.15 of device, all hidden
    assert _exposed_host(dense, emb, stages, replace(sysm, wait_before=""), "tf32") == 0.0
    # serial: all of it
    serial = replace(sysm, host="serial")
    assert _exposed_host(dense, emb, stages, serial, "tf32") == pytest.approx(2.0e-3)
    # a wait before the optimizer alone: its 0.5 ms of host against 0.05 of device
    late = replace(sysm, wait_before="dense_optimizer")
    assert _exposed_host(dense, emb, stages, late, "tf32") == pytest.approx(0.45e-3)
    with pytest.raises(ValueError, match="System.wait_before"):
        replace(RECSCALE, wait_before="interaction")


def test_dle_hybrid_parallel_puts_the_bottom_mlp_on_rank_0_and_tables_elsewhere():
    cfg = load_config("criteo_terabyte", ["--train.batch_size=65536"])
    tables = table_infos(cfg)
    plan = hybrid_plan(tables, 8)
    held = {r: [p.table for p in plan.placements if p.ranks == [r]] for r in range(8)}
    assert held[0] == [] and all(1 <= len(held[r]) <= 4 for r in range(1, 8))
    assert sorted(sum(held.values(), [])) == sorted(t.name for t in tables)
    assert plan.memory_per_rank[0] == 0 and sum(plan.memory_per_rank) == sum(
        t.bytes for t in tables
    )
    assert len({p.ranks[0] for p in hybrid_plan(tables, 4).placements}) == 4  # <= 4: all hold
    dev = device_spec("a100-80gb")
    dle = SYSTEMS["dle"]
    f = forecast(cfg, dev, 8, "tf32", replace(dle, host="graph"))
    # rank 0 runs the bottom MLP over all 65,536 samples: the slowest rank's compute
    no_bottom = forecast(
        load_config(
            "criteo_terabyte", ["--train.batch_size=65536", "--model.num_dense_features=0"]
        ),
        dev,
        8,
        "tf32",
        replace(dle, host="graph"),
    )
    assert f.slowest_rank == 0 and f.step_ms > no_bottom.step_ms
    # the all-to-all is its slowest member's: a table rank's, not rank 0's lighter part
    assert f.stage_ms["all_to_all"] > 0.0
    with pytest.raises(PlanError, match="missing"):  # 96 GB of tables on 2 x 40 GB
        forecast(cfg, device_spec("a100-40gb"), 2, "tf32", dle)


# recscale's own config-B steps at batch 16384, TF32 (docs/gpu.md; held out: the host
# time an op was set from config A alone): (device, ms a step, the Gram matrix's form)
B_RUNS = [
    ("h100-sxm", 6.59, "autograd"),  # 2026-11-24
    ("h200", 4.75, "autograd"),  # 2026-11-26, da3844c
    ("h200", 4.69, "padded"),  # 2026-11-26, f2be6a5
    ("h200", 4.99, "padded"),  # 2026-11-26, ce18e55
]


def test_recscales_own_held_out_gpu_steps_are_forecast_within_the_spread_of_hosts():
    """Config B's four measured steps, each within 25%: config A itself, the fit, ran
    3.53-4.98 ms a step on four GPU boxes (the host's dispatch sets it), so a box's host
    moves a host-bound step by about a sixth either way."""
    cfg = load_config("B", ["--train.batch_size=16384"])
    for device, ms, gram in B_RUNS:
        system = RECSCALE if gram == "padded" else replace(RECSCALE, gram=gram)
        f = forecast(cfg, device_spec(device), 1, "tf32", system)
        assert f.step_ms == pytest.approx(ms, rel=0.25), (device, ms)


def test_plan_device_cli_prints_and_carries_the_forecast():
    r = run_cli(
        "plan",
        "--device",
        "h100-sxm",
        "--config",
        "criteo_multihot_dcnv2",
        "--world-size",
        "8",
        "--precision",
        "bf16",
        "--train-samples",
        "4e9",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    stages = out["predicted_stage_ms"]
    assert set(REQUIRED_STAGES) <= set(stages)
    assert out["predicted_step_ms"] == pytest.approx(sum(stages.values()))
    assert out["predicted_samples_per_s"] == pytest.approx(16384 / out["predicted_step_ms"] * 1e3)
    assert out["predicted_train_hours"] == pytest.approx(
        4e9 / out["predicted_samples_per_s"] / 3600
    )
    assert 0 < out["predicted_memory_bytes_per_device"] <= 80e9
    assert out["world_size"] == 8 and len(out["memory_per_rank"]) == 8
    # recscale's host: its counted ops a kernel, each at EAGER_OP_S, at most all exposed
    assert out["host_ops_per_step"] == round(out["kernels_per_step"] * RECSCALE.host_ops_per_kernel)
    assert 0 < stages["host"] <= out["host_ops_per_step"] * EAGER_OP_S * 1e3 * 1.01
    r = run_cli("plan", "--device", "mi300x", "--config", "A")
    assert r.returncode == 0 and "samples/s" in r.stdout and "mlp_gemm" in r.stdout
    assert f"framework ops a step at {EAGER_OP_S * 1e6:.1f} us" in r.stdout
    r = run_cli("plan", "--list-devices")
    assert all(n in r.stdout for n in NAMED)


# torch made unimportable, then the CLI: the plan and the forecast are arithmetic on the
# config, and a fresh process answers in a fraction of a second without torch's import
_NO_TORCH = (
    "import sys; sys.modules['torch'] = None; from recscale.cli.main import main; "
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "args",
    [
        ["--device", "h100-sxm", "--config", "criteo_multihot_dcnv2", "--world-size", "8"],
        ["--device", "a100-80gb", "--config", "B", "--system", "dle", "--train-samples", "4e9"],
        ["--config", "A", "--world-size", "4", "--embedding.placement=ssd"],
        ["--config", "B", "--embedding.compression=tt", "--embedding.row_precision=int8"],
        ["--config", "debug", "--embedding.compression=qr", "--embedding.hot_fraction=0.01"],
    ],
)
def test_plan_runs_without_torch_and_says_what_it_says_with_it(args):
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, "plan", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    with_torch = run_cli("plan", *args, "--json")
    assert with_torch.returncode == 0, with_torch.stderr
    assert json.loads(r.stdout) == json.loads(with_torch.stdout)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--device", "h100"], "unknown device 'h100' (entries: h100-sxm"),
        (["--device", "a100-80gb", "--precision", "fp8"], "no fp8 rate"),
        (["--device", "h100-sxm", "--world-size", "0"], "--world-size"),
        (["--device", "h100-sxm", "--system", "nope"], "systems: recscale"),
        (["--device", "a100-40gb", "--config", "criteo_terabyte"], "missing"),
    ],
)
def test_plan_device_mistakes_are_one_line(args, words):
    r = run_cli("plan", *args)
    assert r.returncode != 0
    assert words in error_line(r.stderr)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--system", "ipex"], "--system': models another system's step on a catalogue"),
        (["--device", "this", "--system", "dle"], "the calibrated host runs recscale's own"),
        (["--precision", "bf16"], "--precision': sets a catalogue --device forecast's"),
        (["--device-file", "DEVICES"], "--device-file': adds catalogue entries"),
        (["--train-samples", "1e9"], "--train-samples': needs a step forecast"),
    ],
)
def test_plan_refuses_forecast_flags_no_forecast_reads(tmp_path, args, words):
    """Without a catalogue device these flags changed nothing and were dropped without a
    word (``plan --system ipex`` printed recscale's own plan); with one they apply."""
    devices = tmp_path / "devices.toml"
    devices.write_text("")
    args = [str(devices) if a == "DEVICES" else a for a in args]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))  # no saved calibration
    r = run_cli("plan", "--config", "debug", *args, env=env)
    assert r.returncode == 2 and words in error_line(r.stderr)
    ok = run_cli("plan", "--config", "debug", *args, "--device", "h100-sxm", env=env)
    assert ok.returncode == 0, ok.stderr


def test_this_device_is_the_calibrated_model_under_the_forecasts_names(tmp_path):
    z = lambda names, on: Law(names, [1e-9 if n == on else 0.0 for n in names])  # noqa: E731
    laws = {
        "mlp_forward": z(["flops2", "mn", "mk", "kn", "one"], "flops2"),
        "mlp_backward": z(["flops4", "mn", "mk", "kn", "one"], "flops4"),
        "interaction": z(["bkkd", "bkk", "one"], "bkkd"),
        "lookup": z(["ids_d", "ids", "one"], "ids_d"),
        "update": z(["ids_d", "ids", "one"], "ids_d"),
        "dense_opt": z(["params", "one"], "params"),
    }
    path = tmp_path / "cal.json"
    Calibration("test", 1, laws, step_overhead=0.001).save(path)
    r = run_cli(
        "plan", "--device", "this", "--config", "debug", "--calibration", str(path), "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = predict(load_config("debug"), Calibration.load(path))
    assert out["predicted_stage_ms"] == pytest.approx(standard_stages(want.stages_ms))
    assert out["predicted_step_ms"] == pytest.approx(want.step_seconds * 1e3)
    assert math.isclose(sum(out["predicted_stage_ms"].values()), out["predicted_step_ms"])


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_host_op_counter_counts_each_dispatched_op():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from count_host_ops import OpCounter, count_recscale
    finally:
        sys.path.remove(str(BENCHMARKS))
    w = torch.randn(4, 3, requires_grad=True)
    with OpCounter() as c:
        (torch.randn(2, 4) @ w).relu().sum().backward()
    forward = {"aten.randn", "aten.mm", "aten.relu", "aten.sum"}
    assert forward <= set(c.ops) and c.ops["aten.mm"] == 2  # forward + w's gradient
    assert sum(c.ops.values()) >= 8  # + threshold_backward, expand, t, ...
    # what `count_host_ops.py recscale --config debug --stages` prints
    out = json.loads(count_recscale("debug", [], steps=3, stages=True))
    assert out["system"] == "recscale" and "--model.kernels=torch" in out["overrides"]
    assert out["ops"] > forecast(load_config("debug"), device_spec("h100-sxm")).kernels
    # split by the bench's stages: every op in one of them, each stage dispatching some
    assert list(out["stage_ops"]) == ["lookup", "forward", "backward", "sparse", "dense_opt"]
    assert sum(out["stage_ops"].values()) == out["ops"] and min(out["stage_ops"].values()) > 0


def test_the_validation_forecasts_every_published_point_from_its_sources():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from forecast_validation import POINTS, evaluate, summary
    finally:
        sys.path.remove(str(BENCHMARKS))
    rows = evaluate()
    assert len([r for r in rows if r["check"]]) >= 8 and len(rows) == len(POINTS)
    for r in rows:
        stages = sum(v for k, v in r.items() if k.endswith("_ms") and k[:-3] in STAGES)
        assert stages == pytest.approx(r["step_ms"], rel=1e-3) and r["source"]
        assert r["error"] == pytest.approx(r["predicted"] / r["published"] - 1)
    med, worst = summary(rows)
    errs = sorted(abs(r["error"]) for r in rows if r["check"])
    assert worst == errs[-1] and min(errs) <= med <= worst


def test_the_stage_check_pairs_every_bench_stage_with_its_forecast_stages():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from forecast_stages import GROUPS, MEASURED, STAGE_KEYS, compare
    finally:
        sys.path.remove(str(BENCHMARKS))
    # every bench stage and every device stage of a one-GPU forecast is in one group
    bench = {k for b, _ in GROUPS.values() for k in b}
    assert bench == {"lookup", "forward", "backward", "sparse", "dense_opt"}
    device = {k for _, f in GROUPS.values() for k in f}
    assert device | {"host", "all_to_all", "all_reduce"} == set(STAGES)
    rows = compare()
    # the groups, the step, and each bench stage against the forecast's timeline of it
    assert len(rows) == len(MEASURED) * (len(GROUPS) + 1 + len(STAGE_KEYS))
    for m in MEASURED:  # the stages (means) add up to the step (the bench's median rate)
        assert sum(m.stage_ms.values()) == pytest.approx(m.step_ms, rel=0.03) and m.source
    for r in rows:
        assert r["forecast_over_measured"] == pytest.approx(
            r["forecast_ms"] / r["measured_ms"],
            rel=1e-2,
            abs=1e-3,  # rounded to 3 decimals
        )


def _gpu_syncs():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_syncs
    finally:
        sys.path.remove(str(BENCHMARKS))
    return gpu_syncs


def test_a_sync_is_placed_at_its_innermost_recscale_line_and_its_step_phase():
    sync_site = _gpu_syncs().sync_site
    frame = traceback.FrameSummary
    stack = [
        frame("/x/benchmarks/gpu_syncs.py", 9, "main"),
        frame("/x/src/recscale/bench/throughput.py", 160, "step"),
        frame("/x/src/recscale/train/step.py", 40, "backward_and_step"),
        frame("/venv/torch/autograd/__init__.py", 300, "backward"),
        frame("/x/src/recscale/embedding/triton_kernels.py", 287, "fused_update"),
        frame("/venv/torch/_tensor.py", 10, "tolist"),
    ]
    assert sync_site(stack) == ("embedding/triton_kernels.py:287 fused_update", "backward_and_step")
    assert sync_site(stack[:1]) == ("(outside recscale)", "?")


def test_the_sync_counter_finds_the_fused_updates_read_back_on_a_gpu(device):
    if device.type != "cuda":
        pytest.skip("counts CUDA synchronisations: RECSCALE_TEST_DEVICE=cuda")
    sites, report = _gpu_syncs().count_syncs(
        ["--config", "debug", "--model.kernels=triton"], steps=2, warmup=2
    )
    assert report["steps"] == 2 and sites
    assert any("fused_update" in where for where, _ in sites)
