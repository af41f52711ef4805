"""Shared pieces of the benchmark drivers.

A benchmark script (benchmarks/p2p.py, rma.py, collectives.py) has two modes, both
entered through :func:`main`: the *driver* (no launcher around it) runs the ucxcomm ranks
and the peers one after another, collects their ``BENCH {json}`` lines, records them and
prints its report; with the hidden ``--rank`` flag the script is one ucxcomm rank started
by the driver. This module holds the entry point, the jobs (their binding and command
lines come from :mod:`ucxcomm.bench.launchers`, as for ``ucxcomm bench``), and the
record/ratio helpers."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

from ucxcomm.bench import launchers
from ucxcomm.bench.perftest import free_port, perftest

__all__ = ["bench_line", "free_port", "main", "median_of", "mpiexec_run", "perftest",
           "perftest_records", "print_ratios", "ratios", "record", "run_bench",
           "ucxcomm_module_run", "ucxcomm_run"]

HERE = Path(__file__).resolve().parent

#: Launcher variables a driver started under a launcher must not hand to its children.
LAUNCHER_VARS = ("UCXCOMM_RANK", "UCXCOMM_STORE", "OMPI_", "PMI_", "SLURM_PROCID")

#: Whether jobs bind their ranks one per core (``--no-bind`` turns it off; see :func:`bound`).
BIND = True


def bound(n: int) -> bool:
    """Whether a job of ``n`` ranks runs bound one rank per core (the decision of
    :func:`ucxcomm.bench.launchers.bound_cores`, every peer alike)."""
    return launchers.bound_cores(n, BIND) is not None


# --------------------------------------------------------------------------- entry point
def main(doc: str | None, *, rank: Callable[[argparse.Namespace], Awaitable[None]],
         measure: Callable[[argparse.Namespace, dict], list[dict]],
         report: Callable[[argparse.Namespace, list[dict]], None],
         options: Callable[[argparse.ArgumentParser], None] | None = None,
         tcp_help: str = "UCX_TLS=tcp,self", drop_env: Sequence[str] = LAUNCHER_VARS) -> int:
    """The command line of a benchmark script.

    Parses the common options (the hidden ``--rank``, ``--tcp``, ``--out``) and those
    ``options(parser)`` adds. With ``--rank`` it runs ``rank(args)`` (one ucxcomm rank);
    otherwise it is the driver: ``measure(args, env)`` runs the job(s) and returns their
    records, with ``env`` this environment less the variables starting with one of
    ``drop_env`` and, for ``--tcp``, with ``UCX_TLS=tcp,self``; the records are then tagged
    with the transport, appended to ``--out`` and printed (:func:`record`), and
    ``report(args, records)`` prints the tables and ratios."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    if options is not None:
        options(parser)
    parser.add_argument("--tcp", action="store_true", help=tcp_help)
    parser.add_argument("--out", help="append JSON lines to this file")
    parser.add_argument("--no-bind", action="store_true",
                        help="leave every job's ranks unbound (default: one core per rank, "
                        "every peer alike, when there is a core per rank)")
    args = parser.parse_args()
    global BIND
    BIND = not args.no_bind
    if args.rank:
        asyncio.run(rank(args))
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop_env))}
    if args.tcp:
        env["UCX_TLS"] = "tcp,self"
    results = measure(args, env)
    record(results, "tcp" if args.tcp else "default", args.out)
    report(args, results)
    return 0


# --------------------------------------------------------------------------- launchers
def run_bench(cmd: list[str], env: dict, timeout: float = 1800) -> list[dict]:
    """Run ``cmd``; return the records of its ``BENCH {json}`` lines (reporting failures
    and "unsupported" notes on stderr)."""
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    job = launchers.run(cmd, env, timeout)
    if job.returncode is None:
        print("  timed out", file=sys.stderr)
    elif job.returncode != 0:
        print(f"  failed ({job.returncode}):\n{job.stderr[-3000:]}", file=sys.stderr)
    elif "unsupported" in job.stderr:
        print("\n".join("  " + ln for ln in job.stderr.splitlines() if "unsupported" in ln),
              file=sys.stderr)
    return job.records


def ucxcomm_run(n: int, script: str, *args: str, env: dict, timeout: int = 900) -> list[dict]:
    """Records of ``ucxcomm run -n n --timeout timeout python benchmarks/<script> args``."""
    return run_bench(launchers.ucxcomm_run_cmd(n, [sys.executable, str(HERE / script), *args],
                                               timeout=timeout, bind=BIND), env)


def ucxcomm_module_run(n: int, module: str, *args: str, env: dict, timeout: int = 900
                       ) -> list[dict]:
    """Records of ``ucxcomm run -n n --timeout timeout python -m <module> args`` (a rank
    program of ``ucxcomm bench``)."""
    return run_bench(launchers.ucxcomm_run_cmd(n, [sys.executable, "-m", module, *args],
                                               timeout=timeout, bind=BIND), env)


@functools.cache
def find_mpiexec() -> str | None:
    """The ``mpiexec`` of :func:`ucxcomm.bench.launchers.mpiexec` when mpi4py is
    installed, else None (saying so once on stderr)."""
    why = launchers.mpi_missing()
    if why is not None:
        print(why, file=sys.stderr)
        return None
    return launchers.mpiexec()


def mpiexec_run(n: int, script: str, *args: str, env: dict) -> list[dict]:
    """Records of ``mpiexec -n n python benchmarks/<script> args`` (none without mpi4py)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return []
    return run_bench(launchers.mpiexec_cmd(n, [sys.executable, str(HERE / script), *args],
                                           bind=BIND, exe=mpiexec), env)


def perftest_records(runs: Iterable[tuple[str, int, int, dict]],
                     shape: Callable[[str, int, tuple[float, float, float]], dict]
                     ) -> list[dict]:
    """Run :func:`perftest` for each ``(test, size, iters, env)``; the records
    ``shape(test, size, measurement)`` of those that ran."""
    out = []
    for test, size, iters, env in runs:
        got = perftest(test, size, iters, env, cores=launchers.perftest_cores(BIND))
        if got is not None:
            out.append(shape(test, size, got))
    return out


# --------------------------------------------------------------------------- records
def bench_line(rec: dict) -> None:
    """Print one measurement as a ``BENCH {json}`` line (what :func:`run_bench` reads)."""
    sys.stdout.write("BENCH " + json.dumps(rec) + "\n")
    sys.stdout.flush()


def record(results: list[dict], transport: str, out: str | None) -> None:
    """Tag every record with the transport, append them to ``out`` (JSON lines; its
    folder is created) if given, and print them."""
    for r in results:
        r["transport"] = transport
        r.setdefault("bound", bound(r.get("nranks", 2)))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # e.g. results/ (not in git)
        with open(out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    for r in results:
        print(json.dumps(r))


def median_of(results: list[dict], impl: str, op: str, size: int | None = None) -> float | None:
    """The median of the first record of ``impl``/``op`` (and ``size`` if given)."""
    for r in results:
        if r["impl"] == impl and r["op"] == op and (size is None or r["size"] == size):
            return r["median"]
    return None


def ratios(results: list[dict], pairs: Iterable[tuple[str, tuple, tuple]]) -> dict[str, float]:
    """``{name: median(a) / median(b)}`` (3 decimals) for each ``(name, a, b)`` whose two
    records exist (``a``, ``b``: :func:`median_of`'s ``(impl, op[, size])``)."""
    out = {}
    for name, a, b in pairs:
        va, vb = median_of(results, *a), median_of(results, *b)
        if va is not None and vb:
            out[name] = round(va / vb, 3)
    return out


def print_ratios(values: dict[str, float]) -> None:
    """Print :func:`ratios`' (and any other) named figures."""
    print("\nratios (median / median):")
    for k, v in values.items():
        print(f"  {k:45s} {v}")
