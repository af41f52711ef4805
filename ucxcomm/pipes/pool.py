"""``BufferPool``: preallocated receive buffers (host or GPU) that streams hand to the
consumer and take back when it releases them.

Receiving into warm memory matters: a freshly allocated large array costs a page fault
per 4 KiB page on first touch (for host memory; ``cudaMalloc`` per batch on a GPU), which
alone halved the receive bandwidth of a 64 MiB object receive here (see
:mod:`ucxcomm.comm.pool`). A stream reader (:mod:`ucxcomm.pipes.stream`) takes one
buffer per array of a batch from its pool and gives it back when the consumer releases
the batch; the number of batches a consumer may hold is bounded by the stream's window,
so the buffers *out* are bounded. The free list is bounded only by ``limit``: with
batches of one size it holds at most a window's worth, but with sizes that vary (growing
sequence lengths) every smaller buffer stays cached, so give such streams a ``limit``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["BufferPool"]

#: Buffer capacities are rounded up to a multiple of this (so that batches whose sizes
#: differ slightly share buffers).
GRAIN = 4096


class BufferPool:
    """Reusable ``uint8`` buffers on the host (numpy) or on the GPU (cupy).

    Parameters
    ----------
    nbytes : int, optional
        Size of each preallocated buffer (0: none preallocated).
    count : int, optional
        How many buffers of ``nbytes`` to allocate now.
    gpu : bool, optional
        Device memory (``cupy``, on the current device) instead of host memory.
    limit : int, optional
        Most bytes kept for reuse; a released buffer beyond it is freed. Default: no
        bound (a stream's window bounds what is out at once).

    Raises
    ------
    ValueError
        ``nbytes``, ``count`` or ``limit`` is negative.
    UnsupportedError
        ``gpu=True`` without cupy.

    Notes
    -----
    :meth:`take` returns the smallest free buffer that fits, and allocates only when none
    does; :attr:`allocations` and :attr:`reuses` count both outcomes. ``take`` and
    ``give`` are thread-safe (a :class:`~ucxcomm.pipes.stream.Batch` is released on
    the event loop's thread, though: releasing may send a credit).
    """

    def __init__(self, nbytes: int = 0, count: int = 0, *, gpu: bool = False,
                 limit: int | None = None) -> None:
        for name, value in (("nbytes", nbytes), ("count", count)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if limit is not None and (type(limit) is not int or limit < 0):
            raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
        self.gpu = bool(gpu)
        self.limit = limit
        self._xp: Any = np
        if self.gpu:
            try:
                import cupy
            except ImportError as exc:
                from ..errors import UnsupportedError

                raise UnsupportedError("BufferPool(gpu=True) needs cupy "
                                       "(pip install 'ucxcomm[gpu]')") from exc
            self._xp = cupy
        self._free: list[Any] = []  # sorted by capacity
        self._held = 0
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0
        for _ in range(count if nbytes else 0):
            self.give(self._allocate(nbytes))

    def _allocate(self, nbytes: int) -> Any:
        cap = -(-max(nbytes, 1) // GRAIN) * GRAIN
        self.allocations += 1
        return self._xp.empty(cap, dtype=np.uint8)

    def take(self, nbytes: int) -> Any:
        """A buffer of at least ``nbytes`` bytes (1-D ``uint8``; numpy or cupy), from
        the free buffers when one fits, else newly allocated. Give it back with
        :meth:`give` once nobody uses its contents any more."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    del self._free[i]
                    self._held -= buf.nbytes
                    self.reuses += 1
                    return buf
        return self._allocate(nbytes)

    def give(self, buf: Any) -> None:
        """Return ``buf`` (from :meth:`take`) for reuse; freed instead when the pool
        already keeps ``limit`` bytes."""
        n = buf.nbytes
        with self._lock:
            if self.limit is not None and self._held + n > self.limit:
                return
            i = len(self._free)
            while i and self._free[i - 1].nbytes > n:
                i -= 1
            self._free.insert(i, buf)
            self._held += n

    @property
    def held(self) -> int:
        """Bytes kept for reuse now (free buffers)."""
        return self._held

    def clear(self) -> None:
        """Free every buffer kept for reuse."""
        with self._lock:
            self._free.clear()
            self._held = 0

    def __repr__(self) -> str:
        where = "gpu" if self.gpu else "host"
        return (f"<BufferPool {where}: {len(self._free)} free ({self._held} bytes), "
                f"{self.allocations} allocated, {self.reuses} reused>")
