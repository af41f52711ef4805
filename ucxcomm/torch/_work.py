"""``Work``: what every call of the ucxcomm process group returns, and the event-loop
thread that runs the operations behind it."""

from __future__ import annotations

import asyncio
import atexit
import selectors
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, PeerFailure, UcxCommError

__all__ = ["LoopThread", "PeerFailureError", "ShrinkMismatchError", "Work", "WorkError",
           "WorkTimeoutError", "loop_thread", "release_loop_thread"]


class WorkError(UcxCommError, dist.DistBackendError):
    """An operation of a ucxcomm process group failed (torch's ``DistBackendError``)."""


class PeerFailureError(PeerFailure, WorkError):
    """A rank of the group died or left without closing (``.peer``: its rank); every
    pending and later collective of the group, and what involves that rank, fails."""


class WorkTimeoutError(CommTimeoutError, WorkError):
    """An operation did not complete within the group's (or the call's) timeout."""


class ShrinkMismatchError(WorkError, ValueError):
    """``shrink_group``'s ``ranks_to_exclude`` differ from the ranks the survivors
    agreed are gone (on this rank or on another survivor), or a survivor died during
    it. Raised on every survivor alike; no group was made: the group is still the one
    shrink_group was given, and ``shrink_group(exc.gone)`` on every survivor shrinks it.

    Attributes
    ----------
    gone : list of int
        The group ranks the survivors agreed are gone, sorted (empty: every member took
        part, none is gone).
    """

    def __init__(self, message: str, gone: list[int]) -> None:
        super().__init__(message)
        self.gone = gone


def translate(exc: BaseException, what: str) -> BaseException:
    """The exception a torch caller sees for ``exc``, raised by operation ``what``;
    argument errors (ValueError, TypeError) pass unchanged."""
    if isinstance(exc, (WorkError, PeerFailureError, WorkTimeoutError)):
        return exc
    if isinstance(exc, PeerFailure):
        new: BaseException = PeerFailureError(f"ucxcomm {what}: {exc}", peer=exc.peer)
    elif isinstance(exc, (CommTimeoutError, TimeoutError)):
        new = WorkTimeoutError(f"ucxcomm {what}: {exc}")
    elif isinstance(exc, (ValueError, TypeError, NotImplementedError)):
        return exc
    else:
        new = WorkError(f"ucxcomm {what} failed: {type(exc).__name__}: {exc}")
    new.__cause__ = exc
    return new


class LoopThread:
    """The event loop, on its own daemon thread, that runs every ucxcomm process group
    of this process (UCX progress included). torch calls arrive on torch's threads and
    hand their work over with :meth:`call`; :meth:`run` waits for a coroutine's result.
    """

    NAME = "ucxcomm-torch"

    def __init__(self) -> None:
        # Held by the loop thread except while it sleeps in select(): whoever holds it
        # may run ucxcomm code on the loop's objects (see enter()).
        self._owner = threading.Lock()
        self.loop = asyncio.SelectorEventLoop(_OwnedSelector(self._owner))
        self._thread = threading.Thread(target=self._main, name=self.NAME, daemon=True)
        self._closers: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._saved: list[Any] = []
        # The loop's private queues (asyncio's BaseEventLoop), read by enter()/leave() to
        # tell whether the loop is idle: without them, no call runs on its caller's thread.
        ready, sched = getattr(self.loop, "_ready", None), getattr(self.loop, "_scheduled", None)
        self.ready: deque[Any] = ready if isinstance(ready, deque) else deque([None])
        self._scheduled: list[Any] = sched if isinstance(sched, list) else []
        self._direct = isinstance(ready, deque) and isinstance(sched, list)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._owner.acquire()
        try:
            self.loop.run_forever()
        finally:
            self._owner.release()

    def enter(self) -> bool:
        """Take the loop over from the calling thread, if it is idle: True when this
        thread now owns it (the loop thread sleeps in select(), or waits to come back
        from it, until :meth:`leave`) and may run ucxcomm code as if on the loop.
        False (nothing taken) when the loop thread is busy or has callbacks due."""
        if not self._direct or not self._owner.acquire(blocking=False):
            return False
        loop = self.loop
        if self.ready or loop.get_debug() or not self._thread.is_alive():
            self._owner.release()  # (debug mode checks that callbacks come from its thread)
            return False
        sched = self._scheduled
        self._saved = [asyncio._get_running_loop(), sched[0]._when if sched else None]
        asyncio._set_running_loop(loop)
        return True

    def leave(self) -> None:
        """Give the loop back after :meth:`enter` (waking the loop thread when what ran
        here left it callbacks or an earlier timer)."""
        prev, first = self._saved
        asyncio._set_running_loop(prev)
        sched = self._scheduled
        wake = bool(self.ready) or (bool(sched) and (first is None or sched[0]._when < first))
        self._owner.release()
        if wake:
            self.loop.call_soon_threadsafe(_noop)

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop (thread-safe; calls run in the order made)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        """Run ``coro`` on the loop and return its result (from any other thread).

        Raises
        ------
        WorkTimeoutError
            It did not finish within ``timeout`` seconds (it is cancelled).
        """
        if self.on_thread():
            coro.close()
            raise RuntimeError("ucxcomm: a blocking call was made on the ucxcomm event-loop "
                               "thread (from a future's callback?); wait from another thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.done():
                raise
            fut.cancel()
            raise WorkTimeoutError(f"ucxcomm: no answer within {timeout:g} s") from None

    def add_closer(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._closers.append(closer)

    def remove_closer(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if closer in self._closers:
            self._closers.remove(closer)

    def shutdown(self) -> None:
        """Close every group still open (at interpreter exit), stop the loop, end the
        thread and close the loop (its descriptors): nothing of it is left."""
        closers, self._closers = self._closers, []

        async def close_all() -> None:
            for closer in closers:
                try:
                    await closer()
                except Exception:  # pragma: no cover - best effort at exit
                    pass

        if closers:
            try:
                self.run(close_all(), timeout=20.0)
            except Exception:  # pragma: no cover - best effort at exit
                pass
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5.0)
        if self._thread.is_alive() or self.loop.is_closed():
            return  # (stuck in a callback: leave it to the interpreter's exit)
        self._owner.acquire()  # (this thread runs the loop from here on)
        # What was cancelled or still winding down (a failed join's clean-up) finishes
        # here, on this thread, before the loop closes (as asyncio.run does).
        loop = self.loop
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=10.0))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception:  # pragma: no cover - best effort
            pass
        finally:
            loop.close()


def _noop() -> None:
    pass


class _OwnedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The loop's selector: gives up the owner lock while it sleeps."""

    def __init__(self, owner: threading.Lock) -> None:
        super().__init__()
        self._owner = owner

    def select(self, timeout: float | None = None) -> Any:
        self._owner.release()
        try:
            return super().select(timeout)
        finally:
            self._owner.acquire()


_loop_thread: LoopThread | None = None
_loop_users = 0
_loop_lock = threading.Lock()


def loop_thread() -> LoopThread:
    """This process's :class:`LoopThread`, started on first use; each call takes a
    reference that :func:`release_loop_thread` gives back (the last one ends it)."""
    global _loop_thread, _loop_users
    with _loop_lock:
        if _loop_thread is None:
            _loop_thread = LoopThread()
        _loop_users += 1
        return _loop_thread


def release_loop_thread(lt: LoopThread) -> None:
    """Give back a reference taken by :func:`loop_thread`: once none is left (every
    group closed, or the only one failed to form), the thread ends and its loop closes."""
    global _loop_thread, _loop_users
    with _loop_lock:
        if lt is not _loop_thread:
            return
        _loop_users -= 1
        if _loop_users > 0:
            return
        _loop_thread, _loop_users = None, 0
    lt.shutdown()


@atexit.register
def _shutdown_at_exit() -> None:
    global _loop_thread, _loop_users
    with _loop_lock:
        lt, _loop_thread, _loop_users = _loop_thread, None, 0
    if lt is not None:
        lt.shutdown()


class Work(dist.Work):
    """One operation of a ucxcomm process group, running on the loop thread.

    ``wait()`` blocks until it finishes and raises what made it fail
    (:class:`PeerFailureError` naming the dead rank, :class:`WorkTimeoutError`, ...);
    ``get_future()`` gives a ``torch.futures.Future`` completed with :meth:`result`
    (DDP's communication hooks chain on it); ``_source_rank()`` is the sender a
    ``recv_anysource`` matched.
    """

    def __init__(self, what: str, outputs: list[torch.Tensor], deadline: float) -> None:
        super().__init__()
        self.what = what
        self._outputs = outputs
        self._deadline = deadline  # seconds: the outermost bound of a plain wait()
        # Held until the operation ends (a bare lock: cheaper than an Event per call).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._done = False
        self._lock = threading.Lock()
        self._exc: BaseException | None = None
        self._source = -1
        self._future: torch.futures.Future | None = None
        self.keep: Any = None  # what must stay alive until the operation ends
        self.after: Callable[[], None] | None = None  # runs on success, before completion

    # ------------------------------------------------- completion (loop thread)
    def finish(self, exc: BaseException | None = None, source: int = -1) -> None:
        """Complete the Work (the first call only; later ones are ignored)."""
        if self._done:
            return
        if exc is None and self.after is not None:
            try:
                self.after()
            except Exception as err:  # (a copy-out failed)
                exc = err
        if exc is not None:
            exc = translate(exc, self.what)
        with self._lock:
            self._exc, self._source = exc, source
            self.keep = self.after = None
            self._done = True
            fut = self._future
        if fut is not None:  # (before the gate: wait() returns with the future done)
            self._settle(fut)
        self._gate.release()

    def _settle(self, fut: torch.futures.Future) -> None:
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._outputs)

    # ------------------------------------------------------------ torch's API
    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self._done:
            if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
                limit = timeout.total_seconds()
            else:
                limit = self._deadline
            if threading.current_thread().name == LoopThread.NAME:
                raise RuntimeError(f"ucxcomm {self.what}: Work.wait() on the ucxcomm thread "
                                   "(from a future's callback?) would wait forever; chain "
                                   "with Future.then() instead")
            if not self._gate.acquire(timeout=limit):
                raise WorkTimeoutError(f"ucxcomm {self.what}: not complete after {limit:g} s")
            self._gate.release()  # (for any other waiter)
        if self._exc is not None:
            raise self._exc
        return True

    def synchronize(self) -> None:
        self.wait()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._source_rank()

    def _source_rank(self) -> int:
        self.wait()
        if self._source < 0:
            raise ValueError(f"ucxcomm {self.what}: only recv_anysource has a source rank")
        return self._source

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            fut = self._future = torch.futures.Future()
            done = self._done
        if done:
            self._settle(fut)
        return fut
