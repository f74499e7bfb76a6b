"""train.precision, and training on the test device (RECSCALE_TEST_DEVICE: cpu, or cuda
on a GPU machine, where the CUDA-only tests below run instead of skipping)."""

from __future__ import annotations

import pytest
import torch

from recscale.config import ConfigError, load_config
from recscale.train.run import resolve_device, train

QUIET = dict(echo=lambda *_: None)
FAST = ["--train.progress=false", "--train.steps=200", "--data.eval_samples=8192"]


def test_auto_device_is_the_test_device(device):
    assert resolve_device("auto") == device


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_precision_trains_like_fp32(precision):
    base = train(load_config("debug", FAST), None, **QUIET)
    other = train(load_config("debug", [*FAST, f"--train.precision={precision}"]), None, **QUIET)
    assert other["auc"] == pytest.approx(base["auc"], abs=0.01)
    if precision == "tf32":  # fp32 tensors: on a CPU exactly the fp32 run
        if base["device"] == "cpu":
            assert other["auc"] == base["auc"]


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
    host = train(load_config("debug", [*args, "--embedding.placement=host",
                                       "--embedding.cache_bytes=20000"]), None, **QUIET)  # fmt: skip
    assert host["embedding_cache"]["hit_rate"] < 1.0
    assert host["auc"] == pytest.approx(hbm["auc"], abs=2e-3)
