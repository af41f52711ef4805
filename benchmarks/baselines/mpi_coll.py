"""Baseline: mpi4py + MPICH collectives. Run: mpiexec -n N python mpi_coll.py"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _coll import OPS, REPS, SIZES, counts, emit, iters


def make_call(comm, op, send, recv):
    """The timed call of collective ``op`` on these buffers."""
    return {
        "allreduce": lambda: comm.Allreduce(send, recv, MPI.SUM),
        "bcast": lambda: comm.Bcast(send, 0),
        "allgather": lambda: comm.Allgather(send, recv),
        "alltoall": lambda: comm.Alltoall(send, recv),
        "reduce_scatter_block": lambda: comm.Reduce_scatter_block(send, recv, MPI.SUM),
    }[op]


def main() -> None:
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else OPS
    for op in ops:
        for size in SIZES:
            ns, nr = counts(op, size, p)
            send = np.ones(ns, np.float32)
            recv = np.zeros(nr, np.float32)
            call = make_call(comm, op, send, recv)
            call()  # warm up
            samples = []
            for _ in range(REPS):
                k = iters(size)
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    call()
                samples.append(comm.allreduce((time.perf_counter() - t0) / k, MPI.MAX))
            if comm.Get_rank() == 0:
                emit("mpi4py+mpich", op, size, p, samples)


if __name__ == "__main__":
    main()
