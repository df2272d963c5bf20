import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. It must be set before
# triton is first imported, which happens only inside test modules.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
