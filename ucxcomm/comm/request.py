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
    :class:`Status` for ``Irecv``, ``None`` for sends). Awaiting progresses the transport
    from the awaiting task (like a blocking call), so ``await`` right after posting costs
    no event-loop round trip.
    """

    __slots__ = ("_canceller", "_fut", "_record", "_result", "_token", "_transport")

    def __init__(self, fut: asyncio.Future | None, transport: Any = None,
                 canceller: Callable[[], bool] | None = None, result: Any = None,
                 record: Any = None, token: int = 0) -> None:
        self._fut = fut  # None: completed with ``result`` when it was posted
        # For receives into a user buffer (cancel, settle) and for awaiting
        # (Transport.complete); None for requests made of tasks.
        self._transport = transport
        self._canceller = canceller
        self._result = result
        # The recorder and token of the operation's flight record (comm/trace.py),
        # ended when this request sees the operation end (await, test, done, wait*,
        # cancel); None when not recorded.
        self._record = record
        self._token = token

    def _seen(self) -> None:
        """The operation ended (its future is done): end its flight record, once."""
        rec = self._record
        if rec is not None and self._fut is not None:
            self._record = None
            rec.seen(self._token, self._fut)

    @classmethod
    def completed(cls, result: Any = None) -> Request:
        """A request that finished when it was posted (no future is made)."""
        return cls(None, result=result)

    @classmethod
    def failed(cls, exc: BaseException) -> Request:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
        return cls(fut)

    def _future(self) -> asyncio.Future:
        if self._fut is None:  # (not kept: a completed request may be shared)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(self._result)
            return fut
        return self._fut

    def __await__(self) -> Generator[Any, None, Any]:
        fut = self._fut
        if fut is None:
            return self._result
            yield  # pragma: no cover - makes this a generator
        if fut.done():
            if self._record is not None:
                self._seen()
            return fut.result()
        return (yield from self._wait(fut).__await__())

    async def _wait(self, fut: asyncio.Future) -> Any:
        try:
            if self._transport is not None:
                return await self._transport.complete(fut)
            return await fut
        except asyncio.CancelledError:
            await self._after_cancel()
            raise
        finally:
            if self._record is not None and fut.done():
                self._seen()

    async def _after_cancel(self) -> None:
        """A cancelled wait: withdraw the receive, or let a matched one finish."""
        fut = self._fut
        if fut is None:
            return
        if self._canceller is not None and self._canceller():
            return
        transport = self._transport
        if transport is not None:
            if transport.cancel(fut):
                return
            await transport.settle(fut)

    def done(self) -> bool:
        fut = self._fut
        if fut is None:
            return True
        if fut.done():
            if self._record is not None:
                self._seen()
            return True
        return False

    def test(self) -> tuple[bool, Any]:
        """``(True, result)`` if the operation finished (raising its error, if any),
        else ``(False, None)``; never blocks."""
        fut = self._fut
        if fut is None:
            return True, self._result
        if not fut.done():
            return False, None
        if self._record is not None:
            self._seen()
        return True, fut.result()

    def cancel(self) -> bool:
        """Cancel a receive that has not matched a message yet.

        Returns True if the operation was cancelled (awaiting it then raises
        ``asyncio.CancelledError``); False if it had already matched or finished, in
        which case it completes normally.
        """
        fut = self._fut
        if fut is None or fut.done():
            return False
        if self._canceller is not None and self._canceller():
            fut.cancel()
            self._seen()
            return True
        if self._transport is not None and self._transport.cancel(fut):
            self._seen()
            return True  # (the transport cancelled the future)
        return False

    def cancelled(self) -> bool:
        return self._fut is not None and self._fut.cancelled()

    @staticmethod
    async def waitall(requests: Iterable[Request | Awaitable[Any]]) -> list[Any]:
        """Wait for every request; returns their results in order.

        If one fails, the others still run to completion before the first error is raised
        (so no buffer is left in use behind your back). They are awaited one after the
        other, each progressing the transport while it waits (all are in flight already:
        the order costs nothing).
        """
        # Other awaitables run concurrently (as tasks), as they would under gather.
        reqs = [r if isinstance(r, Request) else asyncio.ensure_future(r) for r in requests]
        results: list[Any] = []
        error: BaseException | None = None
        for i, r in enumerate(reqs):
            if type(r) is Request:  # finished ones without an await (per message)
                fut = r._fut
                if fut is None:
                    results.append(r._result)
                    continue
                if fut.done() and not fut.cancelled():
                    if r._record is not None:
                        r._seen()
                    exc = fut.exception()
                    if exc is None:
                        results.append(fut.result())
                    else:
                        error = error or exc
                        results.append(exc)
                    continue
            try:
                results.append(await r)
            except asyncio.CancelledError:
                for other in reqs[i + 1:]:
                    if isinstance(other, Request):
                        await other._after_cancel()
                raise
            except Exception as exc:
                error = error or exc
                results.append(exc)
        if error is not None:
            raise error
        return results

    @staticmethod
    async def waitany(requests: Iterable[Request]) -> tuple[int, Any]:
        """Wait for the first request to finish; returns ``(index, result)``."""
        reqs = list(requests)
        futs = [_as_future(r) for r in reqs]
        done, _ = await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
        for i, fut in enumerate(futs):
            if fut in done:
                r = reqs[i]
                if isinstance(r, Request) and r._record is not None:
                    r._seen()
                return i, fut.result()
        raise AssertionError("unreachable")  # pragma: no cover


def _as_future(r: Request | Awaitable[Any]) -> asyncio.Future:
    if isinstance(r, Request):
        return r._future()
    return asyncio.ensure_future(r)
