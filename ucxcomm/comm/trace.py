"""The flight recorder: every process's last operations, readable from outside.

Each process that joins a world keeps a ring of fixed-size records (:data:`RECORD`, 64
bytes each; :data:`HEADER` first) in a file of the job's directory in shared memory
(:func:`job_dir`). The communicator's compiled paths (``comm/_fast.pyx``'s
``Recorder``) write an operation that finished within its call as one record, and one
that has to wait as a record in state ``posted`` or ``waiting`` that is updated when it
ends; a slot whose operation is still in flight is never reused for a newer one (the
ring skips it), so what a hung rank waits for stays visible however much else it did.

Nothing in the rank has to answer for the records to be read: ``ucxcomm status`` maps
the files of every rank of a job on this host and reads them while the ranks spin in
compiled code, block, or hang (:func:`read`, :func:`diagnose`). ``comm.trace()`` reads
this process's own. A record is published by writing its number last (release order),
and a reader keeps only records that read the same twice.

The files live in ``/dev/shm/ucxcomm-<uid>/<job>/rank<N>.trace`` (mode 0700 directory):
``<job>`` is the directory ``ucxcomm run`` made for the job (``UCXCOMM_JOB_DIR``) or,
under other launchers, a name derived from the job's bootstrap address, so every rank
of a job on one host lands in the same directory. A process removes its file when its
world closes; ``ucxcomm run`` removes the job's directory when the job ends.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import mmap
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings
from ..tags import ANY_SOURCE, ANY_TAG

__all__ = ["HEADER", "KINDS", "RECORD", "STATES", "Op", "diagnose", "find_jobs",
           "job_dir", "note_failure", "open_file", "read", "report"]

MAGIC = b"UCXTRACE"
VERSION = 1

#: The file's first 64 bytes.
HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("nslots", "<u4"), ("pid", "<u4"),
                   ("rank", "<i4"), ("size", "<i4"), ("_pad", "<u4"), ("next", "<u8"),
                   ("lost", "<u8"), ("t_open", "<i8"), ("_pad2", "V8")])
#: One operation (64 bytes; ``comm/_fast.pyx`` declares the same C struct). ``n``: the
#: record's number (0: empty); ``t0``/``t1``: start and end, ns since the epoch (``t1``
#: 0 while in flight); ``cid``/``crank``/``csize``: the communicator's context id, this
#: process's rank in it and its size; ``seq``: a collective's sequence number (-1 for
#: point-to-point); ``peer``/``wpeer``: destination, source or root as a rank of the
#: communicator and of the world (-1 any source, -2 none); ``tag``: -1 any, -2 none.
RECORD = np.dtype([("n", "<u8"), ("t0", "<i8"), ("t1", "<i8"), ("nbytes", "<u8"),
                   ("cid", "<u4"), ("seq", "<i4"), ("tag", "<i4"), ("peer", "<i4"),
                   ("wpeer", "<i4"), ("crank", "<i4"), ("csize", "<i4"), ("kind", "<u2"),
                   ("state", "u1"), ("flags", "u1")])
assert HEADER.itemsize == 64 and RECORD.itemsize == 64

#: Record states (``posted``: in flight, nobody waits on it yet; ``waiting``: a
#: blocking call waits on it).
STATES = ("empty", "posted", "waiting", "done", "failed", "cancelled")
POSTED, WAITING, DONE, FAILED, CANCELLED = 1, 2, 3, 4, 5
NONE = -2

#: Operation kinds: a record's ``kind`` is an index in this tuple (append only: the
#: file format depends on the order).
KINDS = ("?", "Send", "Recv", "Isend", "Irecv", "send", "recv", "Sendrecv", "sendrecv",
         "barrier", "Bcast", "Reduce", "Allreduce", "Gather", "Gatherv", "Scatter",
         "Scatterv", "Allgather", "Allgatherv", "Alltoall", "Alltoallv",
         "Reduce_scatter_block", "Reduce_scatter", "Scan", "Exscan", "bcast", "reduce",
         "allreduce", "gather", "allgather", "scatter", "alltoall", "scan", "exscan",
         "Win.Fence", "Win.Flush", "Win.Lock", "Win.Unlock", "Win.Start", "Win.Complete",
         "Win.Post", "Win.Wait", "Win.Lock_all", "Win.Unlock_all", "Win.Flush_all",
         "isend", "irecv", "Probe", "Mprobe")
KIND = {name: i for i, name in enumerate(KINDS)}
_P2P_KINDS = frozenset(KIND[k] for k in ("Send", "Recv", "Isend", "Irecv", "send", "recv",
                                         "Sendrecv", "sendrecv", "isend", "irecv",
                                         "Probe", "Mprobe"))
_SENDS = frozenset(KIND[k] for k in ("Send", "Isend", "send", "isend"))
_RECVS = frozenset(KIND[k] for k in ("Recv", "Irecv", "recv", "irecv", "Probe", "Mprobe"))
ROOTED = frozenset(KIND[k] for k in ("Bcast", "Reduce", "Gather", "Gatherv", "Scatter",
                                      "Scatterv", "bcast", "reduce", "gather", "scatter"))


def depth() -> int:
    """Records per process (``UCXCOMM_TRACE_DEPTH``)."""
    return int(settings.get("UCXCOMM_TRACE_DEPTH"))


def _root() -> str:
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"ucxcomm-{os.getuid()}")


def job_dir(create: bool = False, part: str = "") -> str:
    """This process's job directory: ``UCXCOMM_JOB_DIR`` (set by ``ucxcomm run``), else
    one named after the job's bootstrap address (``UCXCOMM_STORE``, or torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``), else after the parent process; ``part`` names a
    world of its own within the job (a torch process group's: a sibling directory
    ``<job>-<part>``)."""
    given = settings.get("UCXCOMM_JOB_DIR")
    if given:
        path = given
    else:
        store = settings.get("UCXCOMM_STORE") or (
            f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
            if os.environ.get("MASTER_PORT") else "")
        key = ("store-" + re.sub(r"[^A-Za-z0-9.]+", "_", store) if store
               else f"ppid-{os.getppid()}")
        path = os.path.join(_root(), key)
    if part:
        path += "-" + re.sub(r"[^A-Za-z0-9.]+", "_", part)
    if create:
        root_dir(create=True)
        os.makedirs(path, mode=0o700, exist_ok=True)
        _check_private(path)
    return path


def root_dir(create: bool = False) -> str:
    """This user's directory of job directories (made private when ``create``)."""
    root = os.path.dirname(job_dir())
    if create:
        os.makedirs(root, mode=0o700, exist_ok=True)
        _check_private(root)
    return root


def _check_private(path: str) -> None:
    """Refuse (OSError) a directory another user could have made or can write: the
    recorder files are created in it (shared memory is world-writable)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a private directory of this user")


#: A job directory whose processes are all gone is removed (by the next process that
#: makes one) once nothing in it changed for this long: until then ``ucxcomm status
#: --all`` shows what a dead job's ranks were doing.
STALE_S = 24 * 3600.0


def prune(now: float | None = None) -> None:
    """Remove this user's job directories whose processes are all gone and which have
    not changed for :data:`STALE_S` seconds."""
    now = time.time() if now is None else now
    root = _root()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            try:
                newest = max([os.stat(path).st_mtime] + [
                    os.stat(os.path.join(path, f)).st_mtime for f in os.listdir(path)])
            except OSError:
                continue
            if now - newest > STALE_S and not load_job(path).alive:
                shutil.rmtree(path, ignore_errors=True)


def open_file(rank: int, nslots: int, part: str = "") -> tuple[Any, str | None]:
    """``(memory, path)`` for a recorder of ``nslots`` records: a shared mapping of the
    job directory's ``rank<N>.trace`` (``part``: see :func:`job_dir`), or (no writable
    directory) private memory and None."""
    size = HEADER.itemsize + nslots * RECORD.itemsize
    try:
        path = os.path.join(job_dir(create=True, part=part), f"rank{rank}.trace")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            mem: Any = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return mem, path
    except OSError:
        return bytearray(size), None


def open_recorder(rank: int, size: int, part: str = "") -> Any:
    """This process's recorder (``comm/_fast.pyx``'s ``Recorder``) for world rank
    ``rank`` of ``size``, in the job directory's file where one can be made (rank 0
    first removes stale directories of ended jobs: :func:`prune`)."""
    from . import _fast

    if rank == 0:
        prune()
    n = depth()
    if n == 0:  # (off)
        return _fast.Recorder(bytearray(HEADER.itemsize), None, 0, rank, size, os.getpid())
    mem, path = open_file(rank, n, part)
    rec = _fast.Recorder(mem, path, n, rank, size, os.getpid())
    if path is not None:
        if not _open:
            atexit.register(_at_exit)
        _open.add(rec)
    return rec


_open: set[Any] = set()


def _at_exit() -> None:
    """A process that ends without closing its world (torch's, for one) removes its
    records too, unless it ends with an operation in flight or failed: those stay for
    ``ucxcomm status --all`` (as a killed process's do)."""
    for rec in list(_open):
        with contextlib.suppress(Exception):
            data = rec.snapshot()
            if data and not any(o.state in ("posted", "waiting", "failed")
                                for o in parse(data)[1]):
                close_recorder(rec)


def close_recorder(rec: Any) -> None:
    """Stop ``rec`` and remove its file (its last records stay readable in-process)."""
    _open.discard(rec)
    rec.close()
    if rec.path is not None:
        with contextlib.suppress(OSError):
            os.unlink(rec.path)
        with contextlib.suppress(OSError):  # (the last one out; ucxcomm run's job
            os.rmdir(os.path.dirname(rec.path))  # directory holds job.json: its own)
    if isinstance(rec.mem, mmap.mmap):
        with contextlib.suppress(BufferError, ValueError):
            rec.mem.close()


def note_failure(rec: Any, exc: BaseException) -> None:
    """Give a :class:`~ucxcomm.PeerFailure` the operations it interrupted, once
    (``exc.operations``: ``rec``'s records in flight or failed on its peer, and its
    collectives in flight or failed)."""
    from ..errors import PeerFailure

    if not isinstance(exc, PeerFailure) or exc.operations:
        return
    data = rec.snapshot()
    if not data:  # (the recorder is off)
        return
    dead = exc.peer
    exc.operations = tuple(
        o for o in parse(data)[1]
        if o.state in ("posted", "waiting", "failed")
        and (dead is None or o.seq is not None or o.world_peer in (dead, ANY_SOURCE)))


def ended(rec: Any, token: int, exc: BaseException) -> None:
    """The operation of record ``token`` of ``rec`` raised ``exc``: cancelled, or failed
    (a PeerFailure gets :func:`note_failure`)."""
    if isinstance(exc, asyncio.CancelledError):
        rec.end(token, CANCELLED)
    else:
        rec.end(token, FAILED)
        note_failure(rec, exc)


@contextlib.contextmanager
def recorded(rec: Any, token: int) -> Iterator[None]:
    """End the record ``token`` of ``rec`` as the block ends (done, or :func:`ended`)."""
    try:
        yield
    except BaseException as exc:
        ended(rec, token, exc)
        raise
    rec.end(token)


async def follow(rec: Any, token: int, aw: Any) -> Any:
    """Await ``aw`` with the record ``token`` of ``rec`` ended as it ends (no context
    manager: this is on the path of every call that waits)."""
    try:
        out = await aw
    except BaseException as exc:
        ended(rec, token, exc)
        raise
    rec.end(token)
    return out


# ------------------------------------------------------------------ reading
@dataclass(frozen=True)
class Op:
    """One recorded operation (what ``comm.trace()`` returns, oldest first)."""

    kind: str
    state: str
    #: Rank of this process in the operation's communicator, the communicator's size
    #: and context id (0: the world).
    rank: int
    size: int
    cid: int
    #: Destination, source or root (a rank of the communicator; -1: any source; None:
    #: none) and the same as a world rank.
    peer: int | None
    world_peer: int | None
    #: Point-to-point tag (-1: any), None for collectives.
    tag: int | None
    #: Collective sequence number on the communicator, None for point-to-point.
    seq: int | None
    nbytes: int
    #: Start and end (seconds since the epoch; end None while in flight).
    start: float
    end: float | None
    number: int

    @property
    def in_flight(self) -> bool:
        return self.state in ("posted", "waiting")

    def waited(self, now: float | None = None) -> float:
        """Seconds from start to end (or to ``now`` while in flight)."""
        end = self.end if self.end is not None else (time.time() if now is None else now)
        return max(0.0, end - self.start)

    def call(self) -> str:
        """The call as a user wrote it: ``Recv(source=2, tag=7)``, ``barrier #41``."""
        args = []
        k = KIND.get(self.kind, 0)
        if k in _P2P_KINDS:
            if self.peer is not None:
                name = "dest" if k in _SENDS else "source"
                args.append(f"{name}={'ANY_SOURCE' if self.peer == ANY_SOURCE else self.peer}")
            if self.tag is not None:
                args.append(f"tag={'ANY_TAG' if self.tag == ANY_TAG else self.tag}")
        elif k in ROOTED and self.peer is not None:
            args.append(f"root={self.peer}")
        elif self.kind.startswith("Win.") and self.peer is not None:
            args.append(f"rank={self.peer}")
        if self.nbytes:
            args.append(f"{self.nbytes} B")
        text = f"{self.kind}({', '.join(args)})" if args or k in _P2P_KINDS else self.kind
        if self.seq is not None:
            text += f" #{self.seq}"
        if self.cid:
            text += f" on comm {self.cid}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, call=self.call())


def _ops(records: np.ndarray) -> list[Op]:
    out = []
    for r in records[np.argsort(records["n"], kind="stable")]:
        if r["n"] == 0:
            continue
        kind = int(r["kind"])
        state = int(r["state"])
        peer, wpeer, tag, seq = (int(r["peer"]), int(r["wpeer"]), int(r["tag"]),
                                 int(r["seq"]))
        out.append(Op(
            kind=KINDS[kind] if kind < len(KINDS) else "?",
            state=STATES[state] if state < len(STATES) else "?",
            rank=int(r["crank"]), size=int(r["csize"]), cid=int(r["cid"]),
            peer=None if peer == NONE else peer, world_peer=None if wpeer == NONE else wpeer,
            tag=None if tag == NONE else tag, seq=None if seq < 0 else seq,
            nbytes=int(r["nbytes"]), start=int(r["t0"]) / 1e9,
            end=int(r["t1"]) / 1e9 if r["t1"] else None, number=int(r["n"])))
    return out


def parse(data: bytes, again: bytes | None = None) -> tuple[dict[str, Any], list[Op]]:
    """The header (a dict) and the operations of a recorder's bytes; with ``again`` (a
    second copy, read after), only records that read the same in both. Raises
    ValueError for what is not a recorder of this version."""
    if len(data) < HEADER.itemsize:
        raise ValueError("too short for a trace header")
    hdr = np.frombuffer(data, HEADER, 1)[0]
    if hdr["magic"] != MAGIC or int(hdr["version"]) != VERSION:
        raise ValueError("not a ucxcomm trace of this version")
    nslots = int(hdr["nslots"])
    if len(data) < HEADER.itemsize + nslots * RECORD.itemsize:
        raise ValueError(f"truncated: {nslots} records announced")
    recs = np.frombuffer(data, RECORD, nslots, HEADER.itemsize)
    if again is not None and len(again) == len(data):
        same = np.frombuffer(again, RECORD, nslots, HEADER.itemsize) == recs
        recs = recs[same]
    head = dict(pid=int(hdr["pid"]), rank=int(hdr["rank"]), size=int(hdr["size"]),
                nslots=nslots, recorded=int(hdr["next"]), lost=int(hdr["lost"]),
                opened=int(hdr["t_open"]) / 1e9)
    return head, _ops(recs)


def read(path: str) -> tuple[dict[str, Any], list[Op]]:
    """The header and operations of the recorder file ``path`` (read twice, torn
    records left out). Raises OSError or ValueError."""
    with open(path, "rb") as f:
        first = f.read(1 << 26)
        f.seek(0)
        second = f.read(1 << 26)
    return parse(first, second)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Rank:
    """What ``ucxcomm status`` read of one rank."""

    rank: int
    size: int
    pid: int
    alive: bool
    ops: list[Op]
    lost: int
    path: str

    @property
    def in_flight(self) -> list[Op]:
        return [o for o in self.ops if o.in_flight]

    @property
    def completed(self) -> list[Op]:
        return [o for o in self.ops if not o.in_flight]


@dataclass
class Job:
    """A job's directory and its ranks' recorders."""

    path: str
    meta: dict[str, Any]
    ranks: list[Rank]

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.ranks) or _alive(int(self.meta.get("pid", 0) or 0))


def load_job(path: str) -> Job:
    meta: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(path, "job.json")) as f:
            got = json.load(f)
        if isinstance(got, dict):
            meta = got
    ranks = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
    for name in names:
        m = re.fullmatch(r"rank(\d+)\.trace", name)
        if not m:
            continue
        file = os.path.join(path, name)
        try:
            head, ops = read(file)
        except (OSError, ValueError):
            continue
        ranks.append(Rank(head["rank"], head["size"], head["pid"], _alive(head["pid"]),
                          ops, head["lost"], file))
    ranks.sort(key=lambda r: r.rank)
    return Job(path, meta, ranks)


def find_jobs(include_ended: bool = False) -> list[Job]:
    """The jobs of this user on this host whose ranks keep recorders (those with a live
    process unless ``include_ended``), newest first."""
    root = _root()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    jobs = []
    for name in names:
        job = load_job(os.path.join(root, name))
        if job.ranks and (include_ended or job.alive):
            jobs.append(job)
    jobs.sort(key=lambda j: -max((o.start for r in j.ranks for o in r.ops), default=0.0))
    return jobs


# ------------------------------------------------------------------ diagnosis
def _on_same_comm(a: Op, b: Op) -> bool:
    return a.cid == b.cid and a.size == b.size


def diagnose(ranks: Sequence[Rank], now: float | None = None) -> list[str]:
    """One line per waiting rank: what it waits in, for how long, and why, as far as
    the other ranks' records tell (which rank has not entered the collective, or never
    sent the message)."""
    now = time.time() if now is None else now
    by_rank = {r.rank: r for r in ranks}
    lines = []
    for r in ranks:
        if not r.alive:
            lines.append(f"rank {r.rank} is gone (process {r.pid} ended)")
            continue
        waits = r.in_flight
        if not waits:
            last = r.completed[-1] if r.completed else None
            lines.append(f"rank {r.rank} is in none of ucxcomm's calls" + (
                f" (its last: {last.call()}, ended {now - (last.end or last.start):.1f} s "
                "ago)" if last else " (no operation recorded)"))
            continue
        op = min(waits, key=lambda o: o.start)
        text = f"rank {r.rank} waits in {op.call()} for {op.waited(now):.1f} s"
        why = _why(r, op, by_rank, now)
        lines.append(text + (f": {why}" if why else ""))
    return lines


def _doing(r: Rank) -> str:
    if not r.alive:
        return "it is gone"
    w = r.in_flight
    if w:
        return f"it waits in {min(w, key=lambda o: o.start).call()}"
    return "it is in none of ucxcomm's calls"


def _why(r: Rank, op: Op, by_rank: dict[int, Rank], now: float) -> str:
    k = KIND.get(op.kind, 0)
    if op.seq is not None:  # a collective: who has not entered this one?
        behind = []
        others = []
        for q in by_rank.values():
            if q is r:
                continue
            member = op.cid == 0 or any(_on_same_comm(o, op) for o in q.ops)
            if not member:
                continue  # (not a member, or nothing recorded)
            mine = [o for o in q.ops if o.seq is not None and _on_same_comm(o, op)]
            if not mine:  # (none recorded: never called, or all overwritten since)
                behind.append(f"rank {q.rank} has not entered it ({_doing(q)})")
                continue
            if any(o.seq == op.seq for o in mine):
                same = [o for o in mine if o.seq == op.seq]
                if any(o.kind != op.kind for o in same):
                    other = same[0]
                    others.append(f"rank {q.rank} called {other.call()} there")
                continue
            if max(o.seq or 0 for o in mine) < op.seq:
                behind.append(f"rank {q.rank} has not entered it ({_doing(q)})")
        return "; ".join(others + behind)
    peer = by_rank.get(op.world_peer) if op.world_peer is not None else None
    if peer is None:
        return ""
    if k in _RECVS:
        sends = [o for o in peer.ops if KIND.get(o.kind, 0) in _SENDS and _on_same_comm(o, op)
                 and o.peer == op.rank and (op.tag is None or op.tag == ANY_TAG
                                            or o.tag == op.tag)]
        if not sends:
            return f"rank {peer.rank} never sent it ({_doing(peer)})"
        return ""
    if k in _SENDS:
        recvs = [o for o in peer.in_flight if KIND.get(o.kind, 0) in _RECVS
                 and _on_same_comm(o, op) and o.peer in (op.rank, ANY_SOURCE)]
        if not recvs:
            return f"rank {peer.rank} has no receive posted for it ({_doing(peer)})"
    return ""


def report(job: Job, now: float | None = None, last: int = 5) -> str:
    """The text ``ucxcomm status`` prints for ``job``."""
    now = time.time() if now is None else now
    lines = [f"job {os.path.basename(job.path)}"
             + (f" (ucxcomm run pid {job.meta['pid']}: {' '.join(job.meta.get('argv', []))})"
                if job.meta.get("pid") else "")
             + f": {len(job.ranks)} rank(s) recorded"]
    lines.append("diagnosis:")
    lines += ["  " + d for d in diagnose(job.ranks, now)]
    for r in job.ranks:
        lines.append(f"rank {r.rank}/{r.size} (pid {r.pid}{'' if r.alive else ', gone'}):")
        for o in r.in_flight:
            lines.append(f"  {o.state:<9} {o.call()}  for {o.waited(now):.3f} s")
        for o in r.completed[-last:]:
            took = ("within its call" if o.end == o.start
                    else f"took {o.waited(now) * 1e6:.0f} us")
            lines.append(f"  {o.state:<9} {o.call()}  {took}, "
                         f"ended {now - (o.end or o.start):.1f} s ago")
        if r.lost:
            lines.append(f"  ({r.lost} in-flight record(s) overwritten: more in flight "
                         "than the recorder's depth)")
    return "\n".join(lines)


def as_json(jobs: Iterable[Job], now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    return [dict(job=os.path.basename(j.path), path=j.path, meta=j.meta,
                 diagnosis=diagnose(j.ranks, now),
                 ranks=[dict(rank=r.rank, size=r.size, pid=r.pid, alive=r.alive, lost=r.lost,
                             in_flight=[dict(o.as_dict(), waited=o.waited(now))
                                        for o in r.in_flight],
                             completed=[o.as_dict() for o in r.completed])
                        for r in j.ranks])
            for j in jobs]
