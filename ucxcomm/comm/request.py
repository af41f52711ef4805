"""``Request`` (a handle on a non-blocking operation) and ``Status``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Iterable
from typing import Any

__all__ = ["Request", "Status"]


class Status:
    """What a receive or probe matched.

    Attributes
    ----------
    source : int
        Rank of the sender in the communicator.
    tag : int
        The message's tag.
    nbytes : int
        Size of the message on the wire (for objects: the serialized size).
    """

    __slots__ = ("nbytes", "source", "tag")

    def __init__(self, source: int, tag: int, nbytes: int) -> None:
        self.source, self.tag, self.nbytes = source, tag, nbytes

    def __repr__(self) -> str:
        return f"Status(source={self.source}, tag={self.tag}, nbytes={self.nbytes})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return (self.source, self.tag, self.nbytes) == (other.source, other.tag, other.nbytes)

    def __hash__(self) -> int:
        return hash((self.source, self.tag, self.nbytes))

    def count(self, dtype: Any = None) -> int:
        """Number of ``dtype`` elements in the message (bytes when ``dtype`` is None)."""
        if dtype is None:
            return self.nbytes
        import numpy as np

        return self.nbytes // np.dtype(dtype).itemsize


class Request:
    """A pending non-blocking operation (``isend``, ``irecv``, ``Isend``, ``Irecv``...).

    ``await req`` returns the operation's result (the object for ``irecv``, a
    :class:`Status` for ``Irecv``, ``None`` for sends).
    """

    __slots__ = ("_canceller", "_fut", "_settle")

    def __init__(self, fut: asyncio.Future, canceller: Callable[[], bool] | None = None,
                 settle: Callable[[], Awaitable[None]] | None = None) -> None:
        self._fut = fut
        self._canceller = canceller
        # For receives into a user buffer: wait until UCX no longer writes it.
        self._settle = settle

    @classmethod
    def completed(cls, result: Any = None) -> Request:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return cls(fut)

    @classmethod
    def failed(cls, exc: BaseException) -> Request:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
        return cls(fut)

    def __await__(self) -> Generator[Any, None, Any]:
        if self._settle is None:
            return self._fut.__await__()
        return self._wait().__await__()

    async def _wait(self) -> Any:
        try:
            return await self._fut
        except asyncio.CancelledError:
            await self._after_cancel()
            raise

    async def _after_cancel(self) -> None:
        """A cancelled wait: withdraw the receive, or let a matched one finish."""
        if self._canceller is not None and self._canceller():
            return
        if self._settle is not None:
            await self._settle()

    def done(self) -> bool:
        return self._fut.done()

    def test(self) -> tuple[bool, Any]:
        """``(True, result)`` if the operation finished (raising its error, if any),
        else ``(False, None)``; never blocks."""
        if not self._fut.done():
            return False, None
        return True, self._fut.result()

    def cancel(self) -> bool:
        """Cancel a receive that has not matched a message yet.

        Returns True if the operation was cancelled (awaiting it then raises
        ``asyncio.CancelledError``); False if it had already matched or finished, in
        which case it completes normally.
        """
        if self._fut.done():
            return False
        if self._canceller is not None and self._canceller():
            self._fut.cancel()
            return True
        return False

    def cancelled(self) -> bool:
        return self._fut.cancelled()

    @staticmethod
    async def waitall(requests: Iterable[Request | Awaitable[Any]]) -> list[Any]:
        """Wait for every request; returns their results in order.

        If one fails, the others still run to completion before the first error is raised
        (so no buffer is left in use behind your back).
        """
        reqs = list(requests)
        try:
            results = await asyncio.gather(*(_as_future(r) for r in reqs),
                                           return_exceptions=True)
        except asyncio.CancelledError:
            for r in reqs:
                if isinstance(r, Request):
                    await r._after_cancel()
            raise
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return list(results)

    @staticmethod
    async def waitany(requests: Iterable[Request]) -> tuple[int, Any]:
        """Wait for the first request to finish; returns ``(index, result)``."""
        futs = [_as_future(r) for r in requests]
        done, _ = await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
        for i, fut in enumerate(futs):
            if fut in done:
                return i, fut.result()
        raise AssertionError("unreachable")  # pragma: no cover


def _as_future(r: Request | Awaitable[Any]) -> asyncio.Future:
    if isinstance(r, Request):
        return r._fut
    return asyncio.ensure_future(r)
