"""Baseline: torch.distributed with the gloo backend (CPU tensors).

Run under ``ucxcomm run -n N`` (only for its rank/size variables) with
``GLOO_INIT=tcp://127.0.0.1:PORT``; collectives gloo lacks are skipped.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _coll import OPS, REPS, SIZES, counts, emit, iters


def make_call(op, send, recv, parts):
    """The timed call of collective ``op`` on these buffers."""
    return {
        "allreduce": lambda: dist.all_reduce(send),
        "bcast": lambda: dist.broadcast(send, 0),
        "allgather": lambda: dist.all_gather(parts, send),
        "alltoall": lambda: dist.all_to_all_single(recv, send),
        "reduce_scatter_block": lambda: dist.reduce_scatter_tensor(recv, send),
    }[op]


def main() -> None:
    rank, p = int(os.environ["UCXCOMM_RANK"]), int(os.environ["UCXCOMM_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["GLOO_INIT"], rank=rank,
                            world_size=p)
    torch.set_num_threads(1)
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else OPS
    for op in ops:
        for size in SIZES:
            ns, nr = counts(op, size, p)
            send = torch.ones(ns, dtype=torch.float32)
            recv = torch.zeros(nr, dtype=torch.float32)
            parts = list(recv.chunk(p)) if op == "allgather" else None
            call = make_call(op, send, recv, parts)
            try:
                call()  # warm up
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                if rank == 0:
                    print(f"gloo: {op} unsupported ({str(exc).splitlines()[0][:80]})",
                          file=sys.stderr)
                break
            samples = []
            for _ in range(REPS):
                k = iters(size)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    call()
                t = torch.tensor([(time.perf_counter() - t0) / k], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                samples.append(float(t))
            if rank == 0:
                emit("torch-gloo", op, size, p, samples)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
