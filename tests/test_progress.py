"""The progress engine (ucxcomm/transport/progress.py) on a source of our own: a pipe
stands in for a UCX worker's event descriptor, so spinning, arming, sleeping and waking
are observable. (Real UCX sources are exercised by every other transport test.)"""

from __future__ import annotations

import asyncio
import os
from collections import deque

import pytest

from ucxcomm.transport.progress import Progress, ready_queue

pytestmark = pytest.mark.timeout(30)


async def test_asyncio_ready_queue_is_what_progress_reads():
    """Progress decides whether to keep spinning by peeking at asyncio's private ready
    queue; this notices the day asyncio renames or reshapes it."""
    loop = asyncio.get_running_loop()
    ready = ready_queue(loop)
    assert isinstance(ready, deque), "asyncio's BaseEventLoop._ready changed"
    before = len(ready)
    handle = loop.call_soon(lambda: None)
    assert len(ready) == before + 1 and ready[-1] is handle
    await asyncio.sleep(0)
    assert handle not in ready


class PipeSource:
    """One pending 'operation' that completes when a byte arrives on a pipe."""

    watch_idle = False

    def __init__(self, loop):
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        self.fut = loop.create_future()
        self.polls = self.arms = self.disarms = 0
        self.armed = asyncio.Event()

    def pending(self):
        return not self.fut.done()

    def poll(self):
        self.polls += 1
        try:
            data = os.read(self.rfd, 1)
        except BlockingIOError:
            return 0
        if data and not self.fut.done():
            self.fut.set_result(data)
            return 1
        return 0

    def arm(self):
        self.arms += 1
        if self.poll():
            return False
        self.armed.set()
        return True

    def disarm(self):
        self.disarms += 1

    def fileno(self):
        return self.rfd

    def close(self):
        os.close(self.rfd)
        os.close(self.wfd)


async def test_waiter_spins_then_sleeps_on_the_descriptor_and_wakes_on_it():
    loop = asyncio.get_running_loop()
    progress = Progress(loop, spin_s=1e-3)
    src = PipeSource(loop)
    progress.add(src)
    try:
        waiter = asyncio.ensure_future(progress.wait(src.fut))
        await asyncio.wait_for(src.armed.wait(), 10)  # spun for 1 ms, then armed
        polls = src.polls
        assert polls > 1 and not waiter.done()
        os.write(src.wfd, b"x")  # the descriptor fires: the sleeping task wakes
        assert await asyncio.wait_for(waiter, 10) == b"x"
        assert src.disarms >= 1
    finally:
        await progress.aclose()
        src.close()


async def test_spin_returns_once_the_check_passes():
    loop = asyncio.get_running_loop()
    progress = Progress(loop, spin_s=5.0)
    src = PipeSource(loop)
    src.watch_idle = True  # armed by the sleeping task, yet not pending
    src.pending = lambda: False
    progress.add(src)
    try:
        await asyncio.wait_for(src.armed.wait(), 10)  # the progress task is asleep
        os.write(src.wfd, b"y")
        assert progress.spin(lambda: src.poll() > 0)
        assert src.fut.result() == b"y"
        # With another callback ready to run, spin() refuses at once.
        src.fut = loop.create_future()
        loop.call_soon(lambda: None)
        assert not progress.spin(lambda: src.poll() > 0)
    finally:
        await progress.aclose()
        src.close()


async def test_spinners_ignore_the_policys_own_wake_ups():
    """The sleeping progress task's descriptor firing (a message arrived) puts its
    wake-up in the ready queue; a spinner that stepped aside for that went through the
    event loop for nothing (8 B two-rank Allreduce: 1-17 % of calls fell to the slow
    path). Only a foreign callback makes spin() and others_ready() give way."""
    loop = asyncio.get_running_loop()
    progress = Progress(loop, spin_s=5.0)
    src = PipeSource(loop)
    src.watch_idle = True
    src.pending = lambda: False
    progress.add(src)
    ready = ready_queue(loop)
    try:
        await asyncio.wait_for(src.armed.wait(), 10)  # the task sleeps on the pipe
        assert not progress.others_ready()
        seen, spun = [], []
        done = loop.create_future()

        def after_wake():  # runs once the descriptor's wake-up has run: the task's step
            seen.append(("step", len(ready), progress.others_ready()))
            progress.kick()  # (no-op or a queued _kick_now: the policy's own either way)
            seen.append(("kick", len(ready), progress.others_ready()))
            spun.append(progress.spin(lambda: True))  # spins: nothing foreign is ready
            loop.call_soon(lambda: None)
            seen.append(("foreign", len(ready), progress.others_ready()))
            spun.append(progress.spin(lambda: True))  # gives way at once
            done.set_result(None)

        def before_wake():  # runs in the loop pass that found the pipe readable
            seen.append(("wake", len(ready), progress.others_ready()))
            loop.call_soon(after_wake)

        os.write(src.wfd, b"z")
        loop.call_soon(before_wake)  # queued ahead of the descriptor's wake-up
        await asyncio.wait_for(done, 10)
        assert [s[0] for s in seen] == ["wake", "step", "kick", "foreign"], seen
        assert all(n > 0 for _, n, _ in seen), seen
        assert [o for _, _, o in seen] == [False, False, False, True], seen
        assert spun == [True, False], spun
    finally:
        await progress.aclose()
        src.close()


async def test_others_ready_survives_a_queue_growing_while_it_looks():
    """A Python signal handler runs between any two bytecodes, and asyncio.run's SIGINT
    handler queues a callback (call_soon_threadsafe): the ready queue can grow while
    others_ready() walks it. Before, that raised 'deque mutated during iteration' out of
    a spinning Recv (CI: a Ctrl-C'd rank printed it instead of stopping cleanly)."""
    loop = asyncio.get_running_loop()
    progress = Progress(loop, spin_s=5.0)
    ready = ready_queue(loop)
    assert ready is not None

    class Growing:  # looks like one of the policy's own wake-ups; reading it queues more
        @property
        def _callback(self):
            ready.append(asyncio.Handle(lambda: None, (), loop))
            return progress.kick

    growing = Growing()
    try:
        ready.append(growing)
        assert progress.others_ready()
        assert not progress.spin(lambda: False)
    finally:
        ready.remove(growing)  # (the plain callbacks it queued just run)
        await progress.aclose()


async def test_kick_leaves_the_task_asleep_when_the_poster_waits_itself():
    """Posting an operation kicks the progress task, but the usual poster awaits the
    operation at once (progressing it in place): the wake-up is decided at the next
    callback round, so the sleeping task is not woken (and re-parked) for nothing.
    Before, every Irecv + await woke it: 10-13 us per exchange. An operation nobody
    awaits still wakes it."""
    loop = asyncio.get_running_loop()
    progress = Progress(loop, spin_s=5.0)
    src = PipeSource(loop)
    progress.add(src)
    try:
        await asyncio.wait_for(src.armed.wait(), 10)  # the progress task is asleep
        os.write(src.wfd, b"a")  # the reply is already there when the poster waits
        progress.kick()
        assert await progress.wait(src.fut) == b"a"
        for _ in range(3):
            await asyncio.sleep(0)
        assert src.disarms == 0, "the sleeping task was woken for an awaited operation"
        src.fut = loop.create_future()  # posted, not awaited: the task must take it
        progress.kick()
        for _ in range(3):
            await asyncio.sleep(0)
        assert src.disarms == 1
        os.write(src.wfd, b"b")
        assert await asyncio.wait_for(asyncio.shield(src.fut), 10) == b"b"
    finally:
        await progress.aclose()
        src.close()


async def test_cancelled_progress_task_tells_its_owner():
    loop = asyncio.get_running_loop()
    told = []
    progress = Progress(loop, spin_s=0, on_cancel=lambda: told.append(True))
    src = PipeSource(loop)
    progress.add(src)
    await asyncio.sleep(0)  # the task starts and goes to sleep
    progress.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await progress.task
    assert told == [True]
    src.close()


class StuckBusySource:
    """A source UCX-style stuck busy: it never lets itself be armed and nothing ever
    completes (what a worker does while sends to a dead peer stay queued on shared
    memory, the listener hang of the stream fault case)."""

    watch_idle = True
    LIMIT = 100_000  # a starving loop gets here within a second; then fail loudly

    def __init__(self):
        self.rfd, self.wfd = os.pipe()
        self.arms = 0

    def pending(self):
        return False

    def poll(self):
        return 0

    def arm(self):
        self.arms += 1
        if self.arms > self.LIMIT:
            raise RuntimeError("the progress task starved the event loop")
        return False

    def disarm(self):
        pass

    def fileno(self):
        return self.rfd

    def close(self):
        os.close(self.rfd)
        os.close(self.wfd)


async def test_a_source_that_never_arms_does_not_starve_the_loop():
    """A refused arm used to send the progress task straight back to arming, without an
    await that yields: with a source stuck busy the event loop never ran anything else
    again (the listener of tests/test_faults.py's stream case hung in asyncio.run, 1 in
    6 runs). Now it yields after each refusal and, once refusals persist, sleeps on a
    short timer."""
    loop = asyncio.get_running_loop()
    progress = Progress(loop, spin_s=1e-3)
    src = StuckBusySource()
    progress.add(src)
    try:
        for _ in range(20):
            await asyncio.sleep(0.01)  # the loop keeps running other tasks
        task = progress.task
        assert task is not None and not task.done(), task.exception() if task else None
        assert 0 < src.arms < 20_000, src.arms  # timer sleeps, not a spin: ~0.2 s / 1 ms
    finally:
        await progress.aclose()
        src.close()
