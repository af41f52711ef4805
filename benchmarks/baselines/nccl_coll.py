"""Baseline on a GPU machine: cupy's NCCL backend (``cupyx.distributed``).

Run under ``ucxcomm run -n N`` (for its rank/size variables) with ``NCCL_PORT`` set; rank
``r`` uses GPU ``r % device_count`` (NCCL needs a distinct GPU per rank).
"""

import os
import sys
import time

import cupy
from cupyx.distributed import init_process_group

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _coll import OPS, REPS, SIZES, counts, emit, iters


def make_call(comm, op, send, recv, ns, nr):
    """The timed call of collective ``op`` on these buffers."""
    return {
        "allreduce": lambda: comm.all_reduce(send, recv, "sum"),
        "bcast": lambda: comm.broadcast(send, 0),
        "allgather": lambda: comm.all_gather(send, recv, ns),
        "alltoall": lambda: comm.all_to_all(send, recv),
        "reduce_scatter_block": lambda: comm.reduce_scatter(send, recv, nr, "sum"),
    }[op]


def main() -> None:
    rank, p = int(os.environ["UCXCOMM_RANK"]), int(os.environ["UCXCOMM_SIZE"])
    gpus = cupy.cuda.runtime.getDeviceCount()
    if gpus < p:  # NCCL refuses two ranks on one GPU: no reference rather than an error
        if rank == 0:
            print(f"nccl baseline skipped: NCCL needs one GPU per rank ({p} ranks, "
                  f"{gpus} GPU{'s' if gpus != 1 else ''})", file=sys.stderr)
        return
    cupy.cuda.Device(rank % gpus).use()
    comm = init_process_group(p, rank, port=int(os.environ["NCCL_PORT"]))
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else OPS
    stream = cupy.cuda.get_current_stream()
    for op in ops:
        for size in SIZES:
            ns, nr = counts(op, size, p)
            send = cupy.ones(ns, cupy.float32)
            recv = cupy.zeros(nr, cupy.float32)
            call = make_call(comm, op, send, recv, ns, nr)
            call()
            stream.synchronize()
            samples = []
            for _ in range(REPS):
                k = iters(size)
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    call()
                stream.synchronize()
                t = cupy.array([(time.perf_counter() - t0) / k])
                comm.all_reduce(t, t, "max")
                stream.synchronize()
                samples.append(float(t[0]))
            if rank == 0:
                emit("cupy-nccl", op, size, p, samples)


if __name__ == "__main__":
    main()
