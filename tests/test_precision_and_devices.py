"""train.precision, and training on the test device (RECSCALE_TEST_DEVICE: cpu, or cuda
on a GPU machine, where the CUDA-only tests below run instead of skipping)."""

from __future__ import annotations

import pytest
import torch

from recscale.config import ConfigError, load_config
from recscale.train.run import train
from recscale.train.step import resolve_device

QUIET = dict(echo=lambda *_: None)
FAST = ["--train.progress=false", "--train.steps=200", "--data.eval_samples=8192"]


def test_auto_device_is_the_test_device(device):
    assert resolve_device("auto") == device


def test_a_test_device_that_is_no_device_names_the_variable(monkeypatch):
    """``RECSCALE_TEST_DEVICE=cdua`` was torch's "Expected one of cpu, cuda, ipu, ..."
    traceback in every run; it names the variable and its choices."""
    monkeypatch.setenv("RECSCALE_TEST_DEVICE", "cdua")
    with pytest.raises(ConfigError) as err:
        resolve_device("auto")
    assert err.value.key == "RECSCALE_TEST_DEVICE" and "'cdua'" in str(err.value)
    assert resolve_device("cpu") == torch.device("cpu")  # only auto reads it


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_precision_trains_like_fp32(precision):
    """Within 0.01 AUC of fp32; tf32 on a CPU (no TF32 units) is the fp32 run exactly,
    and the run says so where it starts (it had changed nothing, without a word)."""
    from recscale.train.precision import _cpu_flags

    base = train(load_config("debug", FAST), None, **QUIET)
    lines: list[str] = []
    over = [*FAST, f"--train.precision={precision}"]
    other = train(load_config("debug", over), None, echo=lines.append)
    assert other["auc"] == pytest.approx(base["auc"], abs=0.01)
    if precision == "tf32" and base["device"] == "cpu" and "amx_tf32" not in _cpu_flags():
        assert other["auc"] == base["auc"] and other["logloss"] == base["logloss"]
        assert any("tf32 is a GPU GEMM format" in line for line in lines), lines
    else:
        assert not any("tf32 is a GPU GEMM format" in line for line in lines), lines


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "mv", "addmv"])
def test_emulated_bf16_gemms_give_torchs_bf16_results(op):
    """On a CPU without bf16 instructions a bf16 GEMM runs as an fp32 GEMM of the same
    values, rounded once: torch's own bf16 kernel (fp32 accumulation) differs from it
    only in the order of the sums, so at most by a bf16 rounding step of the result."""
    from recscale.train.precision import EmulatedBF16Gemms

    a2, b2 = _bf16(64, 96, seed=1), _bf16(96, 48, seed=2)
    a3, b3 = _bf16(4, 32, 40, seed=3), _bf16(4, 40, 24, seed=4)
    args = {
        "mm": (a2, b2),
        "addmm": (_bf16(64, 48, seed=5), a2, b2),
        "bmm": (a3, b3),
        "baddbmm": (_bf16(4, 32, 24, seed=6), a3, b3),
        "mv": (a2, _bf16(96, seed=7)),
        "addmv": (_bf16(64, seed=8), a2, _bf16(96, seed=7)),
    }[op]
    fn = getattr(torch, op)
    ref = fn(*args)
    with EmulatedBF16Gemms():
        got = fn(*args)
    exact = fn(*(x.double() for x in args))  # the same values, no rounding but the end's
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    scale = exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2**-8 * scale
    assert (got.float() - ref.float()).abs().max().item() <= 2**-7 * scale


def test_an_emulated_bf16_step_runs_its_gemms_in_fp32_forward_and_backward(monkeypatch):
    """Where ``bf16_hardware`` is ``emulated`` (AVX2), a bf16 step's GEMMs - the forward's
    and the backward's - go through the emulation; where the CPU has bf16 instructions
    they are torch's own. The model it trains is bf16's (AUC as fp32's)."""
    from recscale.train import precision

    seen: list[str] = []
    dispatch = precision.EmulatedBF16Gemms.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        if func in precision._BF16_GEMMS and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args
        ):
            seen.append(str(func))
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(precision.EmulatedBF16Gemms, "__torch_dispatch__", spy)
    overrides = [*FAST, "--train.precision=bf16", "--train.device=cpu", "--model.kernels=torch"]
    monkeypatch.setattr(precision, "bf16_hardware", lambda _d: "emulated")
    emulated = train(load_config("debug", overrides), None, **QUIET)
    # 200 steps of 5 layers: a forward GEMM each, a weight gradient each and an input
    # gradient for all but the first; the eval's forward GEMMs
    assert seen.count("aten.addmm.default") >= 5 * 200 and seen.count("aten.mm.default") >= 9 * 200
    seen.clear()
    monkeypatch.setattr(precision, "bf16_hardware", lambda _d: "amx")
    assert precision.emulates_bf16("bf16", torch.device("cpu")) is False
    with precision.autocast("bf16", torch.device("cpu")):
        torch.nn.Linear(8, 4)(torch.randn(3, 8))
    assert seen == []
    fp32 = train(load_config("debug", FAST), None, **QUIET)
    assert emulated["auc"] == pytest.approx(fp32["auc"], abs=0.01)


def test_bad_precision_names_the_key():
    with pytest.raises(ConfigError, match="train.precision"):
        load_config("debug", ["--train.precision=fp8"]).validate()


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
def test_cuda_training_matches_the_cpu(device):
    if device.type != "cuda":
        pytest.skip("RECSCALE_TEST_DEVICE is not cuda")
    gpu = train(load_config("debug", [*FAST, "--train.device=cuda"]), None, **QUIET)
    cpu = train(load_config("debug", [*FAST, "--train.device=cpu"]), None, **QUIET)
    assert gpu["device"].startswith("cuda")
    assert gpu["auc"] == pytest.approx(cpu["auc"], abs=2e-3)


@cuda_only
def test_cuda_host_tier_trains_like_device_memory(device, tmp_path):
    if device.type != "cuda":
        pytest.skip("RECSCALE_TEST_DEVICE is not cuda")
    args = [*FAST, "--train.device=cuda"]
    hbm = train(load_config("debug", args), None, **QUIET)
    host = train(
        load_config(
            "debug", [*args, "--embedding.placement=host", "--embedding.cache_bytes=120000"]
        ),
        None,
        **QUIET,
    )
    assert host["embedding_cache"]["hit_rate"] < 1.0
    assert host["auc"] == pytest.approx(hbm["auc"], abs=2e-3)


def test_moving_a_storage_keeps_its_step_count_on_the_host():
    """``shard()`` moves the model to the compute device; each storage's step count must
    stay on the CPU (read every step). ``meta`` stands in for a GPU here: every other
    tensor follows the move, the count does not."""
    from recscale.config.schema import EmbeddingConfig
    from recscale.embedding.cached_storage import CachedStorage
    from recscale.embedding.compressed import build_compressed
    from recscale.embedding.optimizers import SparseAdam
    from recscale.embedding.storage import DeviceStorage

    storages = [
        DeviceStorage(50, 8, SparseAdam(lr=0.1), torch.device("cpu"), "torch"),
        CachedStorage(50, 8, SparseAdam(lr=0.1), None, 10, kernel="torch"),
        build_compressed(
            "qr", 500, 8, 4, EmbeddingConfig(), SparseAdam(lr=0.1), torch.device("cpu")
        ),
    ]
    for s in storages:
        s.to("meta")
        assert s.step.device.type == "cpu", type(s).__name__
        others = [t for n, t in s.named_buffers() if n.split(".")[-1] != "step"]
        others += list(s.parameters())
        steps = [t for n, t in s.named_buffers() if n.split(".")[-1] == "step"]
        assert all(t.device.type == "cpu" for t in steps), type(s).__name__
        # (a CachedStorage's cache is made on its device, not moved: no buffers)
        assert all(t.device.type == "meta" for t in others), type(s).__name__
        assert others or isinstance(s, CachedStorage)


def test_cuda_without_cuda_is_one_line_naming_the_key(tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "recscale",
            "train",
            "--config",
            "debug",
            "--train.device=cuda",
            "--train.steps=2",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.device" in lines[0], r.stderr


def test_bf16_says_where_it_runs_and_warns_when_it_will_not_pay(monkeypatch):
    from recscale.train import precision

    assert precision.bf16_hardware(torch.device("cpu")) in ("amx", "avx512_bf16", "emulated")
    assert precision.bf16_note("fp32", torch.device("cpu")) is None
    fp32, bf16 = precision.cpu_gemm_rates()  # measured on this host
    assert fp32 > 0 and bf16 > 0

    def run_lines() -> list[str]:
        lines: list[str] = []
        overrides = [*FAST, "--train.steps=5", "--train.precision=bf16", "--train.device=cpu"]
        train(  # the CPU's note (under RECSCALE_TEST_DEVICE=cuda too)
            load_config("debug", overrides),
            None,
            echo=lines.append,
        )
        return [x for x in lines if "train.precision=bf16" in x]

    monkeypatch.setattr(precision, "bf16_hardware", lambda _d: "emulated")
    monkeypatch.setattr(precision, "cpu_gemm_rates", lambda: (300.0, 150.0))
    (line,) = run_lines()
    assert "emulated" in line and "150 GFLOP/s" in line and "300" in line
    # bf16 instructions that lose to fp32 (a Sapphire Rapids VM without AMX) are said too
    monkeypatch.setattr(precision, "bf16_hardware", lambda _d: "avx512_bf16")
    (line,) = run_lines()
    assert "avx512_bf16" in line and "0.50x" in line and "no faster than fp32" in line
    # ... and a CPU whose bf16 GEMMs pay (a Zen 4: about twice fp32's rate) says nothing
    monkeypatch.setattr(precision, "cpu_gemm_rates", lambda: (220.0, 450.0))
    assert run_lines() == []
    monkeypatch.setattr(precision, "bf16_hardware", lambda _d: "amx")
    assert run_lines() == []
    assert precision.bf16_note("bf16", torch.device("meta")) is None  # not a CPU


def _sharded_on(compute: str, cache_on: str):
    """The debug model with every table in the host tier (the GPU-run tier), sharded
    for a plan whose compute device is ``compute`` - ``meta`` standing in for a GPU -
    its storages built with their caches on ``cache_on``."""
    from recscale.distributed.context import DistContext
    from recscale.distributed.model_parallel import one_rank_plan, shard
    from recscale.embedding.placement import storage_factory
    from recscale.models.dlrm import build_model
    from recscale.planner.from_config import with_tiers

    cfg = load_config("debug", ["--embedding.placement=host", "--model.kernels=torch"])
    dev = torch.device(compute)
    names = [f"C{i + 1}" for i in range(len(cfg.model.table_sizes))]
    plan = with_tiers(one_rank_plan(names), [("host", 4096)] * len(names))
    model = build_model(cfg.model, cfg.embedding, device=dev, materialize_embeddings=False)
    make = storage_factory(cfg.embedding, torch.device(cache_on), "torch")
    shard(model, plan, DistContext(device=dev), make)
    return model


def test_each_tensor_of_a_gpu_plan_lives_where_the_plan_puts_it():
    """Rows' cache, weights and optimizer state on the compute device; the step count,
    the host tier's rows and the cache's bookkeeping on the host."""
    model = _sharded_on("meta", "meta")
    seen = {True: set(), False: set()}
    for s in model.embeddings.storages():
        for name, t, on_compute in s.homes():
            assert t.device.type == ("meta" if on_compute else "cpu"), name
            seen[on_compute].add(name.split(".", 1)[0])
    assert {"cache_weight", "cache_state"} <= seen[True]
    assert {"step", "slot_of_row", "host_rows"} <= seen[False]
    assert all(p.device.type == "meta" for p in model.dense_parameters())


def test_a_table_off_its_planned_device_is_one_line():
    from recscale.embedding.storage import DevicePlacementError

    with pytest.raises(
        DevicePlacementError, match=r"table C1 \(its .*: cache_weight is on cpu, belongs on meta"
    ):
        _sharded_on("meta", "cpu")  # the cache made on the host under a "GPU" run
