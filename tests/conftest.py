import pytest
import torch


@pytest.fixture(autouse=True)
def _small_threads():
    # Tests run on 2-core CI machines; keep intra-op threads fixed for determinism.
    torch.set_num_threads(2)
    yield
