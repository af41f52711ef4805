"""FramePool: received payload memory is recycled once the user lets go of it."""

from __future__ import annotations

import gc

import numpy as np

from ucxcomm.comm.pool import MIN_POOLED, FramePool


def test_memory_returns_and_is_reused():
    pool = FramePool(limit=8 * MIN_POOLED)
    a = pool.take(2 * MIN_POOLED)
    addr = a.__array_interface__["data"][0]
    user = np.frombuffer(a, dtype=np.float64)  # what unpickling does with the payload
    del a
    gc.collect()
    assert pool.held == 0  # still in use through `user`
    del user
    gc.collect()
    assert pool.held == 2 * MIN_POOLED
    b = pool.take(2 * MIN_POOLED)
    assert b.__array_interface__["data"][0] == addr and pool.held == 0


def test_bound_and_small_sizes():
    pool = FramePool(limit=MIN_POOLED)
    x, y = pool.take(MIN_POOLED), pool.take(MIN_POOLED)
    del x, y
    gc.collect()
    assert pool.held == MIN_POOLED  # the second one was over the bound and freed
    small = pool.take(100)
    assert small.nbytes == 100 and pool.held == MIN_POOLED
    assert FramePool(limit=0).take(MIN_POOLED).nbytes == MIN_POOLED
