"""Node-level shared-memory collectives: one copy in, one copy out, no rendezvous.

When every rank of a communicator runs on one host (their host identities match: same
kernel boot, network and IPC namespaces), the mid-size collectives of host memory
(``Bcast``, ``Allgather``, ``Alltoall``, ``Allreduce``, ``Reduce_scatter_block`` above
the small paths' ``SMALL_MAX`` bytes per message; ``Gather``, ``Scatter`` and ``Reduce``
at every size; up to ``TUNING["shm_max_<name>"]`` of :mod:`ucxcomm.comm.algorithms`)
take this engine instead of UCX: each rank writes its pieces into a segment of its own
that every member maps, and every member reads (or folds, in rank order) the pieces it
needs straight out of the others' segments, pipelined through a ring of slots
(``comm/_shm.pyx`` describes the protocol). A broadcast is written once and read by
every other rank in parallel; nothing is registered, pinned or handshaken per call.
From ``TUNING["shm_direct_min"]`` bytes a message, the copying collectives take
single-copy mode where every member can (``UCXCOMM_SHM_DIRECT``): readers copy straight
out of the writer's own buffer with ``process_vm_readv``. ``UCXCOMM_SHM=no`` turns it
off (it must be the same on every rank).

**Segments.** Made on a communicator's first call that uses them, as files under
``/dev/shm`` (mode 0600, named after the user, the communicator and the rank) that are
reserved in full (``posix_fallocate``: a full ``/dev/shm`` is a clear error here, never
a ``SIGBUS`` later) and unlinked as soon as every member has mapped them, so a job that
dies leaves nothing behind once its first such call got through. Each is
``DATA_OFFSET + UCXCOMM_SHM_SLOT * UCXCOMM_SHM_SLOTS`` bytes (about 1 MiB by default).

**Checks.** With ``UCXCOMM_CHECK_COLLECTIVES`` on, the call's fingerprint (form ``SHM``
of :mod:`ucxcomm.comm.fingerprint`) travels in the arrival record, so checking costs no
message. A rank whose call took another path (a different size, GPU memory, or a rank
that could not map its segment) sends its first message over the network as usual:
the ranks waiting here find it (a tag probe), answer with their own fingerprint, and
every rank raises :class:`~ucxcomm.CollectiveMismatch` before any byte of a user buffer
is written. A rank that finds the mismatch publishes its verdict in its record, for the
members that cannot see the other path's message. When the only difference was a rank
without the engine, every member stops using it for that communicator.

**One at a time.** A communicator's calls take the engine one after the other on each
rank, in call order: one that arrives while another is in flight here (a non-blocking
collective, or blocking ones from concurrent tasks) waits behind it (see
:meth:`NodeShm.start`). They share the rank's pieces, slots and records.

**Failures.** A waiting call spins for ``UCXCOMM_SPIN_US`` and then polls from the
event loop, where it notices a dead member (``PeerFailure``), a revoked or closed
communicator, and ``timeout=``.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import hashlib
import logging
import mmap
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import settings
from ..errors import CollectiveMismatch, PeerFailure, TruncationError
from ..tags import FULL_MASK, KIND_COLL, TAG_BITS, TAG_UB, make_tag
from . import fingerprint, trace
from .algorithms import TUNING, Chan
from .small import DONE, SMALL_MAX

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from .group import Group

__all__ = ["KINDS", "MAX_RANKS", "SHM_DIR", "NodeShm"]

log = logging.getLogger(__name__)

#: Where the segments live.
SHM_DIR = "/dev/shm"
#: Largest communicator the engine serves (every rank reads every other's segment).
MAX_RANKS = 16
#: The collectives it serves.
KINDS = ("Bcast", "Allgather", "Alltoall", "Allreduce", "Reduce_scatter_block", "Gather",
         "Scatter", "Reduce")
#: The collectives with a small path of their own (comm/small.py, _fast.pyx): the engine
#: takes them above its ``SMALL_MAX`` bytes a message; the others at every size.
_SMALL_TOO = frozenset(("Gather", "Scatter", "Reduce"))

# A slow call first polls the engine on every event-loop turn, then, once it has moved
# no piece for this long, every POLL_SLEEP_S (a peer that is seconds late costs no core).
_BUSY_S = 0.005
_POLL_SLEEP_S = 0.0005


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # (a send to a member that died meanwhile: nobody waits on it)


def _unlink(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


class _Turn:
    """An engine call of one communicator that is in flight or waits for its turn (see
    :meth:`NodeShm.start`): ``fut`` (a call that waits) gets its result when the turn
    comes; ``ref`` names the call's coroutine weakly (one dropped before it ever ran,
    a task cancelled before it started, gives its turn up)."""

    __slots__ = ("fut", "ref")

    def __init__(self, fut: asyncio.Future | None = None) -> None:
        self.fut = fut
        self.ref: Any = None


class NodeShm:
    """The shared-memory collectives of one communicator (see the module docstring).
    :meth:`usable` says whether the engine serves it at all."""

    def __init__(self, group: Group) -> None:
        self._group = group
        self._transport = group.transport
        self.size, self.rank = group.size, group.rank
        self.slot = int(settings.get("UCXCOMM_SHM_SLOT"))
        self.nslots = int(settings.get("UCXCOMM_SHM_SLOTS"))
        world = group.world
        digest = hashlib.sha256(
            b"%d|" % group.cid + b"|".join(world.addresses[m] + b"#%d" % group.lives[i]
                                           for i, m in enumerate(group.members))).hexdigest()[:24]
        self._paths = [f"{SHM_DIR}/ucxcomm-{os.getuid()}-{digest}-{k}" for k in range(self.size)]
        self._node: Any = None
        self._Call: Any = None
        self._mapped = False  # every member's segment is mapped here
        self._direct = bool(settings.get("UCXCOMM_SHM_DIRECT"))
        self._push = bool(settings.get("UCXCOMM_SHM_PUSH"))
        self._maps: list[mmap.mmap | None] = [None] * self.size
        self._own_path: str | None = None  # still linked
        self._finalizer: Any = None
        #: The ``TUNING`` key of each collective's largest message here.
        self.limits = {k: f"shm_max_{k}" for k in KINDS}
        #: Bytes a message must exceed to come here, by collective.
        self.mins = {k: 0 if k in _SMALL_TOO else SMALL_MAX for k in KINDS}
        #: This rank's fingerprints of recent calls, by their arguments.
        self.fps: dict[tuple[Any, ...], bytes] = {}
        #: The compiled fold of each recent ``(op, dtype)`` (``_fast.native_kernel``'s
        #: number; 0: the numpy ufunc), looked up once.
        self.kernels: dict[tuple[Any, Any], int] = {}
        #: Why the engine is off for this communicator (None: on).
        self.off: str | None = None
        spin_s, spin_yield = self._transport.spin_policy()
        self._budget_ns = int(spin_s * 1e9)
        self._yield = spin_yield
        #: Ranks outnumber cores here (spinners yield: ``UCXCOMM_SPIN_YIELD``).
        self.crowded = spin_yield
        # The engine call in flight here (None: none) and the calls waiting behind it,
        # in call order (see start()).
        self._busy: _Turn | None = None
        self._line: collections.deque[_Turn] = collections.deque()

    @staticmethod
    def usable(group: Group) -> bool:
        """Whether the engine may serve ``group``: 2 to ``MAX_RANKS`` ranks, all known
        to share this host, and ``UCXCOMM_SHM`` on (the same answer on every member)."""
        hosts = group.world.hosts
        if not 2 <= group.size <= MAX_RANKS or hosts is None or not settings.get("UCXCOMM_SHM"):
            return False
        mine = hosts[group.world.rank]
        return bool(mine) and all(m < len(hosts) and hosts[m] == mine for m in group.members)

    # ------------------------------------------------------------------ segments
    def _setup(self) -> bool:
        """Create this rank's segment (once); False (and :attr:`off` says why) when it
        cannot be made."""
        if self._node is not None:
            return True
        if self.off is not None:
            return False
        from . import _shm

        total = _shm.DATA_OFFSET + self.slot * self.nslots
        path = self._paths[self.rank]
        fd = -1
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:  # (a dead process of this very communicator's: stale)
                _unlink(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self._own_path = path
            self._finalizer = weakref.finalize(self, _unlink, path)
            os.posix_fallocate(fd, 0, total)
            mem = mmap.mmap(fd, total)
        except OSError as exc:
            if fd >= 0:
                _unlink(path)
            self._forget_own()
            self.off = (f"rank {self.rank} could not make its shared-memory segment "
                        f"{path} ({os.strerror(exc.errno or errno.EIO)}): this "
                        "communicator's collectives take the network path")
            log.warning("%s", self.off)
            return False
        finally:
            if fd >= 0:
                os.close(fd)
        self._maps[self.rank] = mem
        self._Call = _shm.Call
        self._node = _shm.Node(self.rank, self.size, self.slot, self.nslots, mem)
        self._node.spin_yield = self._yield
        self._attach()
        return True

    def _forget_own(self) -> None:
        self._own_path = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def _attach(self) -> bool:
        """Map the peers' segments that exist; True once every one is mapped."""
        node = self._node
        done = True
        for k in range(self.size):
            if node.attached(k):
                continue
            try:
                fd = os.open(self._paths[k], os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                done = False
                continue
            try:
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or st.st_size < node.total():
                    done = False  # (not finished by its creator yet, or not ours)
                    continue
                mem = mmap.mmap(fd, node.total())
            finally:
                os.close(fd)
            if node.attach(k, mem):
                self._maps[k] = mem
            else:
                mem.close()
                done = False
        self._mapped = done
        if done:
            if self._direct:
                node.probe_direct()
            else:
                node.refuse_direct()
            if self._own_path is not None:
                self._unlink_own()
        return done

    def close(self) -> None:
        """Unmap everything (the communicator is gone)."""
        if self._finalizer is not None:
            self._finalizer()
            self._forget_own()
        if self._node is not None:
            self._node.release()
            self._node = None
        for i, mem in enumerate(self._maps):
            if mem is not None:
                try:
                    mem.close()
                except BufferError:
                    pass  # (a view is still alive: the garbage collector unmaps it)
                self._maps[i] = None

    # ---------------------------------------------------------------------- calls
    def ready(self) -> bool:
        """Whether the engine takes calls (this rank's segment made on the first);
        False: the network path (call before taking the sequence number)."""
        return self.off is None and (self._node is not None or self._setup())

    def start(self, what: str, seq: int, fp: bytes | None, send: Any, recv: Any, n: int,
              root: int = -1, kernel: int = 0, ufunc: Any = None, direct: bool = False,
              kind: str | None = None) -> Awaitable[None]:
        """Start collective ``what`` (arguments checked, sequence number ``seq`` taken)
        here: DONE when it finished in the call, else an awaitable for the rest, once
        :meth:`ready` was True. ``kind``: the engine's collective (default ``what``:
        the name in the flight record and the errors).

        One call at a time: the engine's calls of a communicator share this rank's
        piece counter, slots and records, and a call acknowledges the ones before it
        as it starts (the rule that frees a slot relies on that). While a call is in
        flight here (a non-blocking collective, or blocking ones from concurrent tasks),
        a new one waits behind it and starts once every call before it finished or
        gave up: in call order, which is sequence-number order on every rank. With none
        in flight nothing is added to the call."""
        g = self._group
        gen = ((g.seq_wraps - (seq == TAG_UB)) << TAG_BITS | seq) + 1
        # (read per call, as TUNING is; each member's own choice: see Call._split)
        self._node.push_min = TUNING["shm_push_min"] if self._push else 0
        if self._busy is not None:
            return self._queue(gen, what, seq, fp,
                               (send, recv, n, root, kernel, ufunc, direct), kind or what)
        call = self._Call(self._node, gen, kind or what, fp, send, recv, n, root, kernel,
                          ufunc, direct)
        if not self._mapped:
            self._attach()
        st = call.advance(self._budget_ns)
        if st == 0:  # (finished here: its flight record, as the compiled paths write)
            rec = g.world.recorder
            rec.end(rec.start(what, trace.WAITING, g.cid, self.rank, self.size, seq,
                              root if root >= 0 else -2,
                              g.members[root] if root >= 0 else -2))
            if self._own_path is not None:
                self._unlink_own()
            return DONE
        return self._after(call, what, seq, fp, st)

    def _after(self, call: Any, what: str, seq: int, fp: bytes | None, st: int
               ) -> Awaitable[None]:
        """The rest of ``call``, which its first advance left at ``st`` (not done): it
        holds the engine until it finishes."""
        if st == 4:
            self._truncated(call, what)
        turn = self._busy = _Turn()
        rest = self._rest(call, what, seq, fp, turn)
        turn.ref = weakref.ref(rest, self._dropped)
        return rest

    def make_entry(self, ufunc_of: Any) -> Any:
        """The compiled entry of this communicator's calls on plain numpy arrays
        (``_shm.Entry``; ``ufunc_of(op, array)``: numpy's kernel of a reduction, None
        for what is not an Op), once :meth:`ready` was True."""
        from . import _fast, _shm

        def make_fp(what: str, op: Any, root: int, dtype: Any, count: int) -> bytes:
            return fingerprint.make(what, fingerprint.SHM, op, root, dtype, count)

        def kernel_of(op: Any, dtype: Any) -> int:
            return int(_fast.native_kernel(op, dtype)[0])

        return _shm.Entry(self, self._node, self._group, self._group.world.recorder, DONE,
                          make_fp, kernel_of, ufunc_of, TUNING, self._budget_ns, self._push,
                          self.crowded, SMALL_MAX, trace.WAITING, TAG_UB, TAG_BITS)

    def _queue(self, gen: int, what: str, seq: int, fp: bytes | None,
               args: tuple[Any, ...], kind: str) -> Awaitable[None]:
        """The call behind the one in flight: its place in the line, taken now (in call
        order), and what runs it when its turn comes."""
        turn = _Turn(asyncio.get_running_loop().create_future())
        coro = self._queued(turn, gen, what, seq, fp, args, kind)
        turn.ref = weakref.ref(coro, self._dropped)
        self._line.append(turn)
        return coro

    async def _queued(self, turn: _Turn, gen: int, what: str, seq: int, fp: bytes | None,
                      args: tuple[Any, ...], kind: str) -> None:
        assert turn.fut is not None
        try:
            try:
                await turn.fut
            except asyncio.CancelledError:  # (given up before it reached the engine)
                self._gave_up(what, seq, fp, [k for k in range(self.size) if k != self.rank])
                raise
            self._check_failed(what)  # (what ended the call before it, if anything)
            call = self._Call(self._node, gen, kind, fp, *args)
            if not self._mapped:
                self._attach()
            st = call.advance(self._budget_ns)
            if st == 0:  # (its flight record: the caller's, as it waited)
                if self._own_path is not None:
                    self._unlink_own()
                return
            if st == 4:
                self._truncated(call, what)
            await self._rest(call, what, seq, fp, None)
        finally:
            self._release(turn)

    def _release(self, turn: _Turn) -> None:
        """``turn``'s call finished or gave up: the next live call in line starts."""
        if self._busy is not turn:
            return  # (it gave up while in line: the turn it waited for is skipped)
        self._busy = None
        line = self._line
        while line:
            nxt = line.popleft()
            assert nxt.fut is not None
            if nxt.fut.done() or nxt.ref() is None:
                continue  # (cancelled in line, or dropped before it ever ran)
            self._busy = nxt
            nxt.fut.set_result(None)
            return

    def _dropped(self, ref: Any) -> None:
        """(A weak reference's callback) a call's coroutine went away: the one in
        flight never ran (its task was cancelled before it started) or finished."""
        turn = self._busy
        if turn is not None and turn.ref is ref:
            try:
                self._release(turn)
            except RuntimeError:  # (the event loop is closed: nothing waits any more)
                pass

    def _unlink_own(self) -> None:
        """Once every member has mapped every segment, unlink every segment's name (the
        last member to map them may be another: any member may unlink them all)."""
        if self._own_path is not None and self._node.everyone_mapped():
            for path in self._paths:
                _unlink(path)
            self._forget_own()

    def _check_failed(self, what: str) -> None:
        g = self._group
        if g.closed:
            g.check_open()
        t, world = self._transport, g.world
        for m in g.members:
            if m != world.rank and t.is_dead(m):
                reason = world.dead_reason.get(m, f"rank {m} is gone")
                raise PeerFailure(f"{what}: {reason}", peer=m)

    async def _rest(self, call: Any, what: str, seq: int, fp: bytes | None,
                    turn: _Turn | None) -> None:
        """Finish ``call`` from the event loop (see :meth:`_wait`), then hand the engine
        to the next call in line (``turn``: the call's own place there, None when its
        caller hands it on)."""
        answered: set[int] = set()
        got: dict[int, bytes] = {}
        try:
            await self._wait(call, what, seq, fp, got, answered)
        except asyncio.CancelledError:
            # Given up (timeout=, cancelled) before the records were in: a member on a
            # network path that waits for this rank's first message gets it (it raises
            # instead of hanging; this communicator is out of step anyway).
            if not call.verified:
                self._gave_up(what, seq, fp, [k for k in call.missing()
                                              if k not in answered and k not in got])
            raise
        finally:
            if turn is not None:
                self._release(turn)

    def _gave_up(self, what: str, seq: int, fp: bytes | None, members: list[int]) -> None:
        """This rank gave up call ``seq`` before every record was in: send ``members``
        its fingerprint (with the checks on), the first message a member on a network
        path waits for."""
        if fp is None or self._group.closed:
            return
        ch = Chan(self._group, seq, what)
        for k in members:
            fut = ch.send(k, self._transport.send_ptr(fp))
            if fut is not None:
                fut.add_done_callback(_retrieve)

    async def _wait(self, call: Any, what: str, seq: int, fp: bytes | None,
                    got: dict[int, bytes], answered: set[int]) -> None:
        from . import _shm

        start = time.monotonic()
        moved = call.progress
        while True:
            self._check_failed(what)
            if not self._mapped:  # (records wait for every segment; with the checks off
                self._attach()    # a writer needs none, but its slots wait for readers)
            if not call.verified and fp is not None:
                await self._probe(call, what, seq, fp, got, answered)
            st = call.advance(0 if not call.verified else self._budget_ns // 4)
            if st == _shm.DONE:
                self._unlink_own()
                return
            if st == _shm.TRUNCATED:
                self._truncated(call, what)
            if st != _shm.BLOCKED or (got and all(k in got for k in call.missing())):
                await self._mismatch(call, st, what, seq, fp, got, answered)
            now, progress = time.monotonic(), call.progress
            if progress != moved:  # (a long call that moves is not waiting for anyone)
                moved, start = progress, now
            await asyncio.sleep(_POLL_SLEEP_S if now - start > _BUSY_S else 0)

    def _turn_off(self) -> None:
        self.off = ("a member of this communicator could not use the node's shared "
                    "memory: its collectives take the network path from now on")
        log.warning("rank %d: %s", self.rank, self.off)

    def _truncated(self, call: Any, what: str) -> None:
        """(Checks off) a member's message is longer than this rank's buffer: raise as
        the network path's receive would."""
        self._node.ack(call.gen)
        raise TruncationError(f"{what}: a message from another rank is longer than this "
                              "rank's buffer (do the ranks pass the same counts?)")

    async def _probe(self, call: Any, what: str, seq: int, fp: bytes, got: dict[int, bytes],
                     answered: set[int]) -> None:
        """Take the network first message of this call from every member that sent one
        (it took another path) and answer it with this rank's fingerprint."""
        g, t = self._group, self._transport
        cap = fingerprint.capacity(self.size)
        for k in call.missing():
            if k in got:
                continue
            tag = make_tag(g.cid, KIND_COLL, k, seq)
            if t.probe(tag, FULL_MASK) is None:
                continue
            rows = np.empty(cap, np.uint8)
            res = t.recv_into(t.recv_ptr(rows), tag, FULL_MASK, g.peers_all, None, True)
            if not isinstance(res, tuple):
                res = await t.complete(res)
            got[k] = rows[:min(res[1], cap)].tobytes()
            await self._answer(k, what, seq, fp, answered)

    async def _answer(self, k: int, what: str, seq: int, fp: bytes, answered: set[int]) -> None:
        """Send this rank's fingerprint to ``k`` as its first message of the call (``k``
        took a network path and waits for it)."""
        if k in answered:
            return
        answered.add(k)
        ch = Chan(self._group, seq, what)
        ch.send(k, self._transport.send_ptr(fp))
        await ch.waitall(ch.sends)

    async def _mismatch(self, call: Any, st: int, what: str, seq: int, fp: bytes | None,
                        got: dict[int, bytes], answered: set[int]) -> None:
        """Raise the verdict of a call whose members did not all make it here, after
        answering every member that may wait for this rank's network message."""
        from . import _shm

        node = self._node
        if fp is not None:
            # (a member without a record took a network path, or is late here: the
            # latter never reads the answer, which then stays in the transport)
            passed = set(call.passed())
            for k in call.missing():
                if k not in passed:
                    await self._answer(k, what, seq, fp, answered)
        if st == _shm.ABORTED:
            _, text, off = call.aborted()
            if off:
                self._turn_off()
            node.ack(call.gen)
            known = {k: f for k, f in enumerate(call.fingerprints()) if f is not None}
            known.update(got)
            if fp is not None:
                known[self.rank] = fp
            raise CollectiveMismatch(text, calls={k: fingerprint.describe(f)
                                                  for k, f in sorted(known.items())}, seq=seq)
        if fp is None:  # (checks off: a member passed this call on another path)
            node.ack(call.gen)
            raise CollectiveMismatch(
                f"collective #{seq} ({what}): ranks {call.passed()} took another path "
                "for this call (UCXCOMM_CHECK_COLLECTIVES=0: no fingerprint says why)",
                seq=seq)
        fps = call.fingerprints()
        for k, other in got.items():
            fps[k] = other
        # (a member whose fingerprint never reached this rank is shown with this rank's)
        full = [f if f is not None else fp for f in fps]
        bad = fingerprint.verdict(full, what, seq)
        if bad is None:
            bad = CollectiveMismatch(
                f"collective #{seq} ({what}): rank(s) {sorted(got) or call.passed()} took "
                "another path for this call", seq=seq)
        off = fingerprint.only_form_differs(full)
        if off:
            self._turn_off()
        node.publish_verdict(call.gen, str(bad).encode("utf-8", "replace"), off)
        node.ack(call.gen)
        raise bad
