"""OSU-style measurement helpers shared by the p2p benchmark and its baselines."""

from __future__ import annotations

import statistics

from _driver import bench_line

LAT_SIZES = [8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20]
BW_SIZES = [8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20]
WINDOW = 64  # osu_bw's window of in-flight sends


#: Timed repetitions of a latency measurement (each of lat_iters round trips), after one
#: more that warms up and is not counted (OSU's skip).
LAT_REPS = 3


def lat_iters(size: int) -> int:
    """Round trips per latency repetition (osu_latency: 10000 for small messages). 2000
    were ~20 ms over TCP, short enough for one of the VM's slow stretches to set a run's
    result."""
    return 10000 if size <= 4096 else 1000 if size <= 262144 else 100


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
