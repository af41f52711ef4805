"""Point-to-point benchmark: ucxcomm against its peers, measured in the same run.

Driver (no launcher around it)::

    python benchmarks/p2p.py [--tcp] [--out results.jsonl]

runs, one after another on this machine:

* ``ucxcomm run -n 2 python benchmarks/p2p.py --rank``: ucxcomm ``Send/Recv`` (buffers),
  ucxcomm ``send/recv`` (objects; numpy payloads out of band), raw ucxx low-level
  endpoints (``tag_send``/``tag_recv`` busy-polled, no asyncio: the best raw ucxx
  configuration), and the CPU use of a rank blocked in ``recv``;
* ``mpiexec -n 2`` mpi4py + MPICH ``Send/Recv`` (when mpi4py is installed: ``pip install
  'ucxcomm[bench]'``);
* ``ucx_perftest`` tag_lat / tag_bw from the UCX wheel, same ``UCX_TLS``;
* plain asyncio streams over loopback TCP.

Each measurement is one JSON line (impl, op, size, nranks, median/min/max); the driver
then prints a table and the ratios the project tracks. ``--tcp`` sets ``UCX_TLS=tcp,self``
for every UCX-based implementation. Latency is OSU-style one-way (half the ping-pong
round trip, microseconds); bandwidth is OSU-style (a window of non-blocking sends, then
an acknowledgement; GB/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _driver import perftest, print_ratios, record, run_bench  # noqa: E402

from _osu import BW_SIZES, LAT_SIZES, bw_reps, emit, lat_iters, window  # noqa: E402


# --------------------------------------------------------------------------- ranks
async def bench_ucxcomm(comm) -> None:
    import numpy as np

    other = 1 - comm.rank
    lanes = ";".join(f"{t}/{d}" for t, d in comm.transport_info()[other])
    for size in LAT_SIZES:
        buf = np.zeros(size, np.uint8)
        samples = []
        for _rep in range(3):
            n = lat_iters(size)
            await comm.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                if comm.rank == 0:
                    await comm.Send(buf, other)
                    await comm.Recv(buf, other)
                else:
                    await comm.Recv(buf, other)
                    await comm.Send(buf, other)
            samples.append((time.perf_counter() - t0) / n / 2 * 1e6)
        if comm.rank == 0:
            emit("ucxcomm-buffers", "latency_us", size, samples, lanes=lanes)
    # small Python object
    obj = {"op": "ping", "seq": 1, "payload": [1, 2, 3]}
    samples = []
    for _rep in range(3):
        n = 2000
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if comm.rank == 0:
                await comm.send(obj, other)
                await comm.recv(other)
            else:
                await comm.recv(other)
                await comm.send(obj, other)
        samples.append((time.perf_counter() - t0) / n / 2 * 1e6)
    if comm.rank == 0:
        emit("ucxcomm-objects", "latency_us", 0, samples, object="small dict", lanes=lanes)
    ack = np.zeros(1, np.uint8)
    for size in BW_SIZES:
        w = window(size)
        bufs = [np.ones(size, np.uint8) for _ in range(w)]
        for impl in ("ucxcomm-buffers", "ucxcomm-objects"):
            samples = []
            for rep in range(bw_reps(size) + 1):  # rep 0 warms up, as OSU does
                await comm.barrier()
                t0 = time.perf_counter()
                if comm.rank == 0:
                    if impl == "ucxcomm-buffers":
                        reqs = [comm.Isend(b, other, 1) for b in bufs]
                    else:
                        reqs = [comm.isend(b, other, 1) for b in bufs]
                    await _waitall(reqs)
                    await comm.Recv(ack, other, 2)
                else:
                    if impl == "ucxcomm-buffers":
                        await _waitall([comm.Irecv(b, other, 1) for b in bufs])
                    else:
                        got = await _waitall([comm.irecv(other, 1) for _ in bufs])
                        assert got[0].nbytes == size
                        del got  # done with the data, as an application would be
                    await comm.Send(ack, other, 2)
                if rep:
                    samples.append(size * w / (time.perf_counter() - t0) / 1e9)
            if comm.rank == 0:
                emit(impl, "bandwidth_GBps", size, samples, lanes=lanes)


async def _waitall(reqs):
    import ucxcomm

    return await ucxcomm.Request.waitall(reqs)


async def bench_idle_cpu(comm) -> None:
    """CPU used by a rank blocked in ``recv`` while its peer computes for 2 s."""
    await comm.barrier()
    if comm.rank == 0:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # the peer is busy: rank 1 waits in recv
            sum(range(1000))
        await comm.send("done", 1)
    else:
        c0, t0 = time.process_time(), time.monotonic()
        await comm.recv(0)
        frac = (time.process_time() - c0) / (time.monotonic() - t0)
        emit("ucxcomm-buffers", "idle_recv_cpu_fraction", 0, [frac])
    await comm.barrier()


def bench_raw_ucxx(comm_rank: int, worker, ep) -> None:
    """Raw ucxx low-level endpoints, busy-polled without asyncio."""
    import numpy as np
    import ucxx._lib.libucxx as ucx_lib
    from ucxx._lib.arr import Array

    tag, mask = ucx_lib.UCXXTag(1), ucx_lib.UCXXTagMaskFull

    def wait(req) -> None:
        while not req.completed:
            worker.progress()
        req.check_error()

    for size in LAT_SIZES:
        arr = Array(np.zeros(size, np.uint8))
        samples = []
        for _rep in range(3):
            n = lat_iters(size)
            # rendezvous-free start: a zero-byte handshake
            _handshake(worker, ep, comm_rank)
            t0 = time.perf_counter()
            for _ in range(n):
                if comm_rank == 0:
                    wait(ep.tag_send(arr, tag))
                    wait(worker.tag_recv(arr, tag, mask))
                else:
                    wait(worker.tag_recv(arr, tag, mask))
                    wait(ep.tag_send(arr, tag))
            samples.append((time.perf_counter() - t0) / n / 2 * 1e6)
        if comm_rank == 0:
            emit("ucxx-lowlevel-poll", "latency_us", size, samples)
    ack = Array(np.zeros(1, np.uint8))
    for size in BW_SIZES:
        w = window(size)
        arrs = [Array(np.ones(size, np.uint8)) for _ in range(w)]
        samples = []
        for rep in range(bw_reps(size) + 1):  # rep 0 warms up
            _handshake(worker, ep, comm_rank)
            t0 = time.perf_counter()
            if comm_rank == 0:
                for r in [ep.tag_send(a, tag) for a in arrs]:
                    wait(r)
                wait(worker.tag_recv(ack, ucx_lib.UCXXTag(2), mask))
            else:
                for r in [worker.tag_recv(a, tag, mask) for a in arrs]:
                    wait(r)
                wait(ep.tag_send(ack, ucx_lib.UCXXTag(2)))
            if rep:
                samples.append(size * w / (time.perf_counter() - t0) / 1e9)
        if comm_rank == 0:
            emit("ucxx-lowlevel-poll", "bandwidth_GBps", size, samples)


def _handshake(worker, ep, rank: int) -> None:
    import numpy as np
    import ucxx._lib.libucxx as ucx_lib
    from ucxx._lib.arr import Array

    a = Array(np.zeros(1, np.uint8))
    t = ucx_lib.UCXXTag(3)
    reqs = [ep.tag_send(a, t), worker.tag_recv(Array(np.zeros(1, np.uint8)), t,
                                               ucx_lib.UCXXTagMaskFull)]
    for r in reqs:
        while not r.completed:
            worker.progress()


async def rank_main() -> None:
    import ucxcomm

    comm = await ucxcomm.init()
    if comm.size != 2:
        raise SystemExit("run with: ucxcomm run -n 2 python benchmarks/p2p.py --rank")
    await bench_ucxcomm(comm)
    await bench_idle_cpu(comm)
    # Raw ucxx: its own context/worker, addresses exchanged over ucxcomm.
    import ucxx._lib.libucxx as ucx_lib

    feats = ucx_lib.Feature
    ctx = ucx_lib.UCXContext({}, feature_flags=(feats.TAG, feats.WAKEUP))
    worker = ucx_lib.UCXWorker(ctx, enable_delayed_submission=False, enable_python_future=False)
    peer = await comm.sendrecv(bytes(worker.address), 1 - comm.rank)
    ep = worker.create_endpoint_from_worker_address(ucx_lib.UCXAddress.create_from_buffer(peer),
                                                    False)
    await comm.barrier()
    bench_raw_ucxx(comm.rank, worker, ep)
    await comm.barrier()
    await comm.close()


# --------------------------------------------------------------------------- driver
def _perftest(test: str, size: int, iters: int, env: dict) -> dict | None:
    got = perftest(test, size, iters, env)
    if got is None:
        return None
    lat50, lat_avg, bw = got
    if test.endswith("lat"):
        return {"impl": "ucx_perftest", "op": "latency_us", "size": size, "nranks": 2,
                "median": lat50, "min": lat50, "max": lat_avg, "average": lat_avg,
                "test": test}
    return {"impl": "ucx_perftest", "op": "bandwidth_GBps", "size": size, "nranks": 2,
            "median": bw, "min": 0, "max": 0, "test": test}


def _table(results: list[dict]) -> None:
    impls = sorted({r["impl"] for r in results})
    for op in ("latency_us", "bandwidth_GBps"):
        rows = [r for r in results if r["op"] == op]
        sizes = sorted({r["size"] for r in rows})
        print(f"\n{op} (median)")
        print(f"{'size':>10} " + " ".join(f"{i:>20}" for i in impls))
        for s in sizes:
            vals = {r["impl"]: r["median"] for r in rows if r["size"] == s}
            print(f"{s:>10} " + " ".join(
                f"{vals[i]:>20.2f}" if i in vals else f"{'-':>20}" for i in impls))


def _ratios(results: list[dict]) -> dict[str, float]:
    def get(impl: str, op: str, size: int) -> float | None:
        for r in results:
            if (r["impl"], r["op"], r["size"]) == (impl, op, size):
                return r["median"]
        return None

    out = {}
    pairs = [
        ("lat8 ucxcomm/ucxx-lowlevel", ("ucxcomm-buffers", "latency_us", 8),
         ("ucxx-lowlevel-poll", "latency_us", 8)),
        ("lat8 ucxcomm/mpi4py", ("ucxcomm-buffers", "latency_us", 8),
         ("mpi4py+mpich", "latency_us", 8)),
        ("lat8 ucxcomm/ucx_perftest", ("ucxcomm-buffers", "latency_us", 8),
         ("ucx_perftest", "latency_us", 8)),
        ("bw64M ucxcomm/mpi4py", ("ucxcomm-buffers", "bandwidth_GBps", 64 << 20),
         ("mpi4py+mpich", "bandwidth_GBps", 64 << 20)),
        ("bw64M ucxcomm/ucx_perftest", ("ucxcomm-buffers", "bandwidth_GBps", 64 << 20),
         ("ucx_perftest", "bandwidth_GBps", 64 << 20)),
        ("bw64M ucxcomm/asyncio-streams", ("ucxcomm-buffers", "bandwidth_GBps", 64 << 20),
         ("asyncio-streams", "bandwidth_GBps", 64 << 20)),
        ("bw64M ucxcomm/ucxx-lowlevel", ("ucxcomm-buffers", "bandwidth_GBps", 64 << 20),
         ("ucxx-lowlevel-poll", "bandwidth_GBps", 64 << 20)),
        ("objects: small-dict lat / lat8 buffers", ("ucxcomm-objects", "latency_us", 0),
         ("ucxcomm-buffers", "latency_us", 8)),
        ("objects: bw64M objects/buffers", ("ucxcomm-objects", "bandwidth_GBps", 64 << 20),
         ("ucxcomm-buffers", "bandwidth_GBps", 64 << 20)),
    ]
    for name, a, b in pairs:
        va, vb = get(*a), get(*b)
        if va is not None and vb:
            out[name] = round(va / vb, 3)
    idle = get("ucxcomm-buffers", "idle_recv_cpu_fraction", 0)
    if idle is not None:
        out["idle recv CPU (fraction of a core)"] = round(idle, 4)
    return out


def driver(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if args.tcp:
        env["UCX_TLS"] = "tcp,self"
    for var in [k for k in env if k.startswith(("UCXCOMM_RANK", "UCXCOMM_STORE", "OMPI_",
                                                "PMI_", "SLURM_PROCID"))]:
        env.pop(var)
    py = sys.executable
    results: list[dict] = []
    results += run_bench([py, "-m", "ucxcomm.cli", "run", "-n", "2", "--timeout", "900", py,
                     str(HERE / "p2p.py"), "--rank"], env)
    mpiexec = shutil.which("mpiexec", path=str(Path(py).parent)) or shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401

        have_mpi = mpiexec is not None
    except ImportError:
        have_mpi = False
    if have_mpi:
        results += run_bench([mpiexec, "-n", "2", py, str(HERE / "baselines" / "mpi_p2p.py")], env)
    else:
        print("mpi4py/mpiexec not installed: pip install 'ucxcomm[bench]'", file=sys.stderr)
    for test, size, iters in (("tag_lat", 8, 20000), ("tag_bw", 64 << 20, 20)):
        rec = _perftest(test, size, iters, env)
        if rec:
            results.append(rec)
    results += run_bench([py, str(HERE / "baselines" / "asyncio_streams.py")], env)
    record(results, "tcp" if args.tcp else "default", args.out)
    _table(results)
    print_ratios(_ratios(results))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp,self for UCX impls")
    parser.add_argument("--out", help="append JSON lines to this file")
    args = parser.parse_args()
    if args.rank:
        asyncio.run(rank_main())
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
