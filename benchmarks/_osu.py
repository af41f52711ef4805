"""OSU-style measurement helpers shared by the p2p benchmark and its baselines."""

from __future__ import annotations

import statistics

from _driver import bench_line

LAT_SIZES = [8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20]
BW_SIZES = [8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20]
WINDOW = 64  # osu_bw's window of in-flight sends


def lat_iters(size: int) -> int:
    return 2000 if size <= 4096 else 500 if size <= 262144 else 50


def bw_reps(size: int) -> int:
    return 20 if size <= 65536 else 5 if size <= (1 << 20) else 3


def window(size: int) -> int:
    return WINDOW if size <= (1 << 20) else 4


def emit(impl: str, op: str, size: int, samples: list[float], nranks: int = 2, **extra) -> None:
    """One JSON line; latency samples in microseconds, bandwidth samples in GB/s."""
    rec = {"impl": impl, "op": op, "size": size, "nranks": nranks,
           "median": statistics.median(samples), "min": min(samples), "max": max(samples)}
    rec.update(extra)
    bench_line(rec)
