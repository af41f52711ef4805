"""Request semantics without a transport: completed requests carry no future, waitall
waits for everything before raising the first error, and runs plain awaitables
concurrently (as gather did)."""

from __future__ import annotations

import asyncio

import pytest

from ucxcomm import Request

pytestmark = pytest.mark.timeout(30)


async def test_completed_request_needs_no_future():
    req = Request.completed(42)
    assert req.done() and req.test() == (True, 42) and not req.cancelled()
    assert await req == 42
    assert await req == 42  # awaiting twice is fine
    assert req.cancel() is False


async def test_waitall_finishes_everything_before_the_first_error():
    loop = asyncio.get_running_loop()
    ok, bad, late = loop.create_future(), loop.create_future(), loop.create_future()
    bad.set_exception(ValueError("first"))
    loop.call_soon(ok.set_result, 1)
    loop.call_later(0.01, late.set_result, 3)
    with pytest.raises(ValueError, match="first"):
        await Request.waitall([Request(ok), Request(bad), Request(late)])
    assert late.done()  # not abandoned behind the caller's back


async def test_waitall_runs_plain_awaitables_concurrently():
    """Awaited one after the other these two would deadlock: the first waits for the
    second."""
    event = asyncio.Event()

    async def first():
        await event.wait()
        return "first"

    async def second():
        event.set()
        return "second"

    got = await asyncio.wait_for(Request.waitall([first(), second()]), 5)
    assert got == ["first", "second"]
