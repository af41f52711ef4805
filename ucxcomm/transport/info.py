"""What UCX this process would use: version, library, devices/transports, CUDA, RDMA."""

from __future__ import annotations

import os
from typing import Any

from . import _ucx

__all__ = ["collect"]


def _rdma_devices() -> list[str]:
    root = "/sys/class/infiniband"
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


async def collect() -> dict[str, Any]:
    """A report for ``ucxcomm info``: creates a worker and an endpoint to itself."""
    from .worker import Worker

    worker = Worker()
    try:
        ep = worker.connect(worker.address)
        lanes = [f"{tl}/{dev}" for tl, dev in ep.transports()]
        rdma = _rdma_devices()
        return {
            "ucx_version": _ucx.ucx_version(),
            "libucp": _ucx.libucp_path(),
            "rdma_devices": rdma,
            "rdma": "yes" if rdma else "no (no device under /sys/class/infiniband)",
            "cuda_support": worker.cuda_support,
            "self_endpoint_lanes": lanes,
            "UCX_TLS": os.environ.get("UCX_TLS", "(UCX default: all available)"),
        }
    finally:
        await worker.close()
