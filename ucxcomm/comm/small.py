"""Small-message collectives on host arrays: the whole schedule posted at once.

For messages of a few KiB the cost of a collective is its per-call overhead, not its
bandwidth. These paths take C-contiguous numpy arrays only (the general algorithms in
:mod:`ucxcomm.comm.algorithms` handle everything else), compute their schedule once per
communicator (the peer order) and reuse scratch memory per shape, post every receive and
every send of the call at once (one message per peer: eager messages need no rounds),
then wait. Reductions combine contributions in rank order, so the results are
bit-identical on every rank and equal to the general algorithms' up to floating-point
association (exact for integers).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np

from .algorithms import Chan

if TYPE_CHECKING:
    from .group import Group

__all__ = ["SMALL_MAX", "SmallCollectives", "small_ok"]

#: Largest message (bytes, per peer) that takes these paths.
SMALL_MAX = 8192
#: Largest communicator that takes them (one message per peer per rank).
SMALL_MAX_RANKS = 32


def small_ok(*arrays: Any) -> bool:
    """All ``arrays`` are C-contiguous numpy arrays (the only kind these paths take)."""
    for a in arrays:
        if type(a) is not np.ndarray or not a.flags.c_contiguous:
            return False
    return True


class SmallCollectives:
    """The small-message paths of one communicator (see the module docstring)."""

    def __init__(self, group: Group) -> None:
        self._group = group
        self._transport = group.transport
        self.rank, self.size = group.rank, group.size
        # The schedule, computed once: every other rank, in rank order.
        self._peers = [q for q in range(group.size) if q != group.rank]
        self._scratch: dict[tuple[Any, int], np.ndarray] = {}

    def usable(self, nbytes: int) -> bool:
        return 1 < self.size <= SMALL_MAX_RANKS and nbytes <= SMALL_MAX

    def _take(self, dtype: Any, n: int) -> np.ndarray:
        """A ``(size, n)`` scratch array (reused; a concurrent call gets its own)."""
        arr = self._scratch.pop((dtype, n), None)
        if arr is None:
            arr = np.empty((self.size, n), dtype)
        return arr

    def _give(self, arr: np.ndarray) -> None:
        self._scratch[(arr.dtype, arr.shape[1])] = arr

    async def _finish(self, ch: Chan) -> None:
        try:
            await ch.waitall(ch.recvs + ch.sends)
        except asyncio.CancelledError:
            await ch.withdraw()
            raise
        except BaseException:
            ch.failed()
            raise

    # ------------------------------------------------------------ the collectives
    async def bcast(self, ch: Chan, buf: np.ndarray, root: int) -> None:
        """Root sends to every rank at once; the others receive once."""
        t = self._transport
        if self.rank == root:
            target = t.send_ptr(buf)
            for q in self._peers:
                ch.send(q, target)
        else:
            ch.recv(root, t.recv_ptr(buf))
        await self._finish(ch)

    async def allgather(self, ch: Chan, send: np.ndarray, recv: np.ndarray) -> None:
        """Everyone sends its block to everyone; the own block is copied."""
        t, n, r = self._transport, send.size, self.rank
        rt = t.recv_ptr(recv)
        nb = send.nbytes
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        st = t.send_ptr(send)
        for q in self._peers:
            ch.send(q, st)
        recv[r * n:(r + 1) * n] = send
        await self._finish(ch)

    async def alltoall(self, ch: Chan, send: np.ndarray, recv: np.ndarray) -> None:
        """Block ``q`` to rank ``q``, block ``q`` from rank ``q``; the own one copied."""
        t, r, p = self._transport, self.rank, self.size
        n = send.size // p
        nb = n * send.itemsize
        rt, st = t.recv_ptr(recv), t.send_ptr(send)
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        for q in self._peers:
            ch.send(q, t.subtarget(st, q * nb, nb))
        recv[r * n:(r + 1) * n] = send[r * n:(r + 1) * n]
        await self._finish(ch)

    async def reduce_scatter_block(self, ch: Chan, send: np.ndarray, recv: np.ndarray,
                                   ufunc: Any) -> None:
        """Block ``q`` of every rank to rank ``q`` (all at once), then this rank reduces
        the contributions to its block in rank order."""
        t, r, p = self._transport, self.rank, self.size
        n = send.size // p
        nb = n * send.itemsize
        rows = self._take(send.dtype, n)
        rt, st = t.recv_ptr(rows), t.send_ptr(send)
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        for q in self._peers:
            ch.send(q, t.subtarget(st, q * nb, nb))
        rows[r] = send[r * n:(r + 1) * n]
        await self._finish(ch)
        # Row by row in rank order (numpy reduces a leading axis sequentially).
        ufunc.reduce(rows, axis=0, out=recv if recv.size == n else recv[:n])
        self._give(rows)

    async def allreduce(self, ch: Chan, send: np.ndarray, recv: np.ndarray,
                        ufunc: Any) -> None:
        """Everyone sends its whole input to everyone (one round), then reduces the p
        contributions in rank order: identical results on every rank."""
        t, r = self._transport, self.rank
        n = send.size
        nb = send.nbytes
        rows = self._take(send.dtype, n)
        rt = t.recv_ptr(rows)
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        st = t.send_ptr(send)
        for q in self._peers:
            ch.send(q, st)
        rows[r] = send.reshape(-1)
        await self._finish(ch)
        ufunc.reduce(rows, axis=0, out=recv.reshape(-1))  # in rank order, row by row
        self._give(rows)
