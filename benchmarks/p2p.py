"""Point-to-point benchmark: ucxcomm against its peers, measured in the same run.

Driver (no launcher around it)::

    python benchmarks/p2p.py [--tcp] [--out results.jsonl]

runs, one after another on this machine:

* ``ucxcomm run -n 2 python benchmarks/p2p.py --rank``: ucxcomm ``Send/Recv`` (buffers),
  ucxcomm ``send/recv`` (objects; numpy payloads out of band), and the CPU use of a rank
  blocked in ``recv``;
* raw ucxx low-level endpoints (``tag_send``/``tag_recv`` busy-polled, no asyncio: the best
  raw ucxx configuration): ``ucxcomm bench``'s program ``ucxcomm.bench.ranks_ucxx``, one job
  per size;
* ``mpiexec -n 2`` mpi4py + MPICH ``Send/Recv`` (when mpi4py is installed: ``pip install
  'ucxcomm[bench]'``);
* ``ucx_perftest`` tag_lat / tag_bw from the UCX wheel, same ``UCX_TLS``;
* plain asyncio streams over loopback TCP (``ucxcomm.bench.ranks_asyncio``).

Each measurement is one JSON line (impl, op, size, nranks, median/min/max); the driver
then prints a table and the ratios the project tracks. ``--tcp`` sets ``UCX_TLS=tcp,self``
for every UCX-based implementation. Latency is OSU-style one-way (half the ping-pong
round trip, microseconds); bandwidth is OSU-style (a window of non-blocking sends, then
an acknowledgement; GB/s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _driver

from _osu import BW_SIZES, LAT_REPS, LAT_SIZES, bw_reps, emit, lat_iters, window


# --------------------------------------------------------------------------- ranks
async def bench_ucxcomm(comm) -> None:
    import numpy as np

    other = 1 - comm.rank
    lanes = ";".join(f"{t}/{d}" for t, d in comm.transport_info()[other])
    for size in LAT_SIZES:
        buf = np.zeros(size, np.uint8)
        samples = []
        for rep in range(LAT_REPS + 1):  # rep 0 warms up
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
            if rep:
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


async def rank_main(args: argparse.Namespace) -> None:
    import ucxcomm

    comm = await ucxcomm.init()
    if comm.size != 2:
        raise SystemExit("run with: ucxcomm run -n 2 python benchmarks/p2p.py --rank")
    await bench_ucxcomm(comm)
    await bench_idle_cpu(comm)
    await comm.barrier()
    await comm.close()


# --------------------------------------------------------------------------- driver
def _perftest_record(test: str, size: int, got: tuple[float, float, float]) -> dict:
    lat50, lat_avg, bw = got
    if test.endswith("lat"):
        return {"impl": "ucx_perftest", "op": "latency_us", "size": size, "nranks": 2,
                "median": lat50, "min": lat50, "max": lat_avg, "average": lat_avg,
                "test": test}
    return {"impl": "ucx_perftest", "op": "bandwidth_GBps", "size": size, "nranks": 2,
            "median": bw, "min": 0, "max": 0, "test": test}


def measure(args: argparse.Namespace, env: dict) -> list[dict]:
    results = _driver.ucxcomm_run(2, "p2p.py", "--rank", env=env)
    results += _driver.mpiexec_run(2, "baselines/mpi_p2p.py", env=env)
    results += _driver.perftest_records([("tag_lat", 8, 20000, env),
                                         ("tag_bw", 64 << 20, 20, env)], _perftest_record)
    results += _raw_ucxx(env)
    results += _asyncio_streams(env)
    return results


def _raw_ucxx(env: dict) -> list[dict]:
    """Raw ucxx low-level endpoints busy-polled without asyncio: ``ucxcomm bench``'s
    program (one job per size), its records renamed to this script's ops."""
    names = {"latency": "latency_us", "bw": "bandwidth_GBps"}
    out = []
    for op, sizes in (("latency", LAT_SIZES), ("bw", BW_SIZES)):
        for size in sizes:
            for rec in _driver.ucxcomm_module_run(2, "ucxcomm.bench.ranks_ucxx", "p2p",
                                                  "--ops", op, "--size", str(size), env=env):
                rec.update(impl="ucxx-lowlevel-poll", op=names[rec["op"]])
                out.append(rec)
    return out


def _asyncio_streams(env: dict) -> list[dict]:
    """asyncio streams over loopback TCP: ``ucxcomm bench``'s program (one job per size),
    its records renamed to this script's ops."""
    names = {"latency": "latency_us", "bw": "bandwidth_GBps"}
    out = []
    for op, sizes in (("latency", LAT_SIZES), ("bw", BW_SIZES)):
        for size in sizes:
            for rec in _driver.run_bench([sys.executable, "-m", "ucxcomm.bench.ranks_asyncio",
                                          "p2p", "--ops", op, "--size", str(size)], env):
                rec.update(impl="asyncio-streams", op=names[rec["op"]])
                out.append(rec)
    return out


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


RATIOS = [
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


def report(args: argparse.Namespace, results: list[dict]) -> None:
    _table(results)
    out = _driver.ratios(results, RATIOS)
    idle = _driver.median_of(results, "ucxcomm-buffers", "idle_recv_cpu_fraction", 0)
    if idle is not None:
        out["idle recv CPU (fraction of a core)"] = round(idle, 4)
    _driver.print_ratios(out)


if __name__ == "__main__":
    sys.exit(_driver.main(__doc__, rank=rank_main, measure=measure, report=report,
                          tcp_help="UCX_TLS=tcp,self for UCX impls"))
