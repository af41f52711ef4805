"""torch.distributed + gloo's side of ``ucxcomm bench`` (CPU tensors), started by the
driver torchrun-style (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` in the
environment of N processes) as ``python -m ucxcomm.bench.ranks_gloo SUITE --ops ..
--size ..``. Collectives gloo lacks are reported as unsupported on stderr."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .spec import counts, emit, job_options, timed

IMPL = "gloo"


def p2p(ops: list[str], size: int, plan) -> None:
    me = dist.get_rank()
    other = 1 - me
    buf = torch.zeros(size, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    w = plan.window(size)
    bufs = [torch.ones(size, dtype=torch.uint8) for _ in range(w)]
    rbufs = [torch.empty(size, dtype=torch.uint8) for _ in range(w)]
    send, recv, isend, irecv = dist.send, dist.recv, dist.isend, dist.irecv

    def pingpong() -> None:
        if me == 0:
            send(buf, other)
            recv(buf, other)
        else:
            recv(buf, other)
            send(buf, other)

    def window() -> None:
        if me == 0:
            _wait([isend(b, other, tag=1) for b in bufs])
            recv(ack, other, tag=2)
        else:
            _wait([irecv(b, other, tag=1) for b in rbufs])
            send(ack, other, tag=2)

    def window1() -> None:
        if me == 0:
            for b in bufs:
                send(b, other, tag=1)
            recv(ack, other, tag=2)
        else:
            for b in rbufs:
                recv(b, other, tag=1)
            send(ack, other, tag=2)

    def bidir() -> None:
        _wait([irecv(b, other, tag=1) for b in rbufs] + [isend(b, other, tag=1) for b in bufs])

    for op in ops:
        if op == "latency":
            t = timed(plan, pingpong, plan.iters(size), dist.barrier)
            samples = [s / 2 * 1e6 for s in t]
        else:
            body, scale = {"bw": (window, 1), "bw_w1": (window1, 1), "bibw": (bidir, 2)}[op]
            t = timed(plan, body, max(1, plan.iters(size) // w), dist.barrier)
            samples = [scale * size * w / s / 1e9 for s in t]
        if me == 0:
            emit(IMPL, op, size, 2, samples)


def collectives(ops: list[str], size: int, plan) -> None:
    p = dist.get_world_size()
    for op in ops:
        ns, nr = counts(op, size, p)
        send = torch.ones(ns, dtype=torch.float32)
        recv = torch.zeros(nr, dtype=torch.float32)
        parts = list(recv.chunk(p))
        call = _collective(op, send, recv, parts)
        try:
            call()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            if dist.get_rank() == 0:
                print(f"gloo: {op} unsupported ({str(exc).splitlines()[0][:80]})",
                      file=sys.stderr)
            continue
        t = timed(plan, call, plan.iters(size), dist.barrier)
        slowest = torch.tensor(t, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            emit(IMPL, op, size, p, [s * 1e6 for s in slowest.tolist()])


def _collective(op: str, send, recv, parts):
    """The timed call of collective ``op`` (SUM where it reduces)."""
    def call() -> None:
        if op == "allreduce":
            dist.all_reduce(send)
        elif op == "bcast":
            dist.broadcast(send, 0)
        elif op == "allgather":
            dist.all_gather(parts, send)
        elif op == "alltoall":
            dist.all_to_all_single(recv, send)
        else:
            dist.reduce_scatter_tensor(recv, send)
    return call


def _wait(works) -> None:
    for w in works:
        if w is not None:  # (typed Optional: None only for ranks outside the group)
            w.wait()


def main(argv: list[str]) -> None:
    suite, args = argv[0], job_options(argv[1:])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        if suite == "p2p":
            p2p(args.ops, args.size, args.plan)
        else:
            collectives(args.ops, args.size, args.plan)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
