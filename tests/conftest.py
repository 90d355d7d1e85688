import os

import pytest
import torch

if not torch.cuda.is_available():
    # Kernels pick code paths from the target arch; on a CPU machine CuTe DSL would default to sm_100a.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config, items):
    """GPU tests need a Hopper GPU; without one they are skipped, and the summary says so."""
    has_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability 9.x")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
