"""SPMD cases of elastic membership (``comm.revoke/agree/shrink/failed/events``;
tests/test_elastic.py).

Two kinds:

* **revocation and agreement among live ranks** (every rank finishes): run one with
  ``ucxcomm run -n 3 python tests/spmd/elastic_cases.py NAME``; each rank prints
  ``CASE-OK NAME rank R``.
* **a death** (``kill_*``): ``ELASTIC_VICTIM`` names the victim's rank. Each survivor
  prints ``WAITING r`` and then blocks in the case's operation, which depends on the
  victim; the victim prints ``VICTIM r PID`` and idles until the test kills it with
  SIGKILL. Each survivor must then get ``PeerFailure`` (or, in ``kill_in_agree`` /
  ``kill_in_shrink``, the verb's answer), revoke, agree, shrink to the survivors,
  check the new communicator's membership and data, and print ``CASE-OK``. Every wait
  runs under ``asyncio.timeout(ELASTIC_DEADLINE_S)``: a hang fails the case.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

import ucxcomm
from ucxcomm import IN_PLACE, PeerFailed, PeerFailure, Revoked
from ucxcomm.testing import Cases

cases = Cases()
case = cases.case
DEADLINE_S = float(os.environ.get("ELASTIC_DEADLINE_S", "20"))


async def _await(request):
    return await request


def _raises(exc_type, fn, what):
    """``fn()`` (a coroutine function) must raise ``exc_type``."""
    async def check():
        try:
            async with asyncio.timeout(DEADLINE_S):
                await fn()
        except exc_type:
            return
        raise AssertionError(f"{what}: no {exc_type.__name__}")
    return check()


# ----------------------------------------------------------- among live ranks
@case
async def revoke_reaches_every_member(comm):
    """Rank 0 revokes a communicator while every other rank is blocked on it (a pending
    Irecv, a Recv from a live rank that never sends, a compiled small Allreduce, a
    general-path Bcast): all of them raise Revoked; later calls of every kind raise it at
    the call; a dup made earlier is untouched; agree and shrink work on the revoked
    communicator, close returns."""
    r, p = comm.rank, comm.size
    c = await comm.dup()
    d = await c.dup()  # made before the revocation: untouched by it
    x, y = np.ones(1), np.empty(1)
    big = np.ones(1 << 16)
    if r == 0:
        for s in range(1, p):  # each says it is about to block
            assert await d.recv(s, tag=1) == "blocking"
        t0 = time.monotonic()
        c.revoke()
        assert c.revoked and not d.revoked
        c.revoke()  # a no-op
        took = time.monotonic() - t0
        assert took < 0.5, took  # local: returns at once
    else:
        req = c.Irecv(np.empty(4), 0, tag=5)  # pending: rank 0 never sends it
        await d.send("blocking", 0, tag=1)
        blocked = {1: lambda: c.Recv(np.empty(4), 0, tag=6),
                   2: lambda: c.Allreduce(x, y)}.get(r % 3, lambda: c.Bcast(big, root=0))
        await _raises(Revoked, blocked, f"rank {r}'s blocked call")
        await _raises(Revoked, lambda: _await(req), "the pending Irecv")
        assert c.revoked
    later = {
        "Send": lambda: c.Send(x, (r + 1) % p),
        "Recv": lambda: c.Recv(y, (r - 1) % p),
        "Isend": lambda: _await(c.Isend(x, (r + 1) % p)),
        "send": lambda: c.send("obj", (r + 1) % p),
        "Allreduce": lambda: c.Allreduce(x, y),
        "Allreduce big": lambda: c.Allreduce(big, np.empty_like(big)),
        "Bcast": lambda: c.Bcast(x, 0),
        "barrier": lambda: c.barrier(),
        "allgather": lambda: c.allgather(r),
        "Iallreduce": lambda: _await(c.Iallreduce(x, y)),
    }
    for name, fn in later.items():
        await _raises(Revoked, fn, f"{name} after the revocation")
    await d.Allreduce(x, y)
    assert y[0] == p, y
    ok, failed = await c.agree(r != 1, timeout=DEADLINE_S)
    assert (ok, failed) == (False, frozenset()), (ok, failed)
    ok, failed = await c.agree(True, timeout=DEADLINE_S)
    assert (ok, failed) == (True, frozenset()), (ok, failed)
    new = await c.shrink(timeout=DEADLINE_S)
    assert (new.rank, new.size) == (r, p)
    await new.Allreduce(x, y)
    assert y[0] == p, y
    assert not c.closed
    await c.close()
    assert c.closed
    await _raises(ucxcomm.ClosedError, lambda: c.Send(x, 0), "Send after close")
    await new.close()
    await d.close()


@case
async def revoked_window(comm):
    """A window over a revoked communicator: synchronization and RMA calls raise
    Revoked; Free releases this rank's part at once."""
    r, p = comm.rank, comm.size
    c = await comm.dup()
    win = await ucxcomm.Win.Allocate(c, 64)
    await win.Fence()
    await comm.barrier()
    if r == 0:
        c.revoke()
    await _raises(Revoked, lambda: win.Fence(timeout=DEADLINE_S), "Fence")
    await _raises(Revoked, lambda: win.Put(np.ones(1), (r + 1) % p), "Put")
    await _raises(Revoked, lambda: win.Lock((r + 1) % p), "Lock")
    async with asyncio.timeout(DEADLINE_S):
        await win.Free()
    assert win.closed
    await c.close()


@case
async def agreement_among_live_ranks(comm):
    """agree: the AND of every rank's flag, the same on every rank, call after call;
    shrink with nobody dead keeps every rank in its place; bad input is refused at the
    call."""
    r, p = comm.rank, comm.size
    c = await comm.dup()
    for i in range(6):
        flag = (i + r) % 4 != 0 if i % 2 else True
        want = all((i + q) % 4 != 0 for q in range(p)) if i % 2 else True
        assert await c.agree(flag, timeout=DEADLINE_S) == (want, frozenset())
    for bad in (1, "yes", None):
        try:
            await c.agree(bad)
        except TypeError:
            continue
        raise AssertionError(f"agree({bad!r}) took a non-bool flag")
    for bad_timeout in (-1, float("nan")):
        try:
            await c.agree(True, timeout=bad_timeout)
        except ValueError:
            continue
        raise AssertionError(f"agree(timeout={bad_timeout!r}) was taken")
    assert c.failed() == frozenset()
    new = await c.shrink(timeout=DEADLINE_S)
    assert (new.rank, new.size) == (r, p)
    grown = await new.grow(timeout=DEADLINE_S)  # nobody to replace: the same members
    assert (grown.rank, grown.size) == (r, p)
    for bad, exc in ((p - 1, ValueError), (2.5, TypeError), ("3", TypeError),
                     (True, TypeError)):
        try:
            await grown.grow(bad)
        except exc:
            continue
        raise AssertionError(f"grow({bad!r}) was taken")
    await grown.close()
    await c.close()
    for what, fn in (("agree", lambda: c.agree(True)), ("shrink", lambda: c.shrink()),
                     ("grow", lambda: c.grow())):
        await _raises(ucxcomm.ClosedError, fn, f"{what} on a closed communicator")
    for what, fn in (("revoke", c.revoke), ("events", c.events)):
        try:
            fn()
        except ucxcomm.ClosedError:
            continue
        raise AssertionError(f"{what} on a closed communicator")
    await new.close()


@case
async def first_rendezvous_after_init(comm):
    """``T0 <time>`` after init, then a rendezvous-sized exchange with every other rank
    (test_elastic.py reads UCX's debug log: no endpoint handshake may come after T0)."""
    r, p = comm.rank, comm.size
    await comm.barrier()
    print(f"T0 {time.time():.6f}", flush=True)
    buf = np.full(BIG, float(r))
    got = np.empty_like(buf)
    for k in range(1, p):
        right, left = (r + k) % p, (r - k) % p
        await comm.Sendrecv(buf, right, got, source=left)
        assert (got == left).all()
    await comm.barrier()


# ------------------------------------------------------------------- a death
def _victim(comm) -> int:
    v = os.environ["ELASTIC_VICTIM"]
    return comm.size - 1 if v == "last" else int(v)


BIG = 1 << 19  # float64: 4 MiB, a rendezvous transfer


def _blocking(name, comm, victim):
    """The operation of case ``name`` a survivor blocks in (it depends on the victim)."""
    r, p = comm.rank, comm.size
    small, out = np.ones(1), np.empty(1)
    big = np.ones(BIG)
    block = np.ones(p)
    first = 0 if victim != 0 else 1  # a survivor
    return {
        "recv": lambda: comm.Recv(np.empty(8), victim, tag=9),
        "recv_any": lambda: comm.Recv(np.empty(8), ucxcomm.ANY_SOURCE, tag=9),
        "send_big": lambda: comm.Send(big, victim, tag=9),
        "irecv": lambda: _await(comm.Irecv(np.empty(8), victim, tag=9)),
        "allreduce": lambda: comm.Allreduce(small, out),
        "allreduce_big": lambda: comm.Allreduce(big, np.empty_like(big)),
        "bcast": lambda: comm.Bcast(small, root=victim),
        "bcast_from_survivor": lambda: comm.Bcast(big, root=first),
        "allgather": lambda: comm.Allgather(small, np.empty(p)),
        "alltoall": lambda: comm.Alltoall(block, np.empty(p)),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(block, np.empty(1)),
        "gather": lambda: comm.Gather(small, np.empty(p) if r == first else None, root=first),
        "scatter": lambda: comm.Scatter(block if r == victim else None, out, root=victim),
        "barrier": lambda: comm.barrier(),
        "allgather_obj": lambda: comm.allgather({"r": r}),
        # (both directions in flight: the receive fails first, the send after it)
        "sendrecv_big": lambda: comm.Sendrecv(big, victim, np.empty_like(big),
                                              source=victim),
    }[name]


def _traffic_report(comm):
    """What this process sent to and received from each member, what is pending, and
    the first message UCX holds unmatched: printed when a case times out (a message
    sent but never received shows here), also to ``$ELASTIC_DIAG_DIR/diag.PID`` when
    that is set (the test shows only the output's tail)."""
    t = comm._group.transport
    d = os.environ.get("ELASTIC_DIAG_DIR")
    out = open(f"{d}/diag.{os.getpid()}", "w") if d else None
    print(f"PENDING rank {comm.rank}: requests, probes, kept = {t._eng.counts()}", flush=True,
          file=out)
    try:
        eng = t._eng
        from ucxcomm import tags
        got = eng.probe(0, 0)
        where = f"context {got[0] >> 44}, (source, tag) {tags.split_tag(got[0])}" if got else ""
        print(f"PROBE-ANY rank {comm.rank}: {got} {where}", file=out, flush=True)
        for g in list(comm._group.world.groups):
            print(f"GROUP rank {comm.rank}: cid {g.cid} members {g.members} "
                  f"seq {getattr(g, 'last_seq', None)}", file=out, flush=True)
    except Exception as exc:
        print(f"PROBE-ERR {exc!r}", file=out, flush=True)
    for m in comm._group.members:
        got = t.traffic(m)
        if got is None:
            continue
        s, rv = got["sent"], got["received"]
        print(f"TRAFFIC rank {comm.rank} peer {m}: sent {s['messages']} msgs "
              f"{s['bytes']} B, received {rv['messages']} msgs {rv['bytes']} B "
              f"(unexpected {rv['unexpected']['messages']})", flush=True, file=out)
    if out is not None:
        out.close()


async def _kill_case(comm, name):
    r, p = comm.rank, comm.size
    victim = _victim(comm)
    # A communicator whose ranks run the other way round: its events name the victim
    # by its rank there.
    rev = await comm.split(0, key=-r)
    win = await ucxcomm.Win.Allocate(comm, 64) if name == "fence" else None
    await comm.barrier()
    if r == victim:
        print(f"VICTIM {r} {os.getpid()}", flush=True)
        await asyncio.Event().wait()  # killed here by the test
    events, rev_events = comm.events(), rev.events()
    verb = name in ("kill_in_agree", "kill_in_shrink")
    print(f"WAITING {r}", flush=True)
    t0 = time.monotonic()
    async with asyncio.timeout(DEADLINE_S):
        if name == "kill_in_agree":
            ok, failed = await comm.agree(True)
            assert (ok, failed) == (True, frozenset({victim})), (ok, failed)
        elif name == "kill_in_shrink":
            new = await comm.shrink()
        else:
            try:
                if win is not None:
                    await win.Fence()
                else:
                    await _blocking(name, comm, victim)()
            except (PeerFailure, Revoked) as exc:
                # (Revoked: another survivor saw the death first and revoked)
                print(f"INTERRUPTED {r} after {time.monotonic() - t0:.3f} s: "
                      f"{type(exc).__name__}: {exc}", flush=True)
            else:
                raise AssertionError(f"{name}: completed although rank {victim} died")
        detected = time.monotonic()
        if not verb or name == "kill_in_agree":
            comm.revoke()
            ok, failed = await comm.agree(True)
            assert (ok, failed) == (True, frozenset({victim})), (ok, failed)
            new = await comm.shrink()
        # (the agreement made the death known here, if its notice had not come yet)
        assert comm.failed() == {victim}, comm.failed()
        assert rev.failed() == {p - 1 - victim}, rev.failed()
        got = await anext(events)
        assert got == PeerFailed(victim, got.reason) and str(victim) in got.reason, got
        assert (await anext(rev_events)).rank == p - 1 - victim
        print(f"SHRUNK {r} {time.monotonic() - detected:.3f} s after detection", flush=True)
        assert new.size == p - 1 and new.rank == r - (r > victim), (new.rank, new.size)
        assert new.failed() == frozenset()
        # the survivors' data, on the new communicator
        assert await new.allgather(r) == [q for q in range(p) if q != victim]
        x = np.full(1000, float(r))
        await new.Allreduce(IN_PLACE, x)
        assert (x == sum(q for q in range(p) if q != victim)).all(), x[:4]
        right, left = (new.rank + 1) % new.size, (new.rank - 1) % new.size
        buf = np.full(BIG, new.rank, np.float64)
        got_buf = np.empty_like(buf)
        await new.Sendrecv(buf, right, got_buf, source=left)
        assert (got_buf == left).all()
        if win is not None:
            await win.Free()  # (failed communicator: released locally)
            assert win.closed
        await new.close()
        await rev.close()
        await ucxcomm.finalize()  # (the world has a dead member: no barrier)
    return "closed"


# ------------------------------------------------------------ replacements
async def _heal(comm):
    """Until a communicator has no dead member: agree, grow (each dead member replaced
    by a process ``ucxcomm run --max-restarts`` started)."""
    while True:
        ok, failed = await comm.agree(True)
        assert ok
        if not failed:
            return comm
        print(f"GROWING {comm.rank} over {sorted(failed)}", flush=True)
        comm = await comm.grow()


async def _grown(comm, restarts):
    """Checks on the healed communicator: every rank in its place (world rank order),
    which of them are replacements, data."""
    p = comm.size
    world_rank = int(os.environ.get("UCXCOMM_RANK") or os.environ["RANK"])
    restart = int(os.environ.get("UCXCOMM_RESTART_COUNT", "0"))
    assert comm.rank == world_rank, (comm.rank, world_rank)
    got = await comm.allgather((world_rank, restart))
    assert got == [(q, restarts.get(q, 0)) for q in range(p)], got
    x = np.full(1000, float(comm.rank))
    await comm.Allreduce(IN_PLACE, x)
    assert (x == p * (p - 1) / 2).all(), x[:4]
    buf = np.full(BIG, comm.rank, np.float64)
    got_buf = np.empty_like(buf)
    right, left = (comm.rank + 1) % p, (comm.rank - 1) % p
    await comm.Sendrecv(buf, right, got_buf, source=left)
    assert (got_buf == left).all()


def _restarts():
    """``ELASTIC_RESTARTS``: ``rank:count,...``, the restarts each rank should have had."""
    out = {}
    for item in filter(None, os.environ.get("ELASTIC_RESTARTS", "").split(",")):
        rank, count = item.split(":")
        out[int(rank)] = int(count)
    return out


async def _replaced_case(comm, name):
    restart = int(os.environ.get("UCXCOMM_RESTART_COUNT", "0"))
    async with asyncio.timeout(DEADLINE_S * 3):
        if restart:  # a replacement: init() returned the communicator it joined
            print(f"JOINED {comm.rank} restart {restart} size {comm.size}", flush=True)
            joined = comm
            comm = await _heal(comm)
            await _grown(comm, _restarts())
            if comm is not joined:  # (grown again: its world's is the one it joined)
                await comm.close()
            await ucxcomm.finalize()
            return "closed"
        r, p = comm.rank, comm.size
        victim = _victim(comm)
        await comm.barrier()
        print(f"PID {r} {os.getpid()}", flush=True)
        if r == victim:
            print(f"VICTIM {r} {os.getpid()}", flush=True)
            await asyncio.Event().wait()  # killed here by the test
        events = comm.events()
        print(f"WAITING {r}", flush=True)
        try:
            await comm.Allreduce(np.ones(1), np.empty(1))
        except (PeerFailure, Revoked):
            pass
        else:
            raise AssertionError(f"Allreduce completed although rank {victim} died")
        ok, failed = await comm.agree(True)
        assert ok and victim in failed, (ok, failed)
        print(f"GROWING {r} over {sorted(failed)}", flush=True)
        new = await comm.grow()
        assert new.size == p and new.rank == r, (new.rank, new.size)
        assert comm.revoked and victim in comm.failed(), comm.failed()
        got = [await anext(events)]
        assert got[0] == PeerFailed(victim, got[0].reason), got
        while ucxcomm.PeerJoined(victim) not in got:  # (another death may come between)
            got.append(await anext(events))
            assert len(got) <= 4, got
        new = await _heal(new)
        await _grown(new, _restarts())
        await new.close()
        await ucxcomm.finalize()
    return "closed"


@case
async def replace_dead_rank(comm):
    """Under ``--elastic --max-restarts 1``: the victim dies, the launcher starts a
    replacement, the survivors grow back to the original size; the replacement's
    init() returns the same communicator."""
    return await _replaced_case(comm, "replace_dead_rank")


@case
async def kill_in_grow(comm):
    """As replace_dead_rank, and the test kills a second rank while the survivors are in
    grow: whichever way the timing falls, everyone ends on a healed communicator."""
    return await _replaced_case(comm, "kill_in_grow")


KILL_CASES = ["recv", "recv_any", "send_big", "sendrecv_big", "irecv", "allreduce",
              "allreduce_big", "bcast", "bcast_from_survivor", "allgather", "alltoall",
              "reduce_scatter", "gather", "scatter", "barrier", "allgather_obj", "fence",
              "kill_in_agree", "kill_in_shrink"]


def _register(name):
    async def fn(comm):
        try:
            return await _kill_case(comm, name)
        except TimeoutError:
            _traffic_report(comm)
            raise
    fn.__name__ = f"kill_{name}" if not name.startswith("kill_") else name
    case(fn)


for _name in KILL_CASES:
    _register(_name)


if __name__ == "__main__":
    cases.main()
