"""pytest hooks. The helpers the tests share (launching SPMD programs, the case registry)
live in :mod:`ucxcomm.testing`."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import cupy

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs CUDA and cupy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
