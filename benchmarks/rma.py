"""One-sided benchmark: ucxcomm windows against ucx_perftest and mpi4py+MPICH windows,
measured in the same run.

Driver (no launcher around it)::

    python benchmarks/rma.py [--tcp] [--out results.jsonl]

runs ``ucxcomm run -n 2 python benchmarks/rma.py --rank`` (rank 0 is the origin, rank 1
the target, idle in an ``await``), then ``mpiexec -n 2 benchmarks/baselines/mpi_rma.py``
(passive target, ``Lock_all``) and ``ucx_perftest`` (``ucp_put_lat``, ``ucp_put_bw``,
``ucp_get``, ``ucp_fadd``) configured like ucxcomm's RMA engines (without RDMA: atomics with
``UCX_PROTO_ENABLE=n``, bulk transfers with UCX's defaults). ``--tcp``:
``UCX_TLS=tcp,self`` for the UCX-based runs (MPICH keeps its own shared-memory path).

Measurements (median of 5 samples): ``put_flush_us`` (8 B ``Put`` + ``Flush``: a round
trip), ``fetch_and_op_us`` (an awaited 8 B ``Fetch_and_op``), ``sendrecv_oneway_us``
(ucxcomm's 8 B ``Send/Recv`` one-way latency, for the ratio the issue tracks), and
``put_GBps`` / ``get_GBps`` (64 MiB ``Put``+``Flush`` / ``Get``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _driver

BIG = 64 << 20


def emit(impl: str, op: str, samples: list[float], size: int = 8) -> None:
    _driver.bench_line({"impl": impl, "op": op, "size": size,
                        "median": statistics.median(samples), "min": min(samples),
                        "max": max(samples)})


async def rank_main(args: argparse.Namespace) -> None:
    import numpy as np

    import ucxcomm

    comm = await ucxcomm.init()
    if comm.size != 2:
        raise SystemExit("run with: ucxcomm run -n 2 python benchmarks/rma.py --rank")
    win = await ucxcomm.Win.Allocate(comm, BIG + 64, disp_unit=1)
    origin = comm.rank == 0
    small = np.ones(1, np.int64)
    big = np.ones(BIG, np.uint8)

    async def timed(fn, n: int) -> list[float]:
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                await fn()
            out.append((time.perf_counter() - t0) / n)
        return out

    async def put_flush() -> None:
        await win.Put(small, 1, BIG)
        await win.Flush(1)

    async def fop() -> None:
        await win.Fetch_and_op(1, 1, BIG + 8)

    async def put_big() -> None:
        await win.Put(big, 1, 0)
        await win.Flush(1)

    async def get_big() -> None:
        await win.Get(big, 1, 0)

    for name, fn, n, size in (("put_flush_us", put_flush, 2000, 8),
                              ("fetch_and_op_us", fop, 2000, 8),
                              ("put_GBps", put_big, 5, BIG), ("get_GBps", get_big, 5, BIG)):
        await comm.barrier()
        if origin:
            await fn()  # warm up
            samples = await timed(fn, n)
            if name.endswith("GBps"):
                emit("ucxcomm", name, [size / s / 1e9 for s in samples], size)
            else:
                emit("ucxcomm", name, [s * 1e6 for s in samples], size)
        await comm.barrier()  # the target simply awaits meanwhile
    buf = np.zeros(8, np.uint8)
    other = 1 - comm.rank
    samples = []
    for _ in range(5):
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(2000):
            if origin:
                await comm.Send(buf, other)
                await comm.Recv(buf, other)
            else:
                await comm.Recv(buf, other)
                await comm.Send(buf, other)
        samples.append((time.perf_counter() - t0) / 2000 / 2 * 1e6)
    if origin:
        emit("ucxcomm", "sendrecv_oneway_us", samples)
    await win.Free()
    await comm.close()


# --------------------------------------------------------------------------- driver
def _perftest_record(test: str, size: int, got: tuple[float, float, float]) -> dict:
    op = "GBps" if test in ("ucp_put_bw", "ucp_get") else "us"
    return {"impl": "ucx_perftest", "op": f"{test}_{op}", "size": size,
            "median": got[2] if op == "GBps" else got[0], "min": 0, "max": 0}


def measure(args: argparse.Namespace, env: dict) -> list[dict]:
    results = _driver.ucxcomm_run(2, "rma.py", "--rank", env=env)
    results += _driver.mpiexec_run(2, "baselines/mpi_rma.py", env=env)
    # The same split as ucxcomm's RMA engines without RDMA: atomics on UCX's v1
    # protocols (UCX_PROTO_ENABLE=n), bulk transfers on the default ones.
    aenv = dict(env)
    if not os.path.isdir("/sys/class/infiniband"):
        aenv.setdefault("UCX_PROTO_ENABLE", "n")
    results += _driver.perftest_records([("ucp_put_lat", 8, 20000, env),
                                         ("ucp_fadd", 8, 20000, aenv),
                                         ("ucp_put_bw", BIG, 20, env),
                                         ("ucp_get", BIG, 20, env)], _perftest_record)
    return results


RATIOS = [
    ("Put 64 MiB / perftest ucp_put_bw", ("ucxcomm", "put_GBps"),
     ("ucx_perftest", "ucp_put_bw_GBps")),
    ("Get 64 MiB / perftest ucp_get", ("ucxcomm", "get_GBps"),
     ("ucx_perftest", "ucp_get_GBps")),
    ("Fetch_and_op / own Send-Recv one-way", ("ucxcomm", "fetch_and_op_us"),
     ("ucxcomm", "sendrecv_oneway_us")),
    ("Fetch_and_op / perftest ucp_fadd", ("ucxcomm", "fetch_and_op_us"),
     ("ucx_perftest", "ucp_fadd_us")),
    ("Fetch_and_op / mpi4py Fetch_and_op", ("ucxcomm", "fetch_and_op_us"),
     ("mpi4py+mpich", "fetch_and_op_us")),
    ("Put+Flush / mpi4py Put+Flush", ("ucxcomm", "put_flush_us"),
     ("mpi4py+mpich", "put_flush_us")),
    ("Put 64 MiB / mpi4py", ("ucxcomm", "put_GBps"), ("mpi4py+mpich", "put_GBps")),
    ("Get 64 MiB / mpi4py", ("ucxcomm", "get_GBps"), ("mpi4py+mpich", "get_GBps")),
]


def report(args: argparse.Namespace, results: list[dict]) -> None:
    _driver.print_ratios(_driver.ratios(results, RATIOS))


if __name__ == "__main__":
    sys.exit(_driver.main(__doc__, rank=rank_main, measure=measure, report=report))
