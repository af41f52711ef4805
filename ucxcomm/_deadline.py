"""``timeout=``: the one place that checks it and turns running out into an error.

Every blocking call of ucxcomm takes ``timeout=`` (seconds, or None for no limit) and
raises :class:`~ucxcomm.CommTimeoutError` when it runs out. The communicator, the windows,
the rank-less endpoints, the bootstrap store and the torch backend all go through this
module, so the argument is checked the same way everywhere (before any I/O) and the error
reads the same way:

``check_timeout(timeout, what)``
    the argument, checked at the call;
``within(aw, timeout, what)``
    await one awaitable within the limit;
``limit(timeout, what)``
    the same for a block (``async with limit(...)``);
:class:`Deadline`
    a limit as a point in time, for a call made of several waits (what is left of it,
    and a check between steps that must not be cancelled half way).

Only a limit that ran out becomes :class:`~ucxcomm.CommTimeoutError`: a ``TimeoutError``
raised by the awaited code itself passes through unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from .errors import CommTimeoutError

__all__ = ["Deadline", "check_timeout", "limit", "timed_out", "within"]

T = TypeVar("T")
_INF = float("inf")


def check_timeout(timeout: Any, what: str, *, zero: bool = True) -> float | None:
    """``timeout`` checked: None (no limit) or a finite number of seconds, >= 0 (> 0 when
    ``zero`` is false: where 0 could only fail, e.g. opening a connection).

    Raises
    ------
    TypeError
        Not a number (``bool`` included) and not None.
    ValueError
        Negative (or 0 where not allowed), infinite or NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what}: timeout must be a number of seconds or None, got "
                        f"{timeout!r}")
    ok = (timeout >= 0 if zero else timeout > 0) and timeout != _INF  # (NaN: False)
    if not ok:
        raise ValueError(f"{what}: timeout must be {'>=' if zero else '>'} 0 seconds "
                         f"(or None: no limit), got {timeout!r}")
    return float(timeout)


def timed_out(what: str, timeout: float, detail: str = "") -> CommTimeoutError:
    """The error for ``what`` running out of its ``timeout`` (``detail`` appended)."""
    return CommTimeoutError(f"{what} did not complete within {timeout:g} s"
                            + (f" ({detail})" if detail else ""))


async def within(aw: Awaitable[T], timeout: float | None, what: str, *,
                 message: str | None = None) -> T:
    """Await ``aw``, for at most ``timeout`` seconds (None: no limit).

    Raises
    ------
    CommTimeoutError
        The limit ran out (``aw`` was cancelled); ``message`` is its text when given.
    """
    if timeout is None:
        return await aw
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            return await aw
    except TimeoutError:
        if not scope.expired():
            raise
    raise (CommTimeoutError(message) if message is not None else timed_out(what, timeout))


@asynccontextmanager
async def limit(timeout: float | None, what: str, *,
                message: str | None = None) -> AsyncIterator[None]:
    """``async with limit(timeout, what):`` the block, for at most ``timeout`` seconds.

    Raises
    ------
    CommTimeoutError
        The limit ran out (the block was cancelled where it waited).
    """
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            yield
    except TimeoutError:
        if not scope.expired():
            raise
        raise (CommTimeoutError(message) if message is not None
               else timed_out(what, timeout or 0.0)) from None


class Deadline:
    """A call's ``timeout=`` as a point in time (``time.monotonic``): what is left of
    it, whether it passed, and a check that raises once it did, for a call made of
    several steps (a remote lock taken attempt by attempt, a connection retried).

    Raises
    ------
    TypeError, ValueError
        A bad ``timeout`` (at construction: the call's first line).
    """

    __slots__ = ("end", "timeout", "what")

    def __init__(self, timeout: Any, what: str, *, zero: bool = True) -> None:
        self.timeout = check_timeout(timeout, what, zero=zero)
        self.what = what
        self.end = None if self.timeout is None else time.monotonic() + self.timeout

    def left(self) -> float | None:
        """Seconds left (0 once passed); None without a limit."""
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def check(self, detail: str = "") -> None:
        """Raise :class:`~ucxcomm.CommTimeoutError` if the deadline passed."""
        if self.passed():
            raise self.error(detail)

    def error(self, detail: str = "") -> CommTimeoutError:
        return timed_out(self.what, self.timeout or 0.0, detail)

    async def wait(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` within what is left."""
        return await within(aw, self.left(), self.what,
                            message=None if self.end is None else str(self.error()))

    def __repr__(self) -> str:
        return f"Deadline({self.what!r}, left={self.left()})"


#: No limit.
NEVER = Deadline(None, "")
