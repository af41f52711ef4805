"""Raw ucxx's side of ``ucxcomm bench``: the best a ucxx user gets by hand — low-level
worker and endpoint, tag send/receive, the worker progressed in a busy loop (no asyncio,
no progress thread). A deliberate exception to the rule that only
``ucxcomm.transport._ucx`` imports ucxx: this program *is* the ucxx baseline. ucxcomm only
starts the two processes and carries the worker addresses (``ucxcomm run -n 2 python -m
ucxcomm.bench.ranks_ucxx p2p --ops .. --size ..``)."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import ucxx._lib.libucxx as ucx_lib
from ucxx._lib.arr import Array

from .spec import emit, job_options, local_cupy, timed

IMPL = "ucxx"


def p2p(me: int, worker, ep, ops: list[str], size: int, plan, gpu: bool) -> None:
    data, ctl, sync_tag = ucx_lib.UCXXTag(1), ucx_lib.UCXXTag(2), ucx_lib.UCXXTag(3)
    mask = ucx_lib.UCXXTagMaskFull
    progress = worker.progress

    def wait(req) -> None:
        while not req.completed:
            progress()
        req.check_error()

    xp = local_cupy() if gpu else np
    buf = Array(xp.zeros(size, np.uint8))
    ack = Array(np.zeros(1, np.uint8))
    w = plan.window(size)
    bufs = [Array(xp.ones(size, np.uint8)) for _ in range(w)]
    rbufs = [Array(xp.empty(size, np.uint8)) for _ in range(w)]
    token, token_in = Array(np.zeros(1, np.uint8)), Array(np.zeros(1, np.uint8))

    def barrier() -> None:
        for r in (ep.tag_send(token, sync_tag), worker.tag_recv(token_in, sync_tag, mask)):
            wait(r)

    def pingpong() -> None:
        if me == 0:
            wait(ep.tag_send(buf, data))
            wait(worker.tag_recv(buf, data, mask))
        else:
            wait(worker.tag_recv(buf, data, mask))
            wait(ep.tag_send(buf, data))

    def window() -> None:
        if me == 0:
            for r in [ep.tag_send(b, data) for b in bufs]:
                wait(r)
            wait(worker.tag_recv(ack, ctl, mask))
        else:
            for r in [worker.tag_recv(b, data, mask) for b in rbufs]:
                wait(r)
            wait(ep.tag_send(ack, ctl))

    def window1() -> None:
        if me == 0:
            for b in bufs:
                wait(ep.tag_send(b, data))
            wait(worker.tag_recv(ack, ctl, mask))
        else:
            for b in rbufs:
                wait(worker.tag_recv(b, data, mask))
            wait(ep.tag_send(ack, ctl))

    def bidir() -> None:
        reqs = [worker.tag_recv(b, data, mask) for b in rbufs]
        reqs += [ep.tag_send(b, data) for b in bufs]
        for r in reqs:
            wait(r)

    for op in ops:
        if op == "latency":
            t = timed(plan, pingpong, plan.iters(size), barrier)
            samples = [s / 2 * 1e6 for s in t]
        else:
            body, scale = {"bw": (window, 1), "bw_w1": (window1, 1), "bibw": (bidir, 2)}[op]
            t = timed(plan, body, max(1, plan.iters(size) // w), barrier)
            samples = [scale * size * w / s / 1e9 for s in t]
        if me == 0:
            emit(IMPL + ("-gpu" if gpu else ""), op, size, 2, samples)
    barrier()


async def main(argv: list[str]) -> None:
    import ucxcomm

    args = job_options(argv[1:])
    if args.gpu:
        local_cupy()  # this rank's CUDA context before UCX's, as a GPU application has
    feats = ucx_lib.Feature
    ctx = ucx_lib.UCXContext({}, feature_flags=(feats.TAG, feats.WAKEUP))
    worker = ucx_lib.UCXWorker(ctx, enable_delayed_submission=False,
                               enable_python_future=False)
    async with ucxcomm.init() as comm:  # only to start the pair and swap addresses
        peer = await comm.sendrecv(bytes(worker.address), 1 - comm.rank)
        ep = worker.create_endpoint_from_worker_address(
            ucx_lib.UCXAddress.create_from_buffer(peer), False)
        await comm.barrier()
        p2p(comm.rank, worker, ep, args.ops, args.size, args.plan, args.gpu)
        await comm.barrier()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
