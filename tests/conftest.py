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


try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the dev extra brings it; without it the property tests are not collected
    _hypothesis_settings = None
if _hypothesis_settings is not None:
    # Property tests draw the same examples on every run, so a CI failure reproduces and a rare
    # example cannot turn CI red at random; HYPOTHESIS_PROFILE=explore draws fresh ones locally.
    _hypothesis_settings.register_profile("ci", derandomize=True)
    _hypothesis_settings.register_profile("explore", derandomize=False)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
