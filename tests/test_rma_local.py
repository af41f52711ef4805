"""RMA argument checks in one process (a region of our own, reached through the RMA
engine's endpoint to itself): every bad call raises before anything moves."""

from __future__ import annotations

import numpy as np
import pytest

import ucxcomm
from ucxcomm.transport import Worker

pytestmark = pytest.mark.timeout(60)


class _FakeGpuArray:
    """Claims device memory (nothing is ever read from it: the call must refuse first)."""

    @property
    def __cuda_array_interface__(self):
        return {"data": (0x1000, False), "shape": (4,), "typestr": "<f8", "version": 3,
                "strides": None}


async def test_bad_rma_calls_move_nothing():
    worker = Worker()
    mem = np.zeros(8, np.int64)
    region = worker.register(mem)
    remote = worker.remote_memory(region.rkey, region.address, region.nbytes)
    await remote.put(np.arange(2, dtype=np.int64), 8)
    await remote.flush()
    assert mem.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    before = mem.copy()
    bad = [
        (lambda: remote.put(np.ones(2, np.int64), 56), ucxcomm.WindowError),
        (lambda: remote.get(np.ones(9, np.int64), 0), ucxcomm.WindowError),
        (lambda: remote.put(np.ones(1), -8), ucxcomm.WindowError),
        (lambda: remote.fetch_add(1, 4, np.int64), ucxcomm.WindowError),  # misaligned
        (lambda: remote.fetch_add(1, 64, np.int64), ucxcomm.WindowError),
        (lambda: remote.atomic("nand", 1, 0, np.int64), ValueError),
        (lambda: remote.atomic("add", 1.5, 0, np.float64), TypeError),
        (lambda: remote.atomic_many("cswap", [1], 0, np.int64), ValueError),
        (lambda: remote.get(bytes(8), 0), ValueError),  # read-only destination
        (lambda: remote.put(np.ones((4, 4))[:, 0], 0), ValueError),  # not contiguous
        (lambda: remote.put(_FakeGpuArray(), 0), ucxcomm.UnsupportedError),
    ]
    for i, (call, exc) in enumerate(bad):
        with pytest.raises(exc):
            await call()
        assert np.array_equal(mem, before), i
    with pytest.raises(ValueError, match="not a ucxcomm remote key"):
        worker.remote_memory(b"junk", region.address, region.nbytes)
    with pytest.raises(ValueError):
        worker.remote_memory(region.rkey[:-3], region.address, region.nbytes)
    olds = await remote.atomic_many("add", [5, 6], 32, np.int64, fetch=True)
    await remote.flush()
    assert olds == [0, 0] and mem[4:6].tolist() == [5, 6]
    remote.close()
    with pytest.raises(ucxcomm.ClosedError):
        await remote.put(np.ones(1), 0)
    region.close()
    await worker.close()
