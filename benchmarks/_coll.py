"""Shared definitions of the collectives benchmark (sizes, iterations; nccl-tests' sizes
and bus bandwidth factors come from ucxcomm.bench.spec) used by benchmarks/collectives.py
and its baselines."""

from __future__ import annotations

import statistics

from _driver import bench_line

from ucxcomm.bench.spec import busbw_factor, counts  # one definition of the sizes

__all__ = ["OPS", "REPS", "SIZES", "counts", "emit", "iters"]

OPS = ["allreduce", "bcast", "allgather", "alltoall", "reduce_scatter_block"]
SIZES = [8, 4096, 65536, 1 << 20, 16 << 20, 64 << 20]
REPS = 3


def iters(size: int) -> int:
    return 500 if size <= 4096 else 100 if size <= 65536 else 20 if size <= (1 << 20) else 5


def emit(impl: str, op: str, size: int, p: int, seconds: list[float]) -> None:
    """One JSON line: median time (us), algbw = size/time and busbw (GB/s)."""
    t = statistics.median(seconds)
    algbw = size / t / 1e9
    rec = {"impl": impl, "op": op, "size": size, "nranks": p, "time_us": t * 1e6,
           "min_us": min(seconds) * 1e6, "max_us": max(seconds) * 1e6,
           "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor(op, p)}
    bench_line(rec)
