"""``ucxcomm run``: start N local ranks like mpirun, and never leave one behind.

The launcher hosts the bootstrap store, gives each rank ``UCXCOMM_RANK``/``SIZE``/
``STORE``/``TOKEN`` (and torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, for torch.distributed), forwards
output (optionally prefixed ``[rank]``), and ends the job
when the first rank fails: the others get SIGTERM, then SIGKILL after a grace period.
The job's exit code is the first failing rank's (128+signal for a signal); ranks that
exit 0 do not end the job. SIGINT/SIGTERM to the launcher reach every rank.

With ``elastic=True`` (``ucxcomm run --elastic``) a rank's failure does not end the job:
the others go on (the store tells them; ``Comm.shrink``, docs/elastic.md). The job's
exit code is then the survivors': the first nonzero exit code of a rank that ended by
exiting, 0 when all of those exited 0; a rank ended by a signal is a casualty, not a
survivor (if every rank was, the code is the first one's, 128+signal). With
``max_restarts=K`` (``--max-restarts K``) a rank that fails is started again, at most K
times per rank, with ``UCXCOMM_RESTART_COUNT`` set to its restarts so far (like
torchrun's ``TORCHELASTIC_RESTART_COUNT``): its ``init()`` then waits until the running
job admits it (``Comm.grow``); the rank's last process is what counts for the exit code.

With ``bind="core"`` (``ucxcomm run --bind-to core``) rank *r* may run only on the *r*-th
of the launcher's CPUs (round robin when ranks outnumber them; one logical CPU each, so on
an SMT machine two ranks may share a physical core when its hardware threads come in a
row in the launcher's affinity) and learns how many ranks share that CPU
(``UCXCOMM_RANKS_PER_CORE``): two ranks
spinning on two cores otherwise get moved onto one core now and then by the scheduler,
which made 8 B loopback TCP latency bimodal here (4.7-5.0 us or 6.0-6.4 us per run, for
ucx_perftest as for ucxcomm).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from ..comm import trace
from .ports import free_port
from .store import StoreServer

__all__ = ["BIND_CHOICES", "core_binding", "run_job"]

KILL_GRACE_S = 5.0
BIND_CHOICES = ("none", "core")


def core_binding(nprocs: int, cores: Sequence[int] | None = None) -> list[int]:
    """The CPU of each of ``nprocs`` ranks bound one per CPU, round robin over ``cores``
    (default: the CPUs this process may run on, in order)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if not cores:
        raise ValueError("no CPU to bind ranks to")
    return [cores[r % len(cores)] for r in range(nprocs)]


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _command(argv: Sequence[str]) -> list[str]:
    if argv and argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return list(argv)


class _Job:
    def __init__(self, nprocs: int, argv: Sequence[str], tag_output: bool,
                 timeout: float | None, bind: str = "none", elastic: bool = False,
                 max_restarts: int = 0) -> None:
        self.nprocs, self.cmd = nprocs, _command(argv)
        self.elastic = elastic
        self.max_restarts = max_restarts
        self.restarts = [0] * nprocs
        self.returncodes: dict[int, int] = {}
        self.spawn: Any = None  # (rank, restart count) -> the started process, or None
        self.tag_output, self.timeout = tag_output, timeout
        self.cores = core_binding(nprocs) if bind == "core" else None
        self.procs: list[asyncio.subprocess.Process] = []
        self.code: int | None = None
        self.stopping = False
        self.pumps: list[asyncio.Task] = []

    def _say(self, msg: str) -> None:
        sys.stderr.write(f"ucxcomm run: {msg}\n")
        sys.stderr.flush()

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)

    async def stop(self, first_sig: int = signal.SIGTERM) -> None:
        """Signal every live rank, then SIGKILL whatever is left after the grace period."""
        if self.stopping:
            return
        self.stopping = True
        self.signal_all(first_sig)
        waits = [asyncio.ensure_future(p.wait()) for p in self.procs]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=KILL_GRACE_S)
        if pending:
            self.signal_all(signal.SIGKILL)
            await asyncio.wait(pending)

    async def _pump(self, stream: asyncio.StreamReader, rank: int, out: object) -> None:
        """Forward a rank's output line by line (whole lines: ranks never mix mid-line),
        prefixed ``[rank] `` with ``--tag-output``."""
        prefix = f"[{rank}] ".encode() if self.tag_output else b""
        buf = out.buffer  # type: ignore[attr-defined]
        while True:
            try:
                line = await stream.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:  # the end: a last unterminated line
                if not exc.partial:
                    return
                line = exc.partial + b"\n"
            except asyncio.LimitOverrunError as exc:  # a line longer than the buffer: a
                line = await stream.readexactly(exc.consumed)  # piece of it, as it comes
                buf.write(line)
                buf.flush()
                continue
            buf.write(prefix + line)
            buf.flush()

    async def _watch(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        self.returncodes[rank] = rc
        if self.elastic:
            while rc != 0 and not self.stopping:
                how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
                if self.restarts[rank] >= self.max_restarts:
                    self._say(f"rank {rank} failed ({how}); the others go on (--elastic)")
                    return
                self.restarts[rank] += 1
                self._say(f"rank {rank} failed ({how}); restarting it (restart "
                          f"{self.restarts[rank]} of {self.max_restarts})")
                proc = await self.spawn(rank, self.restarts[rank])
                if proc is None:
                    return
                rc = self.returncodes[rank] = await proc.wait()
            return
        if rc != 0 and self.code is None and not self.stopping:
            self.code = _exit_code(rc)
            how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            self._say(f"rank {rank} failed ({how}); stopping the other ranks")
            await self.stop()

    async def run(self) -> int:
        token = secrets.token_hex(16)
        server = await StoreServer(token, "127.0.0.1", 0).start()
        loop = asyncio.get_running_loop()
        jobdir = _make_job_dir(self.cmd, self.nprocs)
        try:
            base = dict(os.environ)
            if jobdir is not None:
                base["UCXCOMM_JOB_DIR"] = jobdir
            else:
                base.pop("UCXCOMM_JOB_DIR", None)
            base.setdefault("PYTHONFAULTHANDLER", "1")
            base.update(UCXCOMM_SIZE=str(self.nprocs), UCXCOMM_STORE=f"127.0.0.1:{server.port}",
                        UCXCOMM_TOKEN=token, UCXCOMM_LOCAL_SIZE=str(self.nprocs))
            # torchrun's variables too, so that torch.distributed's default env://
            # rendezvous works unchanged (ucxcomm itself reads UCXCOMM_* first). torch's
            # store (on rank 0) gets a port free now, outside the ephemeral range.
            base.update(WORLD_SIZE=str(self.nprocs), LOCAL_WORLD_SIZE=str(self.nprocs),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            # (Only this job's binding counts: a job started inside a bound rank must
            # not inherit that rank's count.)
            base.pop("UCXCOMM_RANKS_PER_CORE", None)
            # Output always goes through the launcher, a whole line at a time; ranks
            # write unbuffered so that it comes as it is printed.
            pipe = asyncio.subprocess.PIPE
            base.setdefault("PYTHONUNBUFFERED", "1")

            def on_signal(sig: int) -> None:
                if self.code is None:
                    self.code = 128 + sig
                self._say(f"got signal {sig}; forwarding to all ranks")
                if self.stopping:  # (a stop is under way: forward this one as it comes)
                    self.signal_all(sig)
                    return
                # One signal per rank: stop() sends it. Sending it here as well made every
                # SIGINT a double Ctrl-C, and asyncio.run turns the second one into a
                # KeyboardInterrupt raised wherever the rank happens to be (issue 15,
                # defect 3: tracebacks from the progress task at teardown).
                self.pumps.append(loop.create_task(self.stop(sig)))

            # Installed before the ranks start: a caught signal is reset to its default
            # in a child that execs, an ignored one stays ignored. A launcher started in
            # the background of a script has SIGINT ignored; its ranks inherited that and
            # ignored the SIGINT it forwards (every Ctrl-C waited for the 5 s SIGKILL).
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal, sig)
            async def spawn(rank: int, restart: int) -> asyncio.subprocess.Process | None:
                env = dict(base, UCXCOMM_RANK=str(rank), UCXCOMM_LOCAL_RANK=str(rank),
                           RANK=str(rank), LOCAL_RANK=str(rank),
                           UCXCOMM_RESTART_COUNT=str(restart))
                saved = None
                if self.cores is not None:
                    core = self.cores[rank]
                    env.update(UCXCOMM_RANKS_PER_CORE=str(self.cores.count(core)))
                    # The child inherits this thread's mask at fork (every thread it
                    # starts later inherits it in turn); restored once it is started.
                    saved = os.sched_getaffinity(0)
                    os.sched_setaffinity(0, (core,))
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *self.cmd, env=env, stdout=pipe, stderr=pipe, stdin=None,
                        start_new_session=True, limit=1 << 20)
                except OSError as exc:
                    self._say(f"cannot start {self.cmd[0]!r}: {exc}")
                    self.code = 127
                    await self.stop()
                    return None
                finally:
                    if saved is not None:
                        os.sched_setaffinity(0, saved)
                if rank < len(self.procs):
                    self.procs[rank] = proc
                else:
                    self.procs.append(proc)
                assert proc.stdout is not None and proc.stderr is not None
                self.pumps.append(asyncio.ensure_future(
                    self._pump(proc.stdout, rank, sys.stdout)))
                self.pumps.append(asyncio.ensure_future(
                    self._pump(proc.stderr, rank, sys.stderr)))
                return proc

            self.spawn = spawn
            for rank in range(self.nprocs):
                if await spawn(rank, 0) is None:
                    return 127

            watchers = [asyncio.ensure_future(self._watch(r, p))
                        for r, p in enumerate(self.procs)]
            done, _ = await asyncio.wait(watchers, timeout=self.timeout)
            if len(done) < len(watchers):
                self._say(f"timed out after {self.timeout:g} s; the ranks' flight "
                          "recorders, then their stacks, then stopping all ranks")
                if jobdir is not None:
                    self._say("status:\n" + trace.report(trace.load_job(jobdir)))
                if self.code is None:
                    self.code = 124
                # Ranks that joined the world log their asyncio tasks on SIGUSR1; then
                # PYTHONFAULTHANDLER=1 makes Python ranks print every thread's stack on
                # SIGABRT. With --tag-output each line carries the rank.
                joined = server.joined
                for rank in joined:
                    proc = self.procs[rank]
                    if proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(signal.SIGUSR1)
                if joined:
                    await asyncio.wait([asyncio.ensure_future(p.wait()) for p in self.procs],
                                       timeout=1.0)
                await self.stop(signal.SIGABRT)
                await asyncio.wait(watchers)
            if self.pumps:
                await asyncio.wait(self.pumps, timeout=KILL_GRACE_S)
            if self.elastic and self.code is None:
                return self._survivors_code()
            return self.code or 0
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)
            if any(p.returncode is None for p in self.procs):
                self.stopping = False
                await self.stop(signal.SIGKILL)
            await server.close()
            if jobdir is not None:  # (and its torch groups': see trace.job_dir)
                for path in [jobdir, *glob.glob(glob.escape(jobdir) + "-*")]:
                    shutil.rmtree(path, ignore_errors=True)


    def _survivors_code(self) -> int:
        """The exit code of an elastic job (module doc)."""
        codes = [self.returncodes[r] for r in sorted(self.returncodes)]
        exited = [rc for rc in codes if rc >= 0]
        if exited:
            return next((rc for rc in exited if rc != 0), 0)
        return _exit_code(codes[0]) if codes else 0


def _make_job_dir(cmd: Sequence[str], nprocs: int) -> str | None:
    """A fresh directory for the job's flight recorders (``comm/trace.py``), with a
    ``job.json`` naming this launcher; None where none can be made."""
    try:
        path = tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=trace.root_dir(create=True))
        with open(os.path.join(path, "job.json"), "w") as f:
            json.dump(dict(pid=os.getpid(), nprocs=nprocs, argv=list(cmd),
                           started=time.time()), f)
        return path
    except OSError:
        return None


def run_job(nprocs: int, argv: Sequence[str], *, tag_output: bool = False,
            timeout: float | None = None, bind: str = "none", elastic: bool = False,
            max_restarts: int = 0) -> int:
    """Run ``argv`` as ``nprocs`` ranks on this machine; returns the job's exit code.
    ``bind``: ``"none"`` (the default) or ``"core"`` (one core per rank, see the module
    doc). ``elastic``: a rank's failure does not end the job; ``max_restarts``: with
    ``elastic``, how many times a failed rank is started again (module doc)."""
    if max_restarts < 0 or (max_restarts and not elastic):
        raise ValueError("max_restarts must be >= 0, and needs elastic")
    if nprocs < 1:
        raise ValueError(f"-n must be >= 1, got {nprocs}")
    if not argv:
        raise ValueError("no program to run")
    if bind not in BIND_CHOICES:
        raise ValueError(f"bind must be one of {BIND_CHOICES}, got {bind!r}")
    return asyncio.run(_Job(nprocs, argv, tag_output, timeout, bind, elastic,
                            max_restarts).run())
