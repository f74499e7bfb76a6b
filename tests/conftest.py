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

from recscale.distributed import spawn  # noqa: E402 - after the environment above

# The ranks and forked CLI runs of the tests (helpers.forked_cli) train and parse: their
# fork server imports those modules once, not each of them (1.2 s each on 2 vCPUs).
spawn.also_preload("recscale.train.run", "recscale.cli.main")


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


@pytest.fixture(params=["wide", "wide-streamed", "tiles", "avx2"])
def wide_interaction(request):
    """Every native interaction path: for d = 16 and 32 (k <= 32) "wide" is AVX-512's
    narrow kernels (native/dot_interaction_narrow.c); for d >= 64 the AVX-512 tiles
    (native/dot_interaction_avx512.c, where the CPU has AVX-512; "streamed": its
    backward's non-temporal stores, which large batches take, at any size), the AVX2
    forward tiles (2 x 4 rows; the backward then takes the AVX2 kernel) and the AVX2
    pair kernels."""
    import ctypes

    from recscale import native

    if request.param.startswith("wide") and not native.has_avx512():
        pytest.skip(f"AVX-512 interaction kernels: {native.status()}")
    flag = ctypes.c_int.in_dll(native.library(), "recscale_dot_wide")
    stream = ctypes.c_int64.in_dll(native.library(), "recscale_dot_stream_bytes")
    saved = flag.value, stream.value
    flag.value = {"wide": 1, "wide-streamed": 1, "tiles": 2, "avx2": 0}[request.param]
    if request.param == "wide-streamed":
        stream.value = 0
    yield request.param
    flag.value, stream.value = saved


@pytest.fixture(scope="module")
def medium_dataset(tmp_path_factory):
    """A preprocessed dataset of 5,000 synthetic Criteo lines (split 'train' only)."""
    from helpers import make_dataset

    return make_dataset(tmp_path_factory.mktemp("medium"), 5000, seed=1, hash_size=1000)
