"""Baseline: mpi4py Send/Recv (OSU latency and bandwidth). Run: mpiexec -n 2 python mpi_p2p.py"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _osu import BW_SIZES, LAT_REPS, LAT_SIZES, bw_reps, emit, lat_iters, window


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, other = comm.Get_rank(), 1 - comm.Get_rank()
    for size in LAT_SIZES:
        buf = np.zeros(size, np.uint8)
        samples = []
        for rep in range(LAT_REPS + 1):  # rep 0 warms up
            n = lat_iters(size)
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    comm.Send(buf, other)
                    comm.Recv(buf, other)
                else:
                    comm.Recv(buf, other)
                    comm.Send(buf, other)
            if rep:
                samples.append((time.perf_counter() - t0) / n / 2 * 1e6)
        if rank == 0:
            emit("mpi4py+mpich", "latency_us", size, samples)
    ack = np.zeros(1, np.uint8)
    for size in BW_SIZES:
        w = window(size)
        bufs = [np.ones(size, np.uint8) for _ in range(w)]
        samples = []
        for rep in range(bw_reps(size) + 1):  # rep 0 warms up
            comm.Barrier()
            t0 = time.perf_counter()
            if rank == 0:
                MPI.Request.Waitall([comm.Isend(b, other, 1) for b in bufs])
                comm.Recv(ack, other, 2)
            else:
                MPI.Request.Waitall([comm.Irecv(b, other, 1) for b in bufs])
                comm.Send(ack, other, 2)
            if rep:
                samples.append(size * w / (time.perf_counter() - t0) / 1e9)
        if rank == 0:
            emit("mpi4py+mpich", "bandwidth_GBps", size, samples)


if __name__ == "__main__":
    main()
