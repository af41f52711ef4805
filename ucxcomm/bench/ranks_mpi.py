"""mpi4py + MPICH's side of ``ucxcomm bench`` (the same operations as
:mod:`ucxcomm.bench.ranks_ucxcomm`), started by the driver as ``mpiexec -n N python -m
ucxcomm.bench.ranks_mpi SUITE --ops .. --size ..``. Windows use passive target
(``Lock_all`` once), as ucxcomm's windows need no epoch calls."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from .spec import collective_call, counts, emit, job_options, timed

IMPL = "mpi4py"


def p2p(comm, ops: list[str], size: int, plan) -> None:
    me, other = comm.Get_rank(), 1 - comm.Get_rank()
    buf = np.zeros(size, np.uint8)
    ack = np.zeros(1, np.uint8)
    w = plan.window(size)
    bufs = [np.ones(size, np.uint8) for _ in range(w)]
    rbufs = [np.empty(size, np.uint8) for _ in range(w)]
    Send, Recv, Isend, Irecv = comm.Send, comm.Recv, comm.Isend, comm.Irecv
    Waitall = MPI.Request.Waitall

    def pingpong() -> None:
        if me == 0:
            Send(buf, other)
            Recv(buf, other)
        else:
            Recv(buf, other)
            Send(buf, other)

    def window() -> None:
        if me == 0:
            Waitall([Isend(b, other, 1) for b in bufs])
            Recv(ack, other, 2)
        else:
            Waitall([Irecv(b, other, 1) for b in rbufs])
            Send(ack, other, 2)

    def window1() -> None:
        if me == 0:
            for b in bufs:
                Send(b, other, 1)
            Recv(ack, other, 2)
        else:
            for b in rbufs:
                Recv(b, other, 1)
            Send(ack, other, 2)

    def bidir() -> None:
        Waitall([Irecv(b, other, 1) for b in rbufs] + [Isend(b, other, 1) for b in bufs])

    for op in ops:
        if op == "latency":
            t = timed(plan, pingpong, plan.iters(size), comm.Barrier)
            samples = [s / 2 * 1e6 for s in t]
        else:
            body, scale = {"bw": (window, 1), "bw_w1": (window1, 1), "bibw": (bidir, 2)}[op]
            t = timed(plan, body, max(1, plan.iters(size) // w), comm.Barrier)
            samples = [scale * size * w / s / 1e9 for s in t]
        if me == 0:
            emit(IMPL, op, size, 2, samples)


def rma(comm, ops: list[str], size: int, plan) -> None:
    w = plan.window(size)
    win = MPI.Win.Allocate(size + 64, 1, comm=comm)
    win.Lock_all()
    origin = comm.Get_rank() == 0
    buf = np.ones(size, np.uint8)
    one, zero, res = np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    Put, Get, Flush = win.Put, win.Get, win.Flush

    def put_flush() -> None:
        Put(buf, 1)
        Flush(1)

    def get() -> None:
        Get(buf, 1)
        Flush(1)

    def fadd() -> None:
        win.Fetch_and_op(one, res, 1, size + 8, MPI.SUM)
        Flush(1)

    def cas() -> None:
        win.Compare_and_swap(one, zero, res, 1, size + 8)
        Flush(1)

    def put_window() -> None:
        for _ in range(w):
            Put(buf, 1)
        Flush(1)

    def get_window() -> None:
        for _ in range(w):
            Get(buf, 1)
        Flush(1)

    bodies = {"put_lat": (put_flush, 1), "get_lat": (get, 1), "fadd_lat": (fadd, 1),
              "cas_lat": (cas, 1), "put_bw": (put_window, w), "get_bw": (get_window, w)}
    for op in ops:
        body, per = bodies[op]
        comm.Barrier()
        if origin:
            t = timed(plan, body, max(1, plan.iters(size) // per))
            if op.endswith("_bw"):
                emit(IMPL, op, size, 2, [size * per / s / 1e9 for s in t])
            else:
                emit(IMPL, op, 8 if op in ("fadd_lat", "cas_lat") else size, 2,
                     [s * 1e6 for s in t])
        comm.Barrier()
    win.Unlock_all()
    win.Free()


def collectives(comm, ops: list[str], size: int, plan) -> None:
    p = comm.Get_size()
    for op in ops:
        ns, nr = counts(op, size, p)
        send, recv = np.ones(ns, np.float32), np.zeros(nr, np.float32)
        call = collective_call(comm, op, send, recv)
        t = timed(plan, call, plan.iters(size), comm.Barrier)
        slowest = [comm.allreduce(s, MPI.MAX) for s in t]
        if comm.Get_rank() == 0:
            emit(IMPL, op, size, p, [s * 1e6 for s in slowest])


def main(argv: list[str]) -> None:
    suite, args = argv[0], job_options(argv[1:])
    comm = MPI.COMM_WORLD
    {"p2p": p2p, "rma": rma, "collectives": collectives}[suite](comm, args.ops, args.size,
                                                                 args.plan)


if __name__ == "__main__":
    main(sys.argv[1:])
