"""``Endpoint``: a connection from our worker to one peer worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ClosedError
from . import _ucx

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Endpoint"]


class Endpoint:
    """A UCX endpoint created by :meth:`Worker.connect`.

    ``peer`` is an opaque label (the comm layer uses world ranks) used to fail pending
    operations when that peer is declared dead.
    """

    __slots__ = ("_closed", "_ep", "_handle", "_peers", "_worker", "peer")

    def __init__(self, worker: Worker, ucx_ep: Any, peer: Any = None) -> None:
        self._worker = worker
        self._ep = ucx_ep
        self._handle = ucx_ep.handle
        self.peer = peer
        self._peers = frozenset((peer,)) if peer is not None else None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the endpoint is closed")

    def isend(self, buf: Any, tag: int) -> Any:
        """Post a tag send; returns a future, or None if it already completed."""
        if self._closed:
            raise ClosedError("the endpoint is closed")
        return self._worker.send(self._handle, buf, tag, self._peers)

    def isend_raw(self, target: tuple[Any, int, Any, bool], tag: int) -> Any:
        """Like :meth:`isend` for a target prepared by ``Worker.send_ptr``."""
        if self._closed:
            raise ClosedError("the endpoint is closed")
        return self._worker.send_raw(self._handle, target, tag, self._peers)

    async def send(self, buf: Any, tag: int = 0) -> None:
        """Send ``buf`` with a 64-bit UCX ``tag``; returns when ``buf`` may be reused.

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous buffer (nothing is sent).
        ClosedError, PeerFailure
        """
        fut = self.isend(buf, tag)
        if fut is not None:
            await self._worker.complete(fut)

    async def recv(self, buf: Any, tag: int = 0) -> None:
        """Receive the next message with exactly ``tag`` (from any endpoint) into ``buf``.

        Raises
        ------
        TypeError, ValueError
            ``buf`` is not a contiguous writable buffer.
        TruncationError, ClosedError, PeerFailure
        """
        self._check_open()
        worker = self._worker
        fut = worker.tag_recv(worker.recv_ptr(buf), tag, peers=self._peers)
        if fut is not None:
            await worker.complete(fut)

    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes UCX chose, e.g. ``[("posix", "memory")]``."""
        self._check_open()
        return _ucx.endpoint_transports(self._handle)

    def abort(self) -> None:
        """Close at once (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ep.close()
        except Exception:  # pragma: no cover - UCX already tore it down
            pass

    async def close(self) -> None:
        self.abort()
