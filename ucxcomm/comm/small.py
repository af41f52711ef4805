"""Small-message collectives on host arrays: the whole schedule posted at once.

For messages of a few KiB the cost of a collective is its per-call overhead, not its
bandwidth. These paths take C-contiguous numpy arrays only (the general algorithms in
:mod:`ucxcomm.comm.algorithms` handle everything else), compute their schedule once per
communicator (the peer order) and reuse scratch memory per shape, post every receive and
every send of the call at once (one message per peer: eager messages need no rounds),
then wait (two ranks: one exchange, the send first and the receive waited for in place).
Reductions combine contributions in rank order, so the results are
bit-identical on every rank and equal to the general algorithms' up to floating-point
association (exact for integers).

With the collective checks on (``UCXCOMM_CHECK_COLLECTIVES``, the default) these calls
take the combined form of :mod:`ucxcomm.comm.fingerprint` instead (compiled:
``comm/_fast.pyx``'s ``exchange``; :meth:`SmallCollectives.settle` finishes it); the
exchanges here serve them with the checks off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TruncationError
from . import fingerprint
from .algorithms import Chan, _whole

if TYPE_CHECKING:
    from .group import Group

__all__ = ["DONE", "SMALL_MAX", "SMALL_MAX_RANKS", "SmallCollectives", "small_ok"]

#: Largest message (bytes, per peer) that takes these paths.
SMALL_MAX = fingerprint.SMALL_MAX
#: Largest communicator that takes them (one message per peer per rank).
SMALL_MAX_RANKS = fingerprint.SMALL_MAX_RANKS


class _Done:
    """An awaitable that is already finished (a call that completed before returning:
    awaiting it returns None at once)."""

    __slots__ = ()

    def __await__(self) -> Any:
        return iter(())

    def __repr__(self) -> str:
        return "<ucxcomm DONE>"


#: What a path that finished inside the call returns.
DONE = _Done()


def small_ok(*arrays: Any) -> bool:
    """All ``arrays`` are C-contiguous numpy arrays of plain data (the only kind these
    paths take; the general path gives the errors for the others)."""
    for a in arrays:
        if type(a) is not np.ndarray or not a.flags.c_contiguous or a.dtype.hasobject:
            return False
    return True


def _fold(ufunc: Any, rows: np.ndarray, out: np.ndarray) -> None:
    """``out = ((rows[0] op rows[1]) op rows[2]) ...``: the rows folded from the left, in
    rank order, as the compiled path does in C (``ufunc.reduce`` sums a (p, 1) array
    pairwise from 8 rows on: a different order)."""
    ufunc(rows[0], rows[1], out=out)
    for k in range(2, rows.shape[0]):
        ufunc(out, rows[k], out=out)


class SmallCollectives:
    """The small-message paths of one communicator (see the module docstring)."""

    def __init__(self, group: Group) -> None:
        self._group = group
        self._transport = group.transport
        self.rank, self.size = group.rank, group.size
        # The schedule, computed once: every other rank, in rank order.
        self._peers = [q for q in range(group.size) if q != group.rank]
        self._scratch: dict[tuple[Any, int], np.ndarray] = {}
        self._pair: dict[tuple[Any, Any], tuple[np.ndarray, Any]] = {}  # (scratch, target)

    async def wait_rest(self, rest: tuple[Any, Any, int, Any], what: str) -> None:
        """Finish a compiled small collective (``comm/_fast.pyx``'s ``FastCollectives``)
        ``what`` that had to wait: ``rest`` is ``(send futures, receive results or
        futures or None, sequence number, rows)``; a receive that overflowed raises
        TruncationError naming ``what``. A checked exchange's :class:`Pending
        <ucxcomm.comm._fast.Pending>` goes to :meth:`settle`."""
        if type(rest) is not tuple:
            return await self.settle(rest)
        sent, got, seq, _ = rest
        ch = Chan(self._group, seq, what)
        ch.sends.extend(sent)
        for r in got:
            if type(r) is tuple:
                try:
                    _whole(r)
                except TruncationError as exc:
                    ch.failed()
                    raise ch._named(exc) from None
            elif r is not None:
                ch.recvs.append(r)
        await self._finish(ch)
        for fut in ch.recvs:  # (receives that had to wait: their results are unchecked)
            res = fut.result()
            if type(res) is tuple:
                try:
                    _whole(res)
                except TruncationError as exc:
                    raise ch._named(exc) from None

    async def allreduce_rest(self, rest: tuple[Any, Any, int, bytearray],
                             recv: np.ndarray) -> None:
        """Finish a compiled Allreduce that had to wait: the rows, once every receive
        is done, folded in rank order as the compiled call does."""
        if type(rest) is not tuple:
            return await self.settle(rest)
        await self.wait_rest(rest, "Allreduce")
        n = recv.size
        _fold(np.add, np.frombuffer(rest[3], recv.dtype, self.size * n).reshape(self.size, n),
              recv.reshape(-1))

    async def rsb_rest(self, rest: tuple[Any, Any, int, bytearray], send: np.ndarray,
                       recv: np.ndarray) -> None:
        """Finish a compiled Reduce_scatter_block that had to wait."""
        if type(rest) is not tuple:
            return await self.settle(rest)
        await self.wait_rest(rest, "Reduce_scatter_block")
        n = send.size // self.size
        rows = np.frombuffer(rest[3], send.dtype, self.size * n).reshape(self.size, n)
        _fold(np.add, rows, recv.reshape(-1)[:n])

    async def settle(self, pend: Any, ufunc: Any = None, out: Any = None) -> None:
        """Finish a checked exchange (``comm/_fast.pyx``'s ``Pending``, the combined
        form of :mod:`ucxcomm.comm.fingerprint`): wait for its operations, check every
        rank's fingerprint, copy or fold (``ufunc`` into the flat ``out``: a reduction
        without a compiled kernel)."""
        if pend.sends or any(f is not None for f in pend.recvs):
            ch = Chan(self._group, pend.seq, pend.kind)
            ch.sends.extend(pend.sends)
            ch.recvs.extend(f for f in pend.recvs if f is not None)
            await self._finish(ch)
        rows = pend.finish()
        if rows is not None:
            _fold(ufunc, rows.view(out.dtype), out)
            pend.release()

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
        await ch.guard(ch.waitall(ch.recvs + ch.sends))

    async def _exchange(self, ch: Chan, peer: int, send: Any, recv: Any) -> None:
        """Two ranks: send first, then wait for the peer's message in place (it is
        microseconds away; no operation, no event-loop turn when it comes in time)."""
        sfut = ch.send(peer, send)
        if ch.recv_spin(peer, recv) is not None or sfut is not None:
            await self._finish(ch)

    # ------------------------------------------------------------ the collectives
    async def bcast(self, ch: Chan, buf: np.ndarray, root: int) -> None:
        """Root sends to every rank at once; the others receive once."""
        t = self._transport
        if self.rank == root:
            target = t.send_ptr(buf)
            for q in self._peers:
                ch.send(q, target)
        elif self.size == 2:  # the only receive: wait for it in place
            if ch.recv_spin(root, t.recv_ptr(buf)) is None:
                return
        else:
            ch.recv(root, t.recv_ptr(buf))
        await self._finish(ch)

    async def allgather(self, ch: Chan, send: np.ndarray, recv: np.ndarray) -> None:
        """Everyone sends its block to everyone; the own block is copied."""
        t, n, r = self._transport, send.size, self.rank
        rt = t.recv_ptr(recv)
        nb = send.nbytes
        recv[r * n:(r + 1) * n] = send
        if self.size == 2:
            q = self._peers[0]
            return await self._exchange(ch, q, t.send_ptr(send), t.subtarget(rt, q * nb, nb))
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        st = t.send_ptr(send)
        for q in self._peers:
            ch.send(q, st)
        await self._finish(ch)

    async def alltoall(self, ch: Chan, send: np.ndarray, recv: np.ndarray) -> None:
        """Block ``q`` to rank ``q``, block ``q`` from rank ``q``; the own one copied."""
        t, r, p = self._transport, self.rank, self.size
        n = send.size // p
        nb = n * send.itemsize
        rt, st = t.recv_ptr(recv), t.send_ptr(send)
        recv[r * n:(r + 1) * n] = send[r * n:(r + 1) * n]
        if p == 2:
            q = self._peers[0]
            return await self._exchange(ch, q, t.subtarget(st, q * nb, nb),
                                        t.subtarget(rt, q * nb, nb))
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        for q in self._peers:
            ch.send(q, t.subtarget(st, q * nb, nb))
        await self._finish(ch)

    async def reduce_scatter_block(self, ch: Chan, send: np.ndarray, recv: np.ndarray,
                                   ufunc: Any) -> None:
        """Block ``q`` of every rank to rank ``q`` (all at once), then this rank reduces
        the contributions to its block in rank order."""
        t, r, p = self._transport, self.rank, self.size
        n = send.size // p
        nb = n * send.itemsize
        out = recv if recv.size == n else recv[:n]
        if p == 2:  # one exchange, then one ufunc call with rank 0's block on the left
            q = self._peers[0]
            tmp, tmp_target = self._pair_scratch(send.dtype, (n,))
            await self._exchange(ch, q, t.subtarget(t.send_ptr(send), q * nb, nb),
                                 tmp_target)
            mine = send[r * n:(r + 1) * n]
            if r == 0:
                ufunc(mine, tmp, out=out)
            else:
                ufunc(tmp, mine, out=out)
            self._pair[(send.dtype, (n,))] = (tmp, tmp_target)
            return
        rows = self._take(send.dtype, n)
        rt, st = t.recv_ptr(rows), t.send_ptr(send)
        rows[r] = send[r * n:(r + 1) * n]
        for q in self._peers:
            ch.recv(q, t.subtarget(rt, q * nb, nb))
        for q in self._peers:
            ch.send(q, t.subtarget(st, q * nb, nb))
        await self._finish(ch)
        _fold(ufunc, rows, out)  # (row by row in rank order, as the compiled path)
        self._give(rows)

    async def allreduce(self, ch: Chan, send: np.ndarray, recv: np.ndarray,
                        ufunc: Any) -> None:
        """Everyone sends its whole input to everyone (one round), then reduces the p
        contributions in rank order: identical results on every rank."""
        if self.size == 2:
            return await self._allreduce_pair(ch, send, recv, ufunc)
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
        _fold(ufunc, rows, recv.reshape(-1))
        self._give(rows)

    async def _allreduce_pair(self, ch: Chan, send: np.ndarray, recv: np.ndarray,
                              ufunc: Any) -> None:
        """Two ranks: one exchange. The send goes first and the receive waits in place
        (the peer's message is microseconds away), then one ufunc call with rank 0's
        contribution on the left."""
        tmp, tmp_target = self._pair_scratch(send.dtype, send.shape)
        await self._exchange(ch, self._peers[0], self._transport.send_ptr(send), tmp_target)
        if self.rank == 0:
            ufunc(send, tmp, out=recv)
        else:
            ufunc(tmp, send, out=recv)
        self._pair[(send.dtype, send.shape)] = (tmp, tmp_target)

    def _pair_scratch(self, dtype: Any, shape: Any) -> tuple[np.ndarray, Any]:
        """Scratch of ``shape`` and its receive target (reused: put it back in
        ``self._pair`` after use; a concurrent call gets its own)."""
        cached = self._pair.pop((dtype, shape), None)
        if cached is None:
            tmp = np.empty(shape, dtype)
            cached = (tmp, self._transport.recv_ptr(tmp))
        return cached

