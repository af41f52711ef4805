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
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


def _run(cmd: list[str], env: dict, timeout: float = 900) -> list[dict]:
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print("  timed out", file=sys.stderr)
        return []
    if proc.returncode != 0:
        print(f"  failed ({proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return [json.loads(line[6:]) for line in proc.stdout.splitlines()
            if line.startswith("BENCH ")]


def _perftest(test: str, size: int, iters: int, env: dict) -> dict | None:
    import libucx

    exe = Path(libucx.__file__).parent / "bin" / "ucx_perftest"
    if not exe.exists():
        return None
    env = dict(env, LD_LIBRARY_PATH=str(exe.parent.parent / "lib"))
    port = 20000 + (os.getpid() + hash(test)) % 20000
    server = subprocess.Popen([str(exe), "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _attempt in range(50):  # the server needs a moment to listen
            proc = subprocess.run([str(exe), "127.0.0.1", "-p", str(port), "-t", test, "-s",
                                   str(size), "-n", str(iters)], capture_output=True,
                                  text=True, env=env, timeout=300)
            if proc.returncode == 0:
                break
            time.sleep(0.1)
        else:
            return None
    finally:
        server.kill()
        server.wait()
    final = [ln for ln in proc.stdout.splitlines() if ln.startswith("Final:")]
    if not final:
        return None
    cols = final[0].split()
    lat50, bw = float(cols[2]), float(cols[5]) * (1 << 20) / 1e9
    op = "GBps" if test in ("ucp_put_bw", "ucp_get") else "us"
    return {"impl": "ucx_perftest", "op": f"{test}_{op}", "size": size,
            "median": bw if op == "GBps" else lat50, "min": 0, "max": 0}


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
    results = _run([py, "-m", "ucxcomm.cli", "run", "-n", "2", "--timeout", "900", py,
                    str(HERE / "rma.py"), "--rank"], env)
    mpiexec = shutil.which("mpiexec", path=str(Path(py).parent)) or shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpiexec = None
    if mpiexec:
        results += _run([mpiexec, "-n", "2", py, str(HERE / "baselines" / "mpi_rma.py")], env)
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
    for r in results:
        r["transport"] = "tcp" if args.tcp else "default"
    if args.out:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    for r in results:
        print(json.dumps(r))
    print("\nratios (median / median):")
    for k, v in _ratios(results).items():
        print(f"  {k:42s} {v}")
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
