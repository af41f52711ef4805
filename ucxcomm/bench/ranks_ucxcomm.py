"""ucxcomm's side of ``ucxcomm bench``: one job of one suite at one size, started by the
driver as ``ucxcomm run -n N python -m ucxcomm.bench.ranks_ucxcomm SUITE --ops .. --size ..``.
Rank 0 prints the records."""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from .spec import SUITES, collective_call, counts, emit, job_options, local_cupy

IMPL = "ucxcomm"


async def timed_calls(comm, plan, body, n: int, *, sync: bool = True) -> list[float]:
    """Seconds per call of ``n`` calls of ``body``, one warm-up pass then
    ``plan.samples`` passes (ranks meet in a barrier before each)."""
    out = []
    for rep in range(plan.samples + 1):
        if sync:
            await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            await body()
        if rep:
            out.append((time.perf_counter() - t0) / n)
    return out


async def p2p(comm, ops: list[str], size: int, plan, gpu: bool) -> None:
    from ucxcomm import Request

    xp = local_cupy() if gpu else np
    me, other = comm.rank, 1 - comm.rank
    buf = xp.zeros(size, np.uint8)
    ack = np.zeros(1, np.uint8)  # the acknowledgement stays a host message
    w = plan.window(size)
    bufs = [xp.ones(size, np.uint8) for _ in range(w)]
    rbufs = [xp.empty(size, np.uint8) for _ in range(w)]
    Send, Recv, Isend, Irecv = comm.Send, comm.Recv, comm.Isend, comm.Irecv
    waitall = Request.waitall

    async def pingpong() -> None:
        if me == 0:
            await Send(buf, other)
            await Recv(buf, other)
        else:
            await Recv(buf, other)
            await Send(buf, other)

    async def window() -> None:
        if me == 0:
            await waitall([Isend(b, other, 1) for b in bufs])
            await Recv(ack, other, 2)
        else:
            await waitall([Irecv(b, other, 1) for b in rbufs])
            await Send(ack, other, 2)

    async def window1() -> None:
        if me == 0:
            for b in bufs:
                await Send(b, other, 1)
            await Recv(ack, other, 2)
        else:
            for b in rbufs:
                await Recv(b, other, 1)
            await Send(ack, other, 2)

    async def bidir() -> None:
        await waitall([Irecv(b, other, 1) for b in rbufs] + [Isend(b, other, 1) for b in bufs])

    for op in ops:
        if op == "latency":
            t = await timed_calls(comm, plan, pingpong, plan.iters(size))
            samples = [s / 2 * 1e6 for s in t]
        else:
            body, scale = {"bw": (window, 1), "bw_w1": (window1, 1), "bibw": (bidir, 2)}[op]
            t = await timed_calls(comm, plan, body, max(1, plan.iters(size) // w))
            samples = [scale * size * w / s / 1e9 for s in t]
        if me == 0:
            emit(IMPL + ("-gpu" if gpu else ""), op, size, 2, samples)


async def rma(comm, ops: list[str], size: int, plan) -> None:
    import ucxcomm

    w = plan.window(size)
    win = await ucxcomm.Win.Allocate(comm, size + 64, disp_unit=1)
    origin = comm.rank == 0
    buf = np.ones(size, np.uint8)
    Put, Get, Flush = win.Put, win.Get, win.Flush

    async def put_flush() -> None:
        await Put(buf, 1, 0)
        await Flush(1)

    async def get() -> None:
        await Get(buf, 1, 0)

    async def fadd() -> None:
        await win.Fetch_and_op(1, 1, size + 8)

    async def cas() -> None:
        await win.Compare_and_swap(1, 0, 1, size + 8)

    async def put_window() -> None:
        for _ in range(w):
            await Put(buf, 1, 0)
        await Flush(1)

    async def get_window() -> None:
        await asyncio.gather(*[Get(buf, 1, 0) for _ in range(w)])

    bodies = {"put_lat": (put_flush, 1), "get_lat": (get, 1), "fadd_lat": (fadd, 1),
              "cas_lat": (cas, 1), "put_bw": (put_window, w), "get_bw": (get_window, w)}
    for op in ops:
        body, per = bodies[op]
        await comm.barrier()
        if origin:  # passive target: rank 1 only waits in the barrier
            t = await timed_calls(comm, plan, body, max(1, plan.iters(size) // per), sync=False)
            if op.endswith("_bw"):
                emit(IMPL, op, size, 2, [size * per / s / 1e9 for s in t])
            else:
                emit(IMPL, op, 8 if op in ("fadd_lat", "cas_lat") else size, 2,
                     [s * 1e6 for s in t])
        await comm.barrier()
    await win.Free()


async def collectives(comm, ops: list[str], size: int, plan, gpu: bool) -> None:
    import ucxcomm

    xp = local_cupy() if gpu else np
    p = comm.size
    for op in ops:
        ns, nr = counts(op, size, p)
        send, recv = xp.ones(ns, xp.float32), xp.zeros(nr, xp.float32)
        call = collective_call(comm, op, send, recv)
        t = await timed_calls(comm, plan, call, plan.iters(size))
        slowest = [await comm.allreduce(s, ucxcomm.MAX) for s in t]
        if comm.rank == 0:
            emit(IMPL + ("-gpu" if gpu else ""), op, size, p, [s * 1e6 for s in slowest])


async def main(argv: list[str]) -> None:
    import ucxcomm

    suite, args = argv[0], job_options(argv[1:])
    if args.gpu:
        local_cupy()  # this rank's CUDA device before UCX starts, as a GPU application has
    async with ucxcomm.init() as comm:
        if suite == "p2p":
            await p2p(comm, args.ops, args.size, args.plan, args.gpu)
        elif suite == "rma":
            await rma(comm, args.ops, args.size, args.plan)
        elif suite == "collectives":
            await collectives(comm, args.ops, args.size, args.plan, args.gpu)
        else:
            raise SystemExit(f"unknown suite {suite!r}; one of {', '.join(SUITES)}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
