import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter when there is no GPU. The variable must
# be set before triton compiles anything; setting it here (before test modules import triton) does that.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from published_reads import install

    PUBLISHED_READS_CHECKED = install()  # every interpreted launch: .cg reads must be of final data


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Many tiny ops: on a 2-core machine, intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
