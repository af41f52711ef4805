"""How a benchmark job starts: the one binding decision (cores per rank) and the command
line of each launcher (``ucxcomm run``, MPICH's ``mpiexec``, ``ucx_perftest``'s pair,
gloo's ranks), shared by ``ucxcomm bench`` and the tracking scripts in ``benchmarks/``.

Binding: every peer alike, one rank per core, when there is a core per rank
(``ucxcomm run --bind-to core``, ``mpiexec -bind-to core``, ``ucx_perftest``'s server on
the first core and its client on the second, gloo rank *r* pinned to the *r*-th core);
``bind=False`` (``--no-bind``) or more ranks than cores: nothing bound. Unbound, two
spinning ranks on the project's 2-core VM were now and then stacked on one core by the
scheduler: 8 B loopback TCP latency came out 4.7-5.0 or 6.0-6.4 us from one run to the
next, ``ucx_perftest`` alike (docs/design.md, "--bind-to core").
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Finished", "bound_cores", "mpi_missing", "mpiexec", "mpiexec_cmd", "parse_records",
           "perftest_cores", "pin", "run", "ucxcomm_run_cmd"]

#: What a rank program prints before each record's JSON (:func:`ucxcomm.bench.spec.emit`).
PREFIX = "BENCH "


def bound_cores(n: int, bind: bool = True, available: Sequence[int] | None = None
                ) -> list[int] | None:
    """The cores of a job of ``n`` ranks bound one per core (rank *r* on the *r*-th), or
    None: unbound (``bind`` false, or fewer ``available`` cores than ranks). ``available``
    defaults to the CPUs this process may run on."""
    cpus = sorted(os.sched_getaffinity(0) if available is None else available)
    return cpus[:n] if bind and n <= len(cpus) else None


def ucxcomm_run_cmd(n: int, argv: Sequence[str], *, timeout: float, bind: bool = True,
                    available: Sequence[int] | None = None) -> list[str]:
    """``python -m ucxcomm.cli run -n n --timeout T [--bind-to core] argv...``."""
    flags = ["--bind-to", "core"] if bound_cores(n, bind, available) is not None else []
    return [sys.executable, "-m", "ucxcomm.cli", "run", "-n", str(n), "--timeout",
            str(int(timeout)), *flags, *argv]


def mpiexec() -> str | None:
    """The ``mpiexec`` next to this Python (the ``mpich`` wheel's), else on ``PATH``."""
    exe = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    return exe or shutil.which("mpiexec")


def mpi_missing() -> str | None:
    """Why mpi4py + MPICH cannot run here, or None."""
    if importlib.util.find_spec("mpi4py") is None or mpiexec() is None:
        return "mpi4py/mpiexec not installed (pip install 'ucxcomm[bench]')"
    return None


def mpiexec_cmd(n: int, argv: Sequence[str], *, bind: bool = True,
                available: Sequence[int] | None = None, exe: str | None = None) -> list[str]:
    """``mpiexec [-bind-to core] -n n argv...`` (``exe``: default :func:`mpiexec`)."""
    flags = ["-bind-to", "core"] if bound_cores(n, bind, available) is not None else []
    return [exe or mpiexec() or "mpiexec", *flags, "-n", str(n), *argv]


def perftest_cores(bind: bool = True, available: Sequence[int] | None = None
                   ) -> list[int] | None:
    """``ucx_perftest``'s pair: the server's core and the client's, or None (unbound)."""
    return bound_cores(2, bind, available)


def pin(cores: Sequence[int] | None, rank: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` pinning the process of ``rank`` to ``cores[rank]`` (None when
    ``cores`` is None): for ranks started one by one (gloo's, ``ucx_perftest``'s)."""
    if cores is None:
        return None
    return functools.partial(os.sched_setaffinity, 0, (cores[rank],))


def parse_records(stdout: str) -> list[dict]:
    """The records of a rank program's ``BENCH {json}`` lines."""
    return [json.loads(ln[len(PREFIX):]) for ln in stdout.splitlines() if ln.startswith(PREFIX)]


@dataclass
class Finished:
    """A finished (or timed-out) job: its records, exit code (None: timed out), stderr."""

    records: list[dict]
    returncode: int | None
    stderr: str


def run(cmd: Sequence[str], env: dict, timeout: float) -> Finished:
    """Run one job to its end (killed after ``timeout`` seconds) and collect its records."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Finished([], None, "")
    return Finished(parse_records(proc.stdout), proc.returncode, proc.stderr)
