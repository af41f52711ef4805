"""What the benchmark measures: suites, operations, sizes, repetitions, and the record
every rank program prints (shared by the driver and the rank programs)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["OPS", "ROOTED", "SUITES", "Plan", "applies", "busbw_factor", "collective_call",
           "counts", "emit", "job_options", "local_cupy",
           "parse_sizes", "size_label", "timed"]

KIB, MIB = 1 << 10, 1 << 20

#: Operations of each suite, in report order. Latencies are OSU's (half a round trip for
#: ping-pong), bandwidths OSU's (a window of non-blocking sends, then an acknowledgement).
SUITES: dict[str, tuple[str, ...]] = {
    "p2p": ("latency", "bw", "bw_w1", "bibw"),
    "rma": ("put_lat", "get_lat", "fadd_lat", "cas_lat", "put_bw", "get_bw"),
    "collectives": ("allreduce", "bcast", "allgather", "alltoall", "reduce_scatter_block"),
    "pipeline": ("stream",),
    "torch": ("all_reduce", "ddp_step"),
}
#: Collectives measured only when ``--ops`` names them (ucxcomm and mpi4py): rooted at
#: rank 0.
ROOTED: tuple[str, ...] = ("gather", "scatter", "reduce")

#: op -> (unit, description). "us" figures: smaller is better; "GB/s": larger is better.
OPS: dict[str, tuple[str, str]] = {
    "latency": ("us", "one-way latency (half a ping-pong round trip)"),
    "bw": ("GB/s", "bandwidth, window of in-flight sends"),
    "bw_w1": ("GB/s", "bandwidth, window 1 (each send completes before the next)"),
    "bibw": ("GB/s", "bidirectional bandwidth (both sides send a window at once)"),
    "put_lat": ("us", "Put + Flush round trip"),
    "get_lat": ("us", "Get, completed"),
    "fadd_lat": ("us", "8-byte fetch-and-add, completed"),
    "cas_lat": ("us", "8-byte compare-and-swap, completed"),
    "put_bw": ("GB/s", "Put bandwidth (window of puts, then Flush)"),
    "get_bw": ("GB/s", "Get bandwidth (window of gets, then Flush)"),
    "allreduce": ("us", "float32 SUM allreduce, slowest rank's mean"),
    "bcast": ("us", "broadcast from rank 0, slowest rank's mean"),
    "allgather": ("us", "allgather (size = gathered result), slowest rank's mean"),
    "alltoall": ("us", "alltoall (size = whole send buffer), slowest rank's mean"),
    "reduce_scatter_block": ("us", "float32 SUM reduce-scatter (size = whole send buffer)"),
    "gather": ("us", "gather to rank 0 (size = gathered result), slowest rank's mean"),
    "scatter": ("us", "scatter from rank 0 (size = whole send buffer), slowest rank's mean"),
    "reduce": ("us", "float32 SUM reduce to rank 0, slowest rank's mean"),
    "stream": ("GB/s", "producer -> consumer process, one batch per message, on endpoints"),
    "all_reduce": ("us", "torch.distributed all_reduce, float32 SUM in place, slowest rank"),
    "ddp_step": ("us", "one DDP step of an MLP (size = parameter bytes), slowest rank"),
}

#: Latency ops run up to this size (OSU's latency test stops at 4 MiB); atomics are 8 B.
LAT_MAX = 4 * MIB
#: Ops measured once per sweep (their size is their own): 8 B atomics, a DDP step.
ONCE = ("fadd_lat", "cas_lat", "ddp_step")

DEFAULT_SIZES = {
    "p2p": [8, 64, 512, 4 * KIB, 32 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB],
    "rma": [8, 4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB],
    "collectives": [8, 4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB],
    "pipeline": [64 * KIB, MIB, 16 * MIB, 64 * MIB],
    "torch": [8, 64, 512, 4 * KIB, 32 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB],
}
QUICK_SIZES = {"p2p": [8, 4 * KIB, MIB], "rma": [8, MIB], "collectives": [8, 64 * KIB, MIB],
               "pipeline": [64 * KIB, MIB], "torch": [8, 4 * KIB, MIB]}

_UNITS = {"": 1, "K": KIB, "M": MIB, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """``"8,4K,1M,64M"`` -> sorted byte counts (``K``/``M``/``G`` are powers of 1024)."""
    out = set()
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B").removesuffix("I")
        if not part:
            continue
        num, unit = (part[:-1], part[-1]) if part[-1] in "KMG" else (part, "")
        try:
            value = int(num) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"bad size {part!r}: use bytes or K/M/G, e.g. 8,4K,1M") from None
        if value < 1 or value > (1 << 32):
            raise ValueError(f"size {part!r} out of range (1 B to 4 GiB)")
        out.add(value)
    if not out:
        raise ValueError("no sizes given")
    return sorted(out)


def local_cupy() -> Any:
    """cupy, with this rank's GPU (``LOCAL_RANK`` modulo the device count, as ``ucxcomm
    run`` and torchrun number ranks on a node) made current: ``--gpu`` jobs."""
    import os

    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(int(os.environ.get("LOCAL_RANK", "0")) % count).use()
    return cupy


def size_label(size: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", MIB), ("K", KIB)):
        if size >= mult and size % mult == 0:
            return f"{size // mult}{unit}"
    return str(size)


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw x factor."""
    if op == "allreduce":
        return 2 * (nranks - 1) / nranks
    if op in ("bcast", "reduce"):
        return 1.0
    return (nranks - 1) / nranks


def counts(op: str, size: int, nranks: int) -> tuple[int, int]:
    """float32 element counts ``(send, recv)`` of collective ``op`` at ``size`` bytes,
    with nccl-tests' meaning of size (see :data:`OPS`)."""
    n = max(1, size // 4)
    if op in ("allreduce", "bcast", "reduce"):
        return n, n
    per = max(1, n // nranks)
    if op in ("allgather", "gather"):
        return per, per * nranks
    if op == "scatter":
        return per * nranks, per
    if op == "alltoall":
        return per * nranks, per * nranks
    return per * nranks, per  # reduce_scatter_block


def collective_call(comm, op: str, send, recv):
    """The timed call of collective ``op`` on an mpi4py-style communicator (mpi4py's and
    ucxcomm's share the method names; SUM where it reduces)."""
    if op == "bcast":
        return lambda: comm.Bcast(send, 0)
    if op in ROOTED:
        rooted = {"gather": comm.Gather, "scatter": comm.Scatter, "reduce": comm.Reduce}[op]
        return lambda: rooted(send, recv, root=0)
    method = {"allreduce": comm.Allreduce, "allgather": comm.Allgather,
              "alltoall": comm.Alltoall, "reduce_scatter_block": comm.Reduce_scatter_block}[op]
    return lambda: method(send, recv)


@dataclass(frozen=True)
class Plan:
    """How much to repeat: ``samples`` timed repetitions (after one warm-up) of a loop of
    :meth:`iters` calls; bandwidth windows of :meth:`window` messages."""

    quick: bool = False

    @property
    def samples(self) -> int:
        return 3 if self.quick else 5

    def iters(self, size: int) -> int:
        n = 1000 if size <= 4 * KIB else 200 if size <= 256 * KIB else 20 if size <= 4 * MIB \
            else 4
        return max(2, n // 10) if self.quick else n

    def window(self, size: int) -> int:
        return 64 if size <= MIB else 4


def emit(impl: str, op: str, size: int, nranks: int, samples: list[float], **extra) -> None:
    """Print one measurement (``samples`` in the op's unit) as a ``BENCH {json}`` line."""
    rec: dict[str, Any] = {
        "impl": impl, "op": op, "size": size, "nranks": nranks, "unit": OPS[op][0],
        "median": statistics.median(samples), "min": min(samples), "max": max(samples),
        "samples": len(samples)}
    if op in SUITES["collectives"] or op in ROOTED:
        algbw = size / (rec["median"] * 1e-6) / 1e9
        rec["algbw_GBps"] = algbw
        rec["busbw_GBps"] = algbw * busbw_factor(op, nranks)
    rec.update(extra)
    sys.stdout.write("BENCH " + json.dumps(rec) + "\n")
    sys.stdout.flush()


def applies(op: str, size: int, sizes: list[int]) -> bool:
    """Whether ``op`` runs at ``size``: latencies up to :data:`LAT_MAX`, the :data:`ONCE`
    ops at the smallest size of the sweep only (reported at their own size)."""
    if op in ONCE:
        return size == sizes[0]
    if OPS[op][0] == "us" and op not in SUITES["collectives"] + SUITES["torch"] + ROOTED:
        return size <= LAT_MAX
    return True


def job_options(argv: list[str] | None = None):
    """The command line every rank program shares: ``--ops a,b --size N [--quick]``."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=lambda s: s.split(","), required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gpu", action="store_true")
    args = p.parse_args(argv)
    args.plan = Plan(args.quick)
    return args


def timed(plan: Plan, body, n: int, barrier=None) -> list[float]:
    """Seconds per call of ``n`` calls of the blocking ``body``: one warm-up pass, then
    ``plan.samples`` timed passes, each after ``barrier()`` when given (the peers'
    programs use this; ucxcomm's own awaits its calls the same way)."""
    out = []
    for rep in range(plan.samples + 1):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            body()
        if rep:
            out.append((time.perf_counter() - t0) / n)
    return out
