"""``timeout=`` has one owner (ucxcomm._deadline): the same check at every call, and only a
limit that ran out becomes CommTimeoutError. Plus the places that did not check it."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucxcomm
from ucxcomm import CommTimeoutError
from ucxcomm._deadline import NEVER, Deadline, check_timeout, limit, within
from ucxcomm.launch import free_port
from ucxcomm.testing import clean_env

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("bad", ["1", b"1", [1], True, object()])
def test_check_timeout_types(bad):
    with pytest.raises(TypeError, match="what: timeout must be a number"):
        check_timeout(bad, "what")


@pytest.mark.parametrize("bad", [-1, -0.5, math.inf, math.nan])
def test_check_timeout_values(bad):
    with pytest.raises(ValueError, match="what: timeout must be >= 0"):
        check_timeout(bad, "what")


def test_check_timeout_zero_only_where_allowed():
    assert check_timeout(None, "w") is None
    assert check_timeout(0, "w") == 0.0
    assert check_timeout(2, "w") == 2.0 and isinstance(check_timeout(2, "w"), float)
    with pytest.raises(ValueError, match="w: timeout must be > 0"):
        check_timeout(0, "w", zero=False)


async def test_within_turns_only_its_own_limit_into_comm_timeout():
    async def slow():
        await asyncio.sleep(10)

    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"op did not complete within 0\.05 s"):
        await within(slow(), 0.05, "op")
    assert time.monotonic() - t0 < 5

    async def raises_its_own():
        raise TimeoutError("the awaited code's own")

    with pytest.raises(TimeoutError, match="the awaited code's own") as info:
        await within(raises_its_own(), 5, "op")
    assert not isinstance(info.value, CommTimeoutError)
    assert await within(asyncio.sleep(0, "v"), None, "op") == "v"
    with pytest.raises(CommTimeoutError, match=r"^custom$"):
        await within(slow(), 0.01, "op", message="custom")


async def test_limit_block():
    with pytest.raises(CommTimeoutError, match=r"blk did not complete within 0\.02 s"):
        async with limit(0.02, "blk"):
            await asyncio.sleep(10)
    with pytest.raises(TimeoutError) as info:
        async with limit(5, "blk"):
            raise TimeoutError("inner")
    assert not isinstance(info.value, CommTimeoutError)
    async with limit(None, "blk"):
        await asyncio.sleep(0)


async def test_deadline_steps():
    d = Deadline(0.05, "steps")
    assert 0 < d.left() <= 0.05 and not d.passed()
    d.check()
    with pytest.raises(CommTimeoutError, match=r"steps did not complete within 0\.05 s"):
        await d.wait(asyncio.sleep(10))
    assert d.passed() and d.left() == 0.0
    with pytest.raises(CommTimeoutError, match=r"steps did not complete .* \(attempt 3\)"):
        d.check("attempt 3")
    assert NEVER.left() is None and not NEVER.passed()
    with pytest.raises(ValueError):
        Deadline(-1, "x")


@pytest.mark.parametrize("bad, error", [("10", TypeError), (-1, ValueError), (0, ValueError)])
def test_init_checks_its_timeout_at_the_call(bad, error):
    # init() took any timeout and failed (or not) somewhere inside the bootstrap
    with pytest.raises(error, match="init: timeout"):
        ucxcomm.init(timeout=bad)


def test_world_formation_has_one_deadline_for_every_step():
    """Rank 1 of 2 never starts: rank 0 fails at UCXCOMM_TIMEOUT, and says the world did
    not form (each step had had the whole timeout for itself)."""
    env = clean_env()
    env.update({"PMI_RANK": "0", "PMI_SIZE": "2", "UCXCOMM_TOKEN": "t",
                "UCXCOMM_STORE": f"127.0.0.1:{free_port()}", "UCXCOMM_TIMEOUT": "2"})
    t0 = time.monotonic()
    prog = ("import asyncio, ucxcomm\n"
            "async def main():\n"
            "    async with ucxcomm.init():\n"
            "        pass\n"
            "asyncio.run(main())\n")
    proc = subprocess.run([sys.executable, "-c", prog], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "CommTimeoutError: the world did not form within 2 s" in proc.stderr, \
        proc.stderr[-3000:]
    assert took < 40, took
