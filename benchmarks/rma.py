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
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _driver import perftest, print_ratios, record, run_bench  # noqa: E402

BIG = 64 << 20


def emit(impl: str, op: str, samples: list[float], size: int = 8) -> None:
    rec = {"impl": impl, "op": op, "size": size, "median": statistics.median(samples),
           "min": min(samples), "max": max(samples)}
    sys.stdout.write("BENCH " + json.dumps(rec) + "\n")
    sys.stdout.flush()


async def rank_main() -> None:
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


def _perftest(test: str, size: int, iters: int, env: dict) -> dict | None:
    got = perftest(test, size, iters, env)
    if got is None:
        return None
    op = "GBps" if test in ("ucp_put_bw", "ucp_get") else "us"
    return {"impl": "ucx_perftest", "op": f"{test}_{op}", "size": size,
            "median": got[2] if op == "GBps" else got[0], "min": 0, "max": 0}


def _ratios(results: list[dict]) -> dict[str, float]:
    def get(impl: str, op: str) -> float | None:
        for r in results:
            if (r["impl"], r["op"]) == (impl, op):
                return r["median"]
        return None

    pairs = [
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
    out = {}
    for name, a, b in pairs:
        va, vb = get(*a), get(*b)
        if va is not None and vb:
            out[name] = round(va / vb, 3)
    return out


def driver(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if args.tcp:
        env["UCX_TLS"] = "tcp,self"
    for var in [k for k in env if k.startswith(("UCXCOMM_RANK", "UCXCOMM_STORE", "OMPI_",
                                                "PMI_", "SLURM_PROCID"))]:
        env.pop(var)
    py = sys.executable
    results = run_bench([py, "-m", "ucxcomm.cli", "run", "-n", "2", "--timeout", "900", py,
                    str(HERE / "rma.py"), "--rank"], env)
    mpiexec = shutil.which("mpiexec", path=str(Path(py).parent)) or shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpiexec = None
    if mpiexec:
        results += run_bench([mpiexec, "-n", "2", py, str(HERE / "baselines" / "mpi_rma.py")], env)
    else:
        print("mpi4py/mpiexec not installed: pip install 'ucxcomm[bench]'", file=sys.stderr)
    # The same split as ucxcomm's RMA engines without RDMA: atomics on UCX's v1
    # protocols (UCX_PROTO_ENABLE=n), bulk transfers on the default ones.
    aenv = dict(env)
    if not os.path.isdir("/sys/class/infiniband"):
        aenv.setdefault("UCX_PROTO_ENABLE", "n")
    for test, size, iters in (("ucp_put_lat", 8, 20000), ("ucp_fadd", 8, 20000),
                              ("ucp_put_bw", BIG, 20), ("ucp_get", BIG, 20)):
        rec = _perftest(test, size, iters, aenv if test == "ucp_fadd" else env)
        if rec:
            results.append(rec)
    record(results, "tcp" if args.tcp else "default", args.out)
    print_ratios(_ratios(results))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp,self")
    parser.add_argument("--out", help="append JSON lines to this file")
    args = parser.parse_args()
    if args.rank:
        asyncio.run(rank_main())
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
