import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from dist_utils import SUPPORTED_TRITON, close_pools, get_pool, test_device_kind  # noqa: E402

from deep_ep.transport import triton_supported  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not (test_device_kind() == "cuda" and torch.cuda.is_available()):
        skips["gpu"] = pytest.mark.skip(reason="needs CUDA GPUs (set DEEP_EP_TEST_DEVICE=cuda on a GPU machine)")
    if not triton_supported():
        skips["nvlink_kernels"] = pytest.mark.skip(
            reason=f"the NVLink kernels need Triton {SUPPORTED_TRITON} or newer")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    close_pools()


@pytest.fixture
def pool():
    """`pool(world_size)` -> a RankPool of that many rank processes (kept for the whole session)."""
    return get_pool
