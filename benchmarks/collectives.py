"""Collectives benchmark: ucxcomm against mpi4py+MPICH and torch.distributed (gloo),
measured in the same run on the same machine.

Driver (no launcher around it)::

    python benchmarks/collectives.py [-n 2,3,4] [--ops allreduce,bcast] [--tcp]
                                     [--gpu] [--out results.jsonl]

For each world size it runs ``ucxcomm run -n N python benchmarks/collectives.py --rank``,
then ``mpiexec -n N python benchmarks/baselines/mpi_coll.py`` (``pip install
'ucxcomm[bench]'``) and, when torch is installed, ``benchmarks/baselines/gloo_coll.py``.
Every implementation runs the same float32 SUM collectives on the same sizes
(benchmarks/_coll.py). A sample is the slowest rank's mean time over a loop of calls;
each figure is the median of 3 samples. Bandwidths follow nccl-tests: ``algbw = size /
time``, ``busbw = algbw x`` (allreduce ``2(n-1)/n``, allgather/alltoall/reduce-scatter
``(n-1)/n``, bcast 1); ``size`` is the buffer for allreduce/bcast, the gathered result
for allgather and the full send buffer for alltoall/reduce-scatter.

``--gpu`` measures ucxcomm on cupy buffers instead and, when ``cupyx.distributed`` is
available, cupy's NCCL backend as the reference (NCCL needs one GPU per rank).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _driver
from _coll import OPS, REPS, SIZES, counts, emit, iters


def make_call(comm, op, send, recv):
    """The timed call of collective ``op`` on these buffers."""
    return {
        "allreduce": lambda: comm.Allreduce(send, recv),  # SUM
        "bcast": lambda: comm.Bcast(send, 0),
        "allgather": lambda: comm.Allgather(send, recv),
        "alltoall": lambda: comm.Alltoall(send, recv),
        "reduce_scatter_block": lambda: comm.Reduce_scatter_block(send, recv),
    }[op]


# --------------------------------------------------------------------------- ranks
async def rank_main(args: argparse.Namespace) -> None:
    import numpy as np

    import ucxcomm

    xp = np
    gpu = args.gpu
    if gpu:
        import cupy as xp  # type: ignore[no-redef]
    comm = await ucxcomm.init()
    p = comm.size
    impl = "ucxcomm-gpu" if gpu else "ucxcomm"
    for op in args.ops:
        for size in SIZES:
            ns, nr = counts(op, size, p)
            send = xp.ones(ns, xp.float32)
            recv = xp.zeros(nr, xp.float32)
            call = make_call(comm, op, send, recv)
            await call()  # warm up
            samples = []
            for _ in range(REPS):
                k = iters(size)
                await comm.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    await call()
                samples.append(await comm.allreduce((time.perf_counter() - t0) / k,
                                                    ucxcomm.MAX))
            if comm.rank == 0:
                emit(impl, op, size, p, samples)
    await comm.close()


# --------------------------------------------------------------------------- driver
def _table(results: list[dict], p: int) -> None:
    rows = [r for r in results if r["nranks"] == p]
    impls = sorted({r["impl"] for r in rows})
    ref = "ucxcomm-gpu" if "ucxcomm-gpu" in impls else "ucxcomm"
    others = [i for i in impls if i != ref]
    for op in OPS:
        got = {(r["impl"], r["size"]): r for r in rows if r["op"] == op}
        if not got:
            continue
        print(f"\n{op}, {p} ranks: time us (algbw GB/s); ratio = {ref} algbw / other algbw")
        head = f"{'size':>10} " + " ".join(f"{i:>24}" for i in impls)
        head += " " + " ".join(f"{'/' + o:>16}" for o in others)
        print(head)
        for size in SIZES:
            cells = []
            for i in impls:
                r = got.get((i, size))
                cells.append(f"{r['time_us']:>12.1f} ({r['algbw_GBps']:>7.3f})" if r
                             else f"{'-':>24}")
            ratios = []
            for o in others:
                a, b = got.get((ref, size)), got.get((o, size))
                ratios.append(f"{a['algbw_GBps'] / b['algbw_GBps']:>16.2f}" if a and b
                              else f"{'-':>16}")
            print(f"{size:>10} " + " ".join(cells) + " " + " ".join(ratios))


def measure(args: argparse.Namespace, env: dict) -> list[dict]:
    ops = ",".join(args.ops)
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
        print("torch not installed: no gloo baseline (pip install torch)", file=sys.stderr)
    results: list[dict] = []
    for p in args.n:
        results += _driver.ucxcomm_run(p, "collectives.py", "--rank", "--ops", ops,
                                       *(["--gpu"] if args.gpu else []), env=env, timeout=1800)
        if args.gpu:
            results += _driver.ucxcomm_run(p, "baselines/nccl_coll.py", ops, timeout=1800,
                                           env=dict(env, NCCL_PORT=str(_driver.free_port())))
        else:
            results += _driver.mpiexec_run(p, "baselines/mpi_coll.py", ops, env=env)
            if have_torch:
                gloo = f"tcp://127.0.0.1:{_driver.free_port()}"
                results += _driver.ucxcomm_run(p, "baselines/gloo_coll.py", ops, timeout=1800,
                                               env=dict(env, GLOO_INIT=gloo))
    return results


def report(args: argparse.Namespace, results: list[dict]) -> None:
    for p in args.n:
        _table(results, p)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", type=lambda s: [int(x) for x in s.split(",")], default=[2],
                        help="world sizes, comma separated (default 2)")
    parser.add_argument("--ops", type=lambda s: s.split(","), default=OPS,
                        help=f"comma separated subset of {','.join(OPS)}")
    parser.add_argument("--gpu", action="store_true", help="cupy buffers; NCCL reference")


if __name__ == "__main__":
    sys.exit(_driver.main(__doc__, rank=rank_main, measure=measure, report=report,
                          options=options, tcp_help="UCX_TLS=tcp,self for ucxcomm",
                          drop_env=("UCXCOMM_", "OMPI_", "PMI_", "SLURM_PROCID")))
