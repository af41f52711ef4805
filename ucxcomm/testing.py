"""Test helpers: start programs through ``ucxcomm run`` or rank by rank, and register SPMD cases."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import ucxcomm

__all__ = ["KEPT_VARS", "LAUNCHER_VARS", "OVER_TCP", "Cases", "clean_env", "launch", "run_case",
           "run_ranks"]

#: Prefixes of the environment variables through which a launcher (ours, torchrun, Slurm,
#: Open MPI, PMI) describes the job; :func:`clean_env` drops every variable that has one.
LAUNCHER_VARS: tuple[str, ...] = (
    "UCXCOMM_", "RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "OMPI_", "PMI_",
    "MPI_LOCALNRANKS", "LOCAL_RANK", "TORCHELASTIC",
)

CaseFunction = Callable[[Any], Awaitable[Any]]

_TAIL = 6000  # characters of a failed job's output that an assertion message shows


#: The environment of the suite's over-TCP cases: UCX restricted to TCP, and the
#: transport policy left to UCX ("auto") whatever the suite runs under (with
#: ``UCXCOMM_TRANSPORT=rdma`` exported, those cases failed by design: rdma refuses TCP).
OVER_TCP = {"UCX_TLS": "tcp,self", "UCXCOMM_TRANSPORT": "auto"}


#: ``UCXCOMM_*`` variables that :func:`clean_env` keeps: they say which UCX to load, not
#: where a rank stands, and every rank of a test must load the UCX the suite runs with.
KEPT_VARS: tuple[str, ...] = ("UCXCOMM_UCX",)


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables.

    Returns
    -------
    dict of str to str
        A copy of ``os.environ`` less every variable whose name starts with one of
        :data:`LAUNCHER_VARS` (except :data:`KEPT_VARS`), so that a child forms its
        world only from what it is given.
    """
    return {k: v for k, v in os.environ.items()
            if k in KEPT_VARS or not k.startswith(LAUNCHER_VARS)}


def launch(nranks: int, argv: Sequence[str], *, timeout: float = 90.0,
           env: Mapping[str, str] | None = None, tag_output: bool = True,
           cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on ``nranks`` ranks with ``python -m ucxcomm.cli run`` and wait for it.

    The launcher's own ``--timeout`` fires first (it dumps every rank's stacks and ends
    the job); the subprocess deadline, 30 s later, is the outer one.

    Parameters
    ----------
    nranks : int
        Number of ranks (``-n``).
    argv : sequence of str
        The program each rank runs, e.g. ``[sys.executable, "prog.py", "arg"]``.
    timeout : float, optional
        The launcher's ``--timeout`` in seconds.
    env : mapping of str to str, optional
        Variables added to (or replacing those of) this process's environment.
    tag_output : bool, optional
        Pass ``--tag-output`` (each output line prefixed with ``[rank]``).
    cwd : path-like, optional
        Working directory of the launcher and its ranks; this process's by default.

    Returns
    -------
    subprocess.CompletedProcess
        The launcher's exit status and its captured stdout and stderr (text).

    Raises
    ------
    subprocess.TimeoutExpired
        If the launcher is still running ``timeout + 30`` seconds after it started.
    """
    cmd = [sys.executable, "-m", "ucxcomm.cli", "run", "-n", str(nranks),
           "--timeout", str(timeout)]
    if tag_output:
        cmd.append("--tag-output")
    cmd += list(argv)
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                          env=full_env, cwd=cwd, stdin=subprocess.DEVNULL)


def run_case(script: str | os.PathLike[str], name: str, nranks: int, *,
             timeout: float = 90.0, env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run SPMD case ``name`` of the case file ``script`` on ``nranks`` ranks.

    The case file is a program whose entry point is :meth:`Cases.main`; it is started
    with :func:`launch` as ``python SCRIPT NAME``.

    Parameters
    ----------
    script : path-like
        The case file (a path the ranks can open from ``cwd``; best absolute).
    name : str
        The case to run.
    nranks : int
        Number of ranks.
    timeout : float, optional
        The launcher's deadline in seconds (see :func:`launch`).
    env : mapping of str to str, optional
        Extra environment variables for every rank.
    cwd : path-like, optional
        Working directory of the job; this process's by default.

    Returns
    -------
    subprocess.CompletedProcess
        The finished job, for further checks of its output.

    Raises
    ------
    AssertionError
        If the job did not exit 0 or a rank did not print ``CASE-OK NAME rank R``; the
        message ends with the last 6000 characters of the job's output.
    """
    proc = launch(nranks, [sys.executable, os.fspath(script), name], timeout=timeout,
                  env=env, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-_TAIL:]}"
    for r in range(nranks):
        assert f"CASE-OK {name} rank {r}" in proc.stdout, \
            f"rank {r} did not finish\n{out[-_TAIL:]}"
    return proc


def run_ranks(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
              ok_line: str, timeout: float = 90.0, *,
              cwd: str | os.PathLike[str] | None = None,
              quiet: bool = False) -> list[str]:
    """Start one process per rank, no launcher in between, and require that all succeed.

    Every process is waited for up to ``timeout`` seconds; any still running then is
    killed.

    Parameters
    ----------
    commands : sequence of sequence of str
        Rank ``r``'s command line is ``commands[r]``.
    envs : sequence of mapping of str to str
        Rank ``r``'s complete environment is ``envs[r]`` (see :func:`clean_env`).
    ok_line : str
        What each rank must print, formatted with ``rank=r``, e.g. ``"OK rank {rank}"``.
    timeout : float, optional
        Seconds to wait for each process in turn.
    cwd : path-like, optional
        Working directory of every rank; this process's by default.

    quiet : bool, optional
        Also require that no rank wrote a traceback (``Traceback`` or ``Error`` on
        stderr), e.g. for clean exits.

    Returns
    -------
    list of str
        Each rank's stdout, in rank order.

    Raises
    ------
    AssertionError
        If a rank exited non-zero or did not print its ``ok_line`` (or, with ``quiet``,
        wrote a traceback).
    subprocess.TimeoutExpired
        If a rank was still running at its deadline (every rank is killed first).
    """
    procs = [subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for cmd, env in zip(commands, envs, strict=True)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out}\n{err[-4000:]}"
        assert ok_line.format(rank=r) in out, f"rank {r}:\n{out}\n{err[-4000:]}"
        if quiet:
            assert "Traceback" not in err and "Error" not in err, \
                f"rank {r} was not quiet:\n{err[-4000:]}"
    return [out for out, _ in outs]


async def refuses_timeout(call: Callable[[Any], Awaitable[Any]], bad: Any,
                          exc_type: type[BaseException]) -> None:
    """``await call(bad)`` must raise ``exc_type`` naming the timeout (a bad
    ``timeout=``, refused at the call)."""
    try:
        await call(bad)
    except exc_type as exc:
        assert "timeout" in str(exc), exc
    else:
        raise AssertionError(f"timeout={bad!r} accepted by {call}")


class Cases:
    """A registry of SPMD cases: coroutine functions ``case(comm)`` that every rank runs.

    A case file creates one registry, decorates its cases with :meth:`case` and ends with
    ``if __name__ == "__main__": cases.main()``; ``python FILE NAME`` under a launcher
    then runs case ``NAME`` on every rank (see :meth:`run`). :func:`run_case` starts such
    a job and checks it.

    Parameters
    ----------
    check_init_idempotent : bool, optional
        Also require that a second ``ucxcomm.init()`` returns the same communicator.
    collect_garbage : bool, optional
        Run ``gc.collect()`` after the case (and the finalize), before ``CASE-OK``.

    Examples
    --------
    >>> cases = Cases()
    >>> @cases.case
    ... async def ring(comm):
    ...     right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    ...     assert await comm.sendrecv(comm.rank, right, source=left) == left
    >>> "ring" in cases
    True
    """

    def __init__(self, *, check_init_idempotent: bool = False,
                 collect_garbage: bool = False) -> None:
        self._cases: dict[str, CaseFunction] = {}
        self.check_init_idempotent = check_init_idempotent
        self.collect_garbage = collect_garbage

    def case(self, fn: CaseFunction) -> CaseFunction:
        """Register ``fn`` under its ``__name__`` (a decorator; returns ``fn`` unchanged).

        Parameters
        ----------
        fn : callable
            ``async def NAME(comm)``. It returns ``None`` when the communicator is still
            usable, or a word such as ``"aborted"`` or ``"closed"`` when the case ended it
            itself (then :meth:`run` skips the closing barrier and finalize).

        Returns
        -------
        callable
            ``fn``.

        Raises
        ------
        ValueError
            If a case of that name is already registered.
        """
        name = fn.__name__
        if name in self._cases:
            raise ValueError(f"SPMD case {name!r} is registered twice")
        self._cases[name] = fn
        return fn

    def names(self) -> list[str]:
        """The registered case names, in registration order.

        Returns
        -------
        list of str
            Every name :meth:`run` accepts.
        """
        return list(self._cases)

    def __contains__(self, name: object) -> bool:
        return name in self._cases

    def __iter__(self) -> Iterator[str]:
        return iter(self._cases)

    def __len__(self) -> int:
        return len(self._cases)

    def __getitem__(self, name: str) -> CaseFunction:
        """The case called ``name``.

        Raises
        ------
        KeyError
            If there is none; the message lists the known names.
        """
        try:
            return self._cases[name]
        except KeyError:
            raise KeyError(self._unknown(name)) from None

    def _unknown(self, name: str) -> str:
        return f"unknown SPMD case {name!r}; known cases: {', '.join(self._cases) or 'none'}"

    async def run(self, name: str) -> Any:
        """Run case ``name`` on this rank, in the world the launcher describes.

        Forms the world with ``ucxcomm.init()``, awaits the case, then (if it returned
        ``None``) a barrier with a 60 s deadline and ``ucxcomm.finalize()``, and prints
        ``CASE-OK NAME rank R`` to stdout.

        Parameters
        ----------
        name : str
            A registered case.

        Returns
        -------
        object
            What the case returned.

        Raises
        ------
        KeyError
            If no case is called ``name`` (before the world is formed).
        AssertionError
            If the case's checks fail, or with ``check_init_idempotent`` a second
            ``ucxcomm.init()`` returned another communicator.
        """
        fn = self[name]
        comm = await ucxcomm.init()
        if self.check_init_idempotent and await ucxcomm.init() is not comm:
            raise AssertionError("a second ucxcomm.init() returned another communicator")
        outcome = await fn(comm)
        if outcome is None:
            await comm.barrier(timeout=60)
            await ucxcomm.finalize()
        if self.collect_garbage:
            gc.collect()
        # The marker the job's checker (run_case) looks for; written, not logged.
        sys.stdout.write(f"CASE-OK {name} rank {comm.rank}\n")
        sys.stdout.flush()
        return outcome

    def main(self, argv: Sequence[str] | None = None) -> None:
        """Command-line entry point: run the case named by the single argument.

        Parameters
        ----------
        argv : sequence of str, optional
            The arguments, ``sys.argv[1:]`` by default: exactly one case name.

        Raises
        ------
        SystemExit
            With a usage message if there is not exactly one argument, or with the
            known names if the case does not exist (before any UCX is started).
        """
        args = sys.argv[1:] if argv is None else list(argv)
        if len(args) != 1:
            raise SystemExit(f"usage: {os.path.basename(sys.argv[0] or 'cases')} CASE "
                             f"(one of: {', '.join(self._cases)})")
        if args[0] not in self._cases:
            raise SystemExit(self._unknown(args[0]))
        asyncio.run(self.run(args[0]))
