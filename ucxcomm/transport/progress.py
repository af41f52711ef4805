"""``Progress``: the one place that spins, arms and sleeps to drive UCX from asyncio.

A *source* is something with pending operations that must be progressed: the tag
worker (:class:`~ucxcomm.transport.worker.Worker`) and the RMA engines
(:class:`~ucxcomm.transport.rma.RmaEngine`). The model (measured, docs/design.md):

* A task awaiting an operation (:meth:`Progress.wait`) progresses the sources itself,
  in bursts of :data:`BURST_S`, yielding to the event loop between bursts only when
  other callbacks are ready: a reply that arrives within ``spin_s`` completes without a
  single event-loop round trip.
* :meth:`Progress.spin` does the same synchronously, without yielding, while the loop
  has nothing else to run (a receive about to be awaited waits for its message here).
* Otherwise the progress task spins while operations are pending, yielding whenever
  something completed or another task is ready. After ``spin_s`` without a completion
  it arms every source and sleeps on their descriptors (``loop.add_reader``) with a
  :data:`IDLE_WAKE_S` fallback: an idle rank blocked in ``recv`` uses no CPU.
* With more ranks than cores, spinners ``sched_yield()`` between bursts so that the
  peer they wait for gets the core (8 B allreduce at 3 ranks on 2 cores: 1.1 ms ->
  0.15-0.3 ms).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["BURST_S", "IDLE_WAKE_S", "Progress", "Source", "ready_queue"]

log = logging.getLogger(__name__)

#: Longest stretch of spinning without yielding to the event loop.
BURST_S = 20e-6
#: Fallback wake-up while sleeping: UCX may not always signal the descriptor
#: (ucxx's blocking progress mode guards against the same thing).
IDLE_WAKE_S = 0.05
#: A source that refuses to arm this many times in a row, with nothing completing, is
#: stuck busy (UCX keeps reporting work it never finishes: sends queued on shared memory
#: to a peer that died); from then on the task sleeps :data:`BUSY_WAKE_S` on the timer
#: alone instead of trying again at once.
BUSY_ARMS = 64
BUSY_WAKE_S = 1e-3
_sched_yield = getattr(os, "sched_yield", lambda: None)


class Source(Protocol):
    """What :class:`Progress` drives."""

    #: Watched while idle (the tag worker: incoming connections and messages must be
    #: progressed even when nothing is posted); others only while they have work.
    watch_idle: bool

    def pending(self) -> bool:
        """Operations in flight that need progress."""

    def poll(self) -> int:
        """Progress UCX once and complete what finished; how many completed."""

    def arm(self) -> bool:
        """Prepare to sleep on :meth:`fileno`; False when events are already pending
        (poll again instead)."""

    def disarm(self) -> None:
        """After sleeping (woken or not)."""

    def fileno(self) -> int: ...


def ready_queue(loop: asyncio.AbstractEventLoop) -> deque[Any] | None:
    """The loop's queue of callbacks ready to run (``BaseEventLoop._ready``), or None.

    Private asyncio state, read here only: "is anything else ready to run?" decides
    whether a spinner may keep the thread. Asking costs a ``len()``; the public
    alternative (``await asyncio.sleep(0)`` every turn) costs an event-loop round trip
    per poll, which the 8 B latency cannot afford. tests/test_progress.py notices when
    asyncio changes it; without it we only spin between yields.
    """
    ready = getattr(loop, "_ready", None)
    return ready if isinstance(ready, deque) else None


class Progress:
    """Drives the sources of one worker on its event loop (see the module docstring).

    Parameters
    ----------
    loop : asyncio.AbstractEventLoop
    spin_s : float
        How long to spin while operations are pending before sleeping (0: never spin).
    on_cancel : callable, optional
        Called when the progress task is cancelled from outside (``asyncio.run`` tearing
        the loop down without a close): the owner releases UCX while the loop runs.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, spin_s: float,
                 on_cancel: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._on_cancel = on_cancel
        self.spin_s = spin_s
        self._sources: list[Source] = []
        self._ready = ready_queue(loop)
        self._spinners = 0  # tasks progressing inside wait()
        self._sleeper: asyncio.Future | None = None
        self._kick_due = False  # a kick is scheduled (call_soon)
        #: Sleep on the descriptors of idle sources too (see :meth:`Worker.set_idle_watch`).
        self.idle_watch = True
        self._busy_arms = 0  # arms refused in a row (see BUSY_ARMS)
        self._closed = False
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> deque[Any] | None:
        """The loop's ready queue (see :func:`ready_queue`): compiled sources that spin
        in place read it, by this policy, to stop when other callbacks want the loop."""
        return self._ready

    def add(self, source: Source) -> None:
        """Drive ``source`` too (the first one added starts the progress task)."""
        self._sources.append(source)
        if self._task is None:
            self._task = self._loop.create_task(self._run(), name="ucxcomm-progress")

    def remove(self, source: Source) -> None:
        if source in self._sources:
            self._sources.remove(source)

    @property
    def task(self) -> asyncio.Task | None:
        """The progress task (its cancellation by loop teardown aborts the worker)."""
        return self._task

    def others_ready(self) -> bool:
        """Whether the loop's ready queue holds a callback other than this policy's own
        wake-ups (the progress task's next step, its descriptor or timer firing, a
        kick): only those are a reason for a spinner to give the thread up.

        The progress task is woken by the worker's descriptor whenever a message arrives
        while it sleeps; a spinner that stepped aside for that wake-up went through the
        event loop for nothing, and (the loop then woke the task again) so did the
        next call's (8 B Allreduce at 2 ranks: 1-17 % of calls took the slow path, and
        they cost several times a fast one). Spinning is what the task would do itself.
        """
        ready = self._ready
        if not ready:
            return False
        task = self._task
        try:
            for h in ready:
                cb = getattr(h, "_callback", None)
                if cb is _wake or getattr(cb, "__self__", None) in (task, self):
                    continue  # (_wake, the task's step, _kick_now)
                return True
        except RuntimeError:
            # The queue grew while we looked: a signal handler ran between two steps of
            # the loop (asyncio.run's SIGINT handler calls call_soon_threadsafe). Someone
            # else wants the loop, so give it up (the error escaped to the spinner's
            # caller before: a Ctrl-C during Recv printed a traceback, not the
            # KeyboardInterrupt).
            return True
        return False

    # ------------------------------------------------------------ polling
    def poll(self) -> int:
        """Progress the sources with pending work once; how many operations finished."""
        n = 0
        for s in self._sources:
            if s.pending():
                n += s.poll()
        return n

    def _busy(self) -> bool:
        for s in self._sources:  # (a plain loop: this runs after every wait)
            if s.pending():
                return True
        return False

    # ------------------------------------------------------------ waiting
    async def wait(self, fut: asyncio.Future,
                   poll: Callable[[], int] | None = None) -> Any:
        """Await ``fut``, progressing from this task while it waits (then handing over
        to the progress task, which sleeps when nothing happens).

        ``poll`` is the owning source's :meth:`Source.poll`: the tight loop calls only
        it (one call per turn: completion is noticed sooner), every other source is
        polled once per burst.
        """
        if fut.done():
            return fut.result()
        if self.spin_s > 0 and not self._closed:
            now, ready, others = time.perf_counter, self._ready, self.others_ready
            poll_all = self.poll
            if poll is None:
                poll = poll_all
            self._spinners += 1
            try:
                end = now() + self.spin_s
                while True:
                    burst_end = now() + BURST_S
                    while True:
                        poll()
                        if fut.done():
                            return fut.result()
                        if (ready and others()) or now() > burst_end:
                            break
                    if poll is not poll_all:
                        poll_all()
                    if now() > end or self._closed:
                        break
                    if not ready:
                        _sched_yield()  # more ranks than cores: let the peer run
                    await asyncio.sleep(0)
                    if fut.done():
                        return fut.result()
            finally:
                self._spinners -= 1
                if not self._spinners and self._sleeper is not None and self._busy():
                    self.kick()  # others' operations are pending: hand them over
        self.kick()
        return await fut

    def spin(self, check: Callable[..., bool], *args: Any) -> bool:
        """Call ``check(*args)`` (which progresses what it needs) right here, without an
        event-loop round trip, while nothing else is ready to run (at most ``spin_s``);
        True once it returns True."""
        ready = self._ready
        if self.spin_s <= 0 or self._closed or ready is None or (ready and self.others_ready()):
            return False
        now, others = time.perf_counter, self.others_ready
        end = now() + self.spin_s
        while not (ready and others()) and now() < end:
            if check(*args):
                return True
        return False

    def spin_request(self, progress: Callable[[Any], Any], handle: Any,
                     test: Callable[[Any], int], req: Any, inprogress: int) -> int:
        """Wait for one UCP request right here: ``progress(handle)`` and ``test(req)``
        until it is no longer ``inprogress`` or ``spin_s`` passed. Returns the last
        ``test`` result.

        Unlike :meth:`spin` it keeps the thread even when other callbacks are ready and
        calls UCX directly (no Python frame per turn): one-sided requests finish within
        microseconds (the target's RMA thread serves them), and letting a ready callback
        (often the progress task's own next turn) send each of them through the event
        loop made small puts 30-50 % slower (put + flush 11-14 -> 16-21 us, measured).
        """
        st = test(req)
        if st != inprogress or self.spin_s <= 0 or self._closed:
            return st
        now = time.perf_counter
        end = now() + self.spin_s
        while st == inprogress and now() < end:
            progress(handle)
            st = test(req)
        return st

    def kick(self) -> None:
        """Make sure the progress task runs (after posting operations that are not
        awaited through :meth:`wait` right away).

        The wake-up is decided when the event loop next runs callbacks, not now: the
        usual caller posts a request and awaits it at once, and by then that await is
        progressing (a spinner), so the sleeping task is left asleep. Waking it for
        nothing (disarming its sources, then parking it again) cost 10-13 us per
        ``Irecv`` + ``Send`` + ``await`` exchange (18 us instead of 5)."""
        if self._spinners or self._kick_due:
            return  # an awaiter is progressing (it kicks when it stops), or one is due
        s = self._sleeper
        if s is not None and not s.done():
            self._kick_due = True
            self._loop.call_soon(self._kick_now)

    def _kick_now(self) -> None:
        self._kick_due = False
        if self._spinners or not self._busy():
            return  # progressing in place, or already done: nothing to hand over
        s = self._sleeper
        if s is not None and not s.done():
            s.set_result(None)

    # ------------------------------------------------------------ the task
    async def _run(self) -> None:
        now, poll, ready = time.perf_counter, self.poll, self._ready
        try:
            while not self._closed:
                if self._spinners:
                    await self._wait_kick()  # an awaiter is progressing the sources
                    continue
                if not self._busy():
                    await self._sleep()
                    continue
                deadline = now() + self.spin_s
                while self._busy() and not self._spinners and not self._closed:
                    burst_end = now() + BURST_S
                    finished = 0
                    while True:
                        n = poll()
                        finished += n
                        # Keep collecting while completions keep coming (throughput of
                        # many small messages); yield once a round brings nothing new.
                        if n and now() < burst_end:
                            continue
                        if finished or ready or now() > burst_end:
                            break
                    if finished:
                        deadline = now() + self.spin_s
                        self._busy_arms = 0
                    elif now() > deadline:
                        await self._sleep()
                        deadline = now() + self.spin_s
                        continue
                    elif not ready:
                        _sched_yield()  # more ranks than cores: let the peer run
                    await asyncio.sleep(0)
                # Let the woken waiters run (and post their next operation) first.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            if not self._closed and self._on_cancel is not None:
                self._on_cancel()
            raise
        except Exception:  # pragma: no cover - a bug; make it loud
            log.exception("ucxcomm progress loop crashed")
            if self._on_cancel is not None:
                self._on_cancel()
            raise

    async def _wait_kick(self) -> None:
        fut = self._loop.create_future()
        self._sleeper = fut
        handle = self._loop.call_later(IDLE_WAKE_S, _wake, fut)  # never wait unbounded
        try:
            await fut
        finally:
            self._sleeper = None
            handle.cancel()

    async def _sleep(self) -> None:
        """Arm the sources that need watching and sleep until one's descriptor fires,
        a kick, or :data:`IDLE_WAKE_S`. When a source refuses to arm (events pending),
        return after one event-loop turn; after :data:`BUSY_ARMS` refusals in a row,
        sleep :data:`BUSY_WAKE_S` (or until a kick) instead."""
        armed: list[Source] = []
        wake_s = IDLE_WAKE_S
        try:
            refused = False
            for s in self._sources:
                if not s.pending() and s.watch_idle and not self.idle_watch:
                    s.poll()  # (progressed once per wake-up, not watched)
                elif s.watch_idle or s.pending():
                    armed.append(s)
                    if not s.arm():
                        refused = True
                        break
            if not refused:
                self._busy_arms = 0
            else:
                # Events arrived meanwhile: progress again, but only after the loop had
                # a turn (the callers loop on this at once: never starve the loop). A
                # source that keeps refusing is stuck busy: sleep on the timer alone.
                self._busy_arms += 1
                if self._busy_arms < BUSY_ARMS:
                    await asyncio.sleep(0)
                    return
                wake_s = BUSY_WAKE_S
            loop = self._loop
            fut = loop.create_future()
            self._sleeper = fut
            fds = [s.fileno() for s in armed] if not refused else []
            for fd in fds:
                loop.add_reader(fd, _wake, fut)
            handle = loop.call_later(wake_s, _wake, fut)
            try:
                await fut
            finally:
                self._sleeper = None
                for fd in fds:
                    loop.remove_reader(fd)
                handle.cancel()
        finally:
            for s in armed:
                s.disarm()

    # ------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the progress task (idempotent)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """:meth:`close` and wait for the task to end."""
        self.close()
        if self._task is not None and self._task is not asyncio.current_task():
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
