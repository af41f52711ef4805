"""Baseline: mpi4py + MPICH windows (passive target). Run: mpiexec -n 2 python mpi_rma.py"""

import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

BIG = 64 << 20


def emit(op, samples, size=8):
    rec = {"impl": "mpi4py+mpich", "op": op, "size": size,
           "median": statistics.median(samples), "min": min(samples), "max": max(samples)}
    sys.stdout.write("BENCH " + json.dumps(rec) + "\n")
    sys.stdout.flush()


def main() -> None:
    comm = MPI.COMM_WORLD
    win = MPI.Win.Allocate(BIG + 64, 1, comm=comm)
    origin = comm.Get_rank() == 0
    small = np.ones(1, np.int64)
    res = np.zeros(1, np.int64)
    big = np.ones(BIG, np.uint8)
    win.Lock_all()

    def put_flush():
        win.Put(small, 1, target=BIG)
        win.Flush(1)

    def fop():
        win.Fetch_and_op(small, res, 1, target_disp=BIG + 8, op=MPI.SUM)
        win.Flush(1)

    def put_big():
        win.Put(big, 1, target=0)
        win.Flush(1)

    def get_big():
        win.Get(big, 1, target=0)
        win.Flush(1)

    for name, fn, n, size in (("put_flush_us", put_flush, 2000, 8),
                              ("fetch_and_op_us", fop, 2000, 8),
                              ("put_GBps", put_big, 5, BIG), ("get_GBps", get_big, 5, BIG)):
        comm.Barrier()
        if origin:
            fn()
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples.append((time.perf_counter() - t0) / n)
            if name.endswith("GBps"):
                emit(name, [size / s / 1e9 for s in samples], size)
            else:
                emit(name, [s * 1e6 for s in samples])
        comm.Barrier()
    win.Unlock_all()
    win.Free()


if __name__ == "__main__":
    main()
