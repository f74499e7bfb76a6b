"""The forecast's bench stages (``Forecast.bench_stage_ms``): what ``recscale bench
throughput`` times on a device's stream - the step's kernels split into lookup,
forward, backward, sparse and dense_opt, and on a GPU the host's time through the
step's waits."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from helpers import run_cli

from recscale.config import load_config
from recscale.perfmodel.devices import device_spec
from recscale.perfmodel.forecast import BENCH_STAGES, COLLECTIVES, GPU, StepKernels, forecast
from recscale.perfmodel.step_kernels import _mlp
from recscale.perfmodel.systems import RECSCALE, SYSTEMS


def _cfg(config: str, batch: int):
    """``config`` at ``batch`` samples, its tables capped at 2^20 rows (one GPU holds them)."""
    cfg = load_config(config, [f"--train.batch_size={batch}"])
    cfg.model.table_sizes = [min(n, 1 << 20) for n in cfg.model.table_sizes]
    return cfg


def _device_ms(f) -> float:
    """The forecast's device stages (all but the host's), ms."""
    return sum(v for k, v in f.stage_ms.items() if k != "host")


@pytest.mark.parametrize("config", ["A", "B", "criteo_multihot_dcnv2", "debug"])
@pytest.mark.parametrize("world", [1, 4])
def test_bench_stages_hold_every_kernel_of_the_step_once(config, world):
    """Without host time (a captured graph) the bench stages are the device's: their
    sum is the stages' sum (collectives included), kernel for kernel."""
    cfg = _cfg(config, 4096)
    graph = replace(RECSCALE, host="graph")
    f = forecast(cfg, device_spec("h100-sxm"), world, "tf32", graph)
    assert set(f.bench_stage_ms) == set(BENCH_STAGES)
    assert sum(f.bench_stage_ms.values()) == pytest.approx(_device_ms(f), rel=1e-9)
    assert f.bench_stage_ms["sparse"] == pytest.approx(f.stage_ms["embedding_update"])
    assert f.bench_stage_ms["dense_opt"] == pytest.approx(f.stage_ms["dense_optimizer"])
    a2a = f.stage_ms["all_to_all"]
    assert f.bench_stage_ms["lookup"] == pytest.approx(f.stage_ms["embedding_forward"] + a2a / 2)
    dense = sum(f.stage_ms[k] for k in ("mlp_gemm", "mlp_elementwise", "interaction", "loss"))
    both = f.bench_stage_ms["forward"] + f.bench_stage_ms["backward"]
    assert both == pytest.approx(dense + a2a / 2 + f.stage_ms["all_reduce"])
    if world == 1:
        assert all(f.stage_ms[k] == 0 for k in COLLECTIVES)


def test_an_mlps_forward_gemms_are_its_forward_and_the_gradients_its_backward():
    """Each layer's forward GEMM goes to the forward, its data and weight gradients to
    the backward: against the same GEMMs priced one by one."""
    dev = device_spec("h100-sxm")
    s = StepKernels(dev, GPU, "tf32")
    b, widths = 65536, [1024, 512]
    _mlp(s, replace(RECSCALE, epilogue="fused"), b, 256, widths, True)
    forward, backward = StepKernels(dev, GPU, "tf32"), StepKernels(dev, GPU, "tf32")
    k = 256
    for n in widths:
        forward.gemm("mlp_gemm", b, n, k)
        backward.gemm("mlp_gemm", b, k, n)
        backward.gemm("mlp_gemm", k, n, b)
        k = n
    assert s.bench["forward"] == pytest.approx(forward.stages["mlp_gemm"], rel=1e-12)
    assert s.bench["backward"] == pytest.approx(backward.stages["mlp_gemm"], rel=1e-12)
    assert 1.5 < s.bench["backward"] / s.bench["forward"] < 2.5
    assert s.bench_kernels == {
        "lookup": 0,
        "forward": 2,
        "backward": 4,
        "sparse": 0,
        "dense_opt": 0,
    }
    assert s.phase == "forward"  # left as found for the next caller


def test_a_cpu_has_no_host_term_its_stages_are_its_kernels():
    cfg = load_config("A", [])
    f = forecast(cfg, device_spec("spr-8480"), 1, "fp32")
    assert sum(f.bench_stage_ms.values()) == pytest.approx(f.step_ms, rel=1e-9)


def test_a_host_bound_gpu_step_is_its_hosts_stage_by_stage():
    """recscale's A at batch 16,384 on an H200: the device has little to do, so each
    stage lasts as long as the host takes to issue it - the kernels the stage holds
    times their host weight - and the stages add up to the step the forecast's host
    model gives."""
    cfg = load_config("A", ["--train.batch_size=16384"])
    f = forecast(cfg, device_spec("h200"), 1, "tf32")
    assert f.stage_ms["host"] > _device_ms(f)  # host-bound
    graph = forecast(cfg, device_spec("h200"), 1, "tf32", replace(RECSCALE, host="graph"))
    for k in BENCH_STAGES:
        assert f.bench_stage_ms[k] >= graph.bench_stage_ms[k] * 0.999  # never below its kernels
    assert sum(f.bench_stage_ms.values()) == pytest.approx(f.step_ms, rel=0.05)
    # the forward's kernels cost the host more each than the backward's (modules and
    # autocast in Python against autograd's engine), the lookup's most
    weights = dict(zip(BENCH_STAGES, RECSCALE.host_stage_weights))
    assert weights["lookup"] > weights["forward"] > weights["backward"]


def test_a_device_bound_gpu_step_is_its_kernels():
    """At a batch where the device's work dwarfs the host's, the forward and backward
    are their kernels' time."""
    cfg = load_config("B", ["--train.batch_size=262144"])
    f = forecast(cfg, device_spec("h100-sxm"), 1, "tf32")
    graph = forecast(cfg, device_spec("h100-sxm"), 1, "tf32", replace(RECSCALE, host="graph"))
    for k in ("forward", "backward"):
        assert f.bench_stage_ms[k] == pytest.approx(graph.bench_stage_ms[k], rel=0.02)


def test_the_updates_read_back_puts_its_sort_and_hosts_work_in_series():
    """recscale's update reads two values back after sorting its ids: the host waits
    for the sort, then launches the fused kernel, which runs while the host goes on to
    the optimizer. Without that read-back (the same system, no serial stage) the
    update's host time hides behind its kernels instead."""
    cfg = _cfg("criteo_multihot_dcnv2", 6912)
    dev = device_spec("h200")
    serial = forecast(cfg, dev, 1, "tf32")
    hidden = forecast(cfg, dev, 1, "tf32", replace(RECSCALE, serial_stages=()))
    assert serial.bench_stage_ms["sparse"] > hidden.bench_stage_ms["sparse"]
    graph = forecast(cfg, dev, 1, "tf32", replace(RECSCALE, host="graph"))
    assert serial.bench_stage_ms["sparse"] >= graph.bench_stage_ms["sparse"]


def test_a_serial_host_adds_to_every_stage():
    cfg = load_config("A", ["--train.batch_size=16384"])
    dev = device_spec("h100-sxm")
    serial = forecast(cfg, dev, 1, "tf32", replace(RECSCALE, host="serial"))
    graph = forecast(cfg, dev, 1, "tf32", replace(RECSCALE, host="graph"))
    for k in BENCH_STAGES:
        assert serial.bench_stage_ms[k] > graph.bench_stage_ms[k]


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_every_system_gives_finite_bench_stages(system):
    cfg = _cfg("criteo_terabyte", 65536)
    f = forecast(cfg, device_spec("a100-80gb"), 8, "tf32", SYSTEMS[system])
    assert all(math.isfinite(v) and v >= 0 for v in f.bench_stage_ms.values())
    assert sum(f.bench_stage_ms.values()) > 0


def test_plan_prints_and_carries_the_bench_stages(tmp_path):
    args = ["plan", "--device", "h200", "--config", "A", "--precision", "tf32"]
    out = run_cli(*args, "--json", "--train.batch_size=16384", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data["predicted_bench_stage_ms"]) == set(BENCH_STAGES)
    text = run_cli(*args, "--train.batch_size=16384", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "recscale bench throughput" in text.stdout
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("bench stages"))
    for k in BENCH_STAGES:
        assert f"{k} {data['predicted_bench_stage_ms'][k]:.3f}" in line


@pytest.mark.parametrize(
    "field",
    [
        {"host_stage_weights": (1.0, 1.0)},
        {"host_stage_weights": (1.0, 1.0, 0.0, 1.0, 1.0)},
        {"serial_stages": ("update",)},
    ],
)
def test_a_system_with_bench_fields_that_do_not_fit_is_refused(field):
    with pytest.raises(ValueError, match="System.(host_stage_weights|serial_stages)"):
        replace(RECSCALE, **field)
