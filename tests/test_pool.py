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
    user2 = user.reshape(2, -1)[1:]  # views of views
    del a, user
    gc.collect()
    assert pool.held == 0  # still in use through `user2`
    assert user2.sum() >= 0
    del user2
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


def test_unpickled_arrays_keep_pooled_memory_alive():
    import pickle

    pool = FramePool(limit=8 * MIN_POOLED)
    src = np.arange(MIN_POOLED // 4, dtype=np.float64).reshape(64, -1)
    frames: list = []
    data = pickle.dumps(src, protocol=5, buffer_callback=frames.append)
    buf = pool.take(frames[0].raw().nbytes)
    buf[:] = np.frombuffer(frames[0].raw(), np.uint8)
    got = pickle.loads(data, buffers=[buf])
    part = got[1:3]
    del buf, got
    gc.collect()
    assert pool.held == 0
    reuse = pool.take(2 * MIN_POOLED)  # a different size cannot alias it either
    reuse[:] = 0
    assert np.array_equal(part, src[1:3])
    del part
    gc.collect()
    assert pool.held == src.nbytes
