import os
import signal

import pytest
import torch

# The device the tests train on: RECSCALE_TEST_DEVICE (cpu unless set; `cuda` on a GPU
# machine). It pins train.device=auto, in this process and in every CLI subprocess.
os.environ.setdefault("RECSCALE_TEST_DEVICE", "cpu")
# tests' tiny benchmarks must not set this host's best probe readings (bench/hardware.py)
os.environ["RECSCALE_HARDWARE_RECORD"] = "off"
# Without a GPU, Triton kernels run through Triton's interpreter on CPU tensors (must be
# set before any kernel is defined, i.e. before recscale.embedding.triton_kernels loads).
if os.environ["RECSCALE_TEST_DEVICE"] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    dev = torch.device(os.environ["RECSCALE_TEST_DEVICE"])
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("RECSCALE_TEST_DEVICE=cuda but no CUDA device")
    return dev


@pytest.fixture(autouse=True)
def _small_threads():
    # Tests run on 2-core CI machines; keep intra-op threads fixed for determinism.
    torch.set_num_threads(2)
    yield


@pytest.fixture
def sigint_handled():
    """SIGINT handled as in an interactive process (Python's KeyboardInterrupt handler)
    for the tests that send it to themselves, even when the run started with SIGINT
    ignored (a background job of a non-interactive shell: recscale then rightly leaves
    it ignored, and the signal would never arrive)."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
