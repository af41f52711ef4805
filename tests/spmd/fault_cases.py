"""Fault injection under a torchrun-style launch (tests/test_faults.py).

``python fault_cases.py CASE VICTIM``: every rank (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment; no ``ucxcomm run`` to end a hang)
runs CASE's loop, in which every iteration involves rank VICTIM, and prints
``READY r`` once the loop is under way. The test then kills VICTIM with SIGKILL. Every
survivor must leave its loop with ``PeerFailure`` within ``UCXCOMM_TEST_FAULT_TIMEOUT``
seconds (an ``asyncio.timeout`` around the loop: a hang fails the case instead of
waiting forever) and prints ``PEER-FAILURE r peer P after S s`` (S: since its last
completed iteration), then (``UCXCOMM_TEST_LINGER_S``: after that many seconds of
progress, printing ``LINGERED r``) aborts its communicator and exits 0.

Case ``stream`` uses connected endpoints (``ucxcomm.transport.listen``/``connect``)
instead of a world: rank 0 listens on ``MASTER_PORT + 2``, prints ``LISTENING 0`` and
echoes; rank 1 (started after that line) connects and sends.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np

import ucxcomm

BIG = 1 << 20  # rendezvous-sized: the transfer is in flight when the victim dies
CMA_BIG = 16 << 20  # case cma: copies long enough that a kill lands in one
READY_AFTER = 5
Loop = Callable[[ucxcomm.Comm, int, Callable[[], None]], Awaitable[None]]
CASES: dict[str, Loop] = {}


def case(fn: Loop) -> Loop:
    CASES[fn.__name__] = fn
    return fn


def others(comm, victim: int) -> list[int]:
    return [r for r in range(comm.size) if r != victim]


@case
async def send(comm, victim, tick):
    """Survivors send large buffers to the victim, which receives them in turn."""
    buf = np.full(BIG, comm.rank, np.uint8)
    while True:
        if comm.rank == victim:
            for s in others(comm, victim):
                await comm.Recv(buf, s, tag=1)
        else:
            await comm.Send(buf, victim, tag=1)
        tick()


@case
async def recv(comm, victim, tick):
    """Survivors wait in Recv for the victim's large messages."""
    buf = np.full(BIG, comm.rank, np.uint8)
    while True:
        if comm.rank == victim:
            for s in others(comm, victim):
                await comm.Send(buf, s, tag=2)
        else:
            await comm.Recv(buf, victim, tag=2)
            await comm.Send(buf[:8], victim, tag=3)  # (keeps the victim in step)
        if comm.rank == victim:
            for s in others(comm, victim):
                await comm.Recv(buf[:8], s, tag=3)
        tick()


@case
async def cma(comm, victim, tick):
    """Survivors receive 16 MiB messages from the victim, which sends them back to back:
    on one host the survivors spend most of their time in kernel copies out of the
    victim's memory (CMA), so the kill lands in the middle of one."""
    buf = np.full(CMA_BIG, comm.rank, np.uint8)
    while True:
        if comm.rank == victim:
            for s in others(comm, victim):
                await comm.Send(buf, s, tag=6)
        else:
            await comm.Recv(buf, victim, tag=6)
        tick()


@case
async def recv_any(comm, victim, tick):
    """Survivors wait in recv(ANY_SOURCE) (which depends on every member)."""
    n = 0
    while True:
        if comm.rank == victim:
            for s in others(comm, victim):
                await comm.send(("item", n), s, tag=4)
            await comm.recv(ucxcomm.ANY_SOURCE, tag=5)
        else:
            obj = await comm.recv(ucxcomm.ANY_SOURCE, tag=4)
            assert obj == ("item", n), obj
            if comm.rank == min(others(comm, victim)):
                await comm.send("ack", victim, tag=5)
        n += 1
        tick()


@case
async def allreduce(comm, victim, tick):
    send = np.full(1 << 16, comm.rank + 1, np.float64)
    recv = np.empty_like(send)
    while True:
        await comm.Allreduce(send, recv)
        assert recv[0] == comm.size * (comm.size + 1) / 2
        tick()


@case
async def allreduce_small(comm, victim, tick):
    """8 bytes: each call is one compiled call (two ranks: one exchange; more: a send to
    every peer, then every receive waited for in place), the path a death must not
    leave spinning or waiting."""
    send = np.full(1, comm.rank + 1, np.float64)
    recv = np.empty_like(send)
    while True:
        await comm.Allreduce(send, recv)
        assert recv[0] == comm.size * (comm.size + 1) / 2
        tick()


async def _window(comm):
    return await ucxcomm.Win.Allocate(comm, 1 << 20, disp_unit=1)


@case
async def fence(comm, victim, tick):
    win = await _window(comm)
    origin = np.full(1 << 16, comm.rank, np.uint8)
    while True:
        await win.Put(origin, (comm.rank + 1) % comm.size, comm.rank << 16)
        await win.Fence()
        tick()


@case
async def lock(comm, victim, tick):
    """Exclusive epochs on every other rank in turn (the victim may die holding one)."""
    win = await _window(comm)
    origin = np.full(1 << 16, comm.rank, np.uint8)
    while True:
        for t in range(comm.size):
            if t != comm.rank:
                await win.Lock(t, exclusive=True)
                await win.Put(origin, t, comm.rank << 16)
                await win.Unlock(t)
        tick()


@case
async def lock_all(comm, victim, tick):
    win = await _window(comm)
    origin = np.full(1 << 16, comm.rank, np.uint8)
    while True:
        await win.Lock_all()
        for t in range(comm.size):
            await win.Put(origin, t, comm.rank << 16)
        await win.Flush_all()
        await win.Unlock_all()
        tick()


@case
async def flush(comm, victim, tick):
    win = await _window(comm)
    origin = np.full(1 << 16, comm.rank, np.uint8)
    while True:
        for t in range(comm.size):
            if t != comm.rank:
                await win.Put(origin, t, comm.rank << 16)
                await win.Flush(t)
        tick()


async def stream(rank: int, timeout: float) -> None:
    """Rank 0 echoes 1 MiB messages to rank 1 over a connected endpoint."""
    port = int(os.environ["MASTER_PORT"]) + 2
    failed: asyncio.Future = asyncio.get_running_loop().create_future()
    state = {"last": time.monotonic(), "n": 0}

    def tick() -> None:
        state["last"] = time.monotonic()
        state["n"] += 1
        if state["n"] == READY_AFTER:
            print(f"READY {rank}", flush=True)

    async def echo(ep) -> None:
        buf = bytearray(BIG)
        try:
            while True:
                await ep.recv(buf, tag=1)
                await ep.send(buf, tag=1)
                tick()
        except BaseException as exc:
            if not failed.done():
                failed.set_result(exc)

    async def client() -> None:
        ep = await ucxcomm.transport.connect("127.0.0.1", port, timeout=30)
        buf = bytearray(BIG)
        try:
            while True:
                await ep.send(buf, tag=1)
                await ep.recv(buf, tag=1)
                tick()
        finally:
            ep.abort()

    try:
        async with asyncio.timeout(timeout):
            if rank == 0:
                async with await ucxcomm.transport.listen(echo, port=port):
                    print(f"LISTENING {rank}", flush=True)
                    raise await failed
            else:
                await client()
    except ucxcomm.PeerFailure as exc:
        report(rank, exc, state["last"])


@case
async def recorded(comm, victim, tick):
    """Each survivor has an operation in flight on the victim when it dies (the first
    survivor an Irecv from it, the others a barrier), posted before READY; the
    victim waits. ``PeerFailure.operations`` must name them (printed by report)."""
    buf = np.zeros(4)
    first = others(comm, victim)[0]
    if comm.rank == victim:
        req = None
    elif comm.rank == first:
        req = comm.Irecv(buf, victim, tag=5)
    else:
        req = comm.Ibarrier()
    for _ in range(READY_AFTER):
        tick()
    if req is None:
        await asyncio.Event().wait()
    await req


def report(rank: int, exc: ucxcomm.PeerFailure, last: float) -> None:
    print(f"PEER-FAILURE {rank} peer {exc.peer} after {time.monotonic() - last:.3f} s",
          flush=True)
    print(f"OPERATIONS {rank}: " + "; ".join(f"{o.state} {o.call()}" for o in exc.operations),
          flush=True)


async def main(name: str, victim: int) -> None:
    timeout = float(os.environ["UCXCOMM_TEST_FAULT_TIMEOUT"])
    if name == "stream":
        await stream(int(os.environ["RANK"]), timeout)
        return
    comm = await ucxcomm.init(timeout=60)
    state = {"last": time.monotonic(), "n": 0}

    def tick() -> None:
        state["last"] = time.monotonic()
        state["n"] += 1
        if state["n"] == READY_AFTER:
            print(f"READY {comm.rank}", flush=True)

    await comm.barrier()
    try:
        async with asyncio.timeout(timeout):
            await CASES[name](comm, victim, tick)
    except ucxcomm.PeerFailure as exc:
        report(comm.rank, exc, state["last"])
    linger = float(os.environ.get("UCXCOMM_TEST_LINGER_S", "0"))
    if linger:
        # A survivor that goes on (instead of aborting at once) must outlive UCX's own
        # discovery of the death: over RDMA the queue pairs to the dead peer fail once
        # their retries run out (seconds later), which UCX treated as fatal.
        t0 = time.monotonic()
        while time.monotonic() - t0 < linger:
            await asyncio.sleep(0.1)
            comm.group.transport.poll()  # (the event loop progresses it too)
        print(f"LINGERED {comm.rank} {linger:.0f} s", flush=True)
    comm.abort()


if __name__ == "__main__":
    if len(sys.argv) != 3 or (sys.argv[1] not in CASES and sys.argv[1] != "stream"):
        raise SystemExit(f"usage: fault_cases.py CASE VICTIM; cases: {', '.join(CASES)}, "
                         "stream")
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
