"""Shared definitions of the collectives benchmark (sizes, iterations, nccl-tests' bus
bandwidth factors) used by benchmarks/collectives.py and its baselines."""

from __future__ import annotations

import statistics

from _driver import bench_line

OPS = ["allreduce", "bcast", "allgather", "alltoall", "reduce_scatter_block"]
SIZES = [8, 4096, 65536, 1 << 20, 16 << 20, 64 << 20]
REPS = 3


def iters(size: int) -> int:
    return 500 if size <= 4096 else 100 if size <= 65536 else 20 if size <= (1 << 20) else 5


def counts(op: str, size: int, p: int) -> tuple[int, int]:
    """float32 element counts ``(send, recv)`` for ``size`` bytes, nccl-tests' sizes:
    allreduce/bcast: the buffer; allgather: the gathered result; alltoall and
    reduce_scatter: the full send buffer."""
    n = max(1, size // 4)
    if op in ("allreduce", "bcast"):
        return n, n
    per = max(1, n // p)
    if op == "allgather":
        return per, per * p
    if op == "alltoall":
        return per * p, per * p
    return per * p, per  # reduce_scatter_block


def busbw_factor(op: str, p: int) -> float:
    if op == "allreduce":
        return 2 * (p - 1) / p
    if op == "bcast":
        return 1.0
    return (p - 1) / p


def emit(impl: str, op: str, size: int, p: int, seconds: list[float]) -> None:
    """One JSON line: median time (us), algbw = size/time and busbw (GB/s)."""
    t = statistics.median(seconds)
    algbw = size / t / 1e9
    rec = {"impl": impl, "op": op, "size": size, "nranks": p, "time_us": t * 1e6,
           "min_us": min(seconds) * 1e6, "max_us": max(seconds) * 1e6,
           "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor(op, p)}
    bench_line(rec)
