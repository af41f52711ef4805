"""The node's shared-memory collective engine (comm/shm.py, comm/_shm.pyx): its protocol
driven step by step in one process (two or three members over plain memory), then real
jobs (tests/spmd/shm_cases.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from ucxcomm.comm.small import DONE
from ucxcomm.testing import run_case

SHM_CASES = Path(__file__).resolve().parent / "spmd" / "shm_cases.py"

_shm = pytest.importorskip("ucxcomm.comm._shm")

SLOT, NSLOTS = 4096, 2


def _members(p):
    """``p`` Nodes over plain memory, every one attached to every other's."""
    total = _shm.DATA_OFFSET + SLOT * NSLOTS
    mems = [bytearray(total) for _ in range(p)]
    nodes = [_shm.Node(r, p, SLOT, NSLOTS, mems[r]) for r in range(p)]
    for a in nodes:
        for k in range(p):
            if k != a.rank:
                assert a.attach(k, mems[k])
    return nodes, mems


def _drive(calls, limit=10_000):
    """Advance every call in turn (no spinning) until none is blocked."""
    states = [_shm.BLOCKED] * len(calls)
    for _ in range(limit):
        for i, c in enumerate(calls):
            if states[i] == _shm.BLOCKED:
                states[i] = c.advance(0)
        if _shm.BLOCKED not in states:
            return states
    raise AssertionError(f"still blocked: {states}")


def test_pieces_go_through_a_ring_smaller_than_the_message():
    """A 3-member Bcast and Allreduce many times the ring's size, calls interleaved one
    step at a time; then a second call on the same segments (pieces counted over the
    members' lives)."""
    nodes, _ = _members(3)
    n = SLOT * NSLOTS * 5 + 24
    for gen in (1, 2):
        data = np.arange(n, dtype=np.uint8) + gen
        bufs = [data.copy() if r == 1 else np.zeros(n, np.uint8) for r in range(3)]
        calls = [_shm.Call(nodes[r], gen, "Bcast", b"fp", bufs[r], bufs[r], n, 1, 0, None)
                 for r in range(3)]
        assert _drive(calls) == [_shm.DONE] * 3
        assert all(np.array_equal(b, data) for b in bufs)
    x = [np.full(n // 8, r + 1.5) for r in range(3)]
    out = [np.empty(n // 8) for _ in range(3)]
    calls = [_shm.Call(nodes[r], 3, "Allreduce", b"fp2", x[r], out[r], n // 8 * 8, -1, 2,
                       None) for r in range(3)]
    assert _drive(calls) == [_shm.DONE] * 3
    assert all((o == 1.5 + 2.5 + 3.5).all() for o in out)


def _rooted(kind, r, root, count, salt):
    """Rank ``r``'s buffers of a 3-member ``kind`` of ``count`` int64 a block, and what
    its receive buffer must hold after it (None: nothing)."""
    def data(k, m=count):
        return np.arange(m, dtype=np.int64) * 10 + 100 * k + 1000 * salt

    if kind == "Reduce":
        send = data(r)
        recv = np.full(count, -1, np.int64) if r == root else send
        return send, recv, (sum(data(k) for k in range(3)) if r == root else None)
    if kind == "Gather":
        send = data(r)
        recv = np.full(3 * count, -1, np.int64) if r == root else send
        return send, recv, (np.concatenate([data(k) for k in range(3)]) if r == root else None)
    if kind == "Scatter":
        recv = np.full(count, -1, np.int64)
        send = data(root, 3 * count) if r == root else recv
        return send, recv, data(root, 3 * count)[r * count:(r + 1) * count]
    buf = data(root) if r == root else np.full(count, -1, np.int64)  # Bcast
    return buf, buf, data(root)


# (first call, its root, second call, its root, the member late in the first call)
_HANDOVERS = [("Reduce", 2, "Reduce", 0, 2), ("Gather", 2, "Gather", 0, 2),
              ("Scatter", 0, "Reduce", 0, 2), ("Bcast", 0, "Gather", 1, 2)]


@pytest.mark.parametrize("first,root1,second,root2,late", _HANDOVERS)
def test_a_slot_waits_for_its_own_pieces_readers(first, root1, second, root2, late):
    """A slot comes free once the readers of the piece in it consumed it, not those of
    the call writing the next one. Checks on, 3 members, each writer's pieces of the
    first call filling its ring: every member but ``late`` finishes the first call
    (pieces out, every record in) while ``late`` has read nothing of it, then goes as
    far as it can into the second, whose readers differ (a Reduce or Gather to another
    root; the Scatter root's own Reduce; a Gather from a Bcast root), and whose reader
    counts every earlier piece consumed as it reads the writers' records. Their pieces
    of the second call must wait for ``late``, or it reads (folds) them instead of the
    first call's. (Found with 2 slots of 4 KiB: the root's wrong Reduce in CI.)"""
    nodes, _ = _members(3)
    others = [r for r in range(3) if r != late]

    def call(kind, r, gen, root):
        count = SLOT * NSLOTS // 8  # (a ring of int64 pieces; Scatter: 1/3 slot a piece)
        if kind == "Scatter":
            count = (SLOT // 3 - SLOT // 3 % 64) * NSLOTS // 8
        send, recv, want = _rooted(kind, r, root, count, gen)
        c = _shm.Call(nodes[r], gen, kind, b"fp-%d" % gen, send, recv, count * 8, root,
                      0, np.add if kind == "Reduce" else None)
        return c, recv, want

    one = {r: call(first, r, 1, root1) for r in range(3)}
    assert one[late][0].advance(0) == _shm.BLOCKED  # (its record, its pieces if any)
    assert _drive([one[r][0] for r in others]) == [_shm.DONE] * 2
    two = {r: call(second, r, 2, root2) for r in others}  # (past the first call)
    for _ in range(3):  # (as far as they go without the late member: its record)
        for r in reversed(others):
            assert two[r][0].advance(0) == _shm.BLOCKED
    assert _drive([one[late][0]]) == [_shm.DONE]
    two[late] = call(second, late, 2, root2)
    assert _drive([two[r][0] for r in range(3)]) == [_shm.DONE] * 3
    for calls in (one, two):
        for r, (_, recv, want) in calls.items():
            if want is not None:
                assert np.array_equal(recv, want), (r, calls is one)


def test_single_copy_mode_reads_the_writers_buffers():
    """Members that can read each other's memory (here: one process, so
    process_vm_readv reads our own) and ask for it copy straight out of the writer's
    buffer: no piece goes through the slots; the writer returns once its readers are
    done. One member that cannot (refuse_direct) sends everyone through the slots."""
    nodes, _ = _members(3)
    for node in nodes:
        assert node.probe_direct() and node.direct_ok()
    n = SLOT * NSLOTS * 3 + 8
    blk = [np.arange(n, dtype=np.uint8) + 7 * r for r in range(3)]
    out = [np.zeros(3 * n, np.uint8) for _ in range(3)]
    calls = [_shm.Call(nodes[r], 1, "Allgather", b"fp", blk[r], out[r], n, -1, 0, None,
                       True) for r in range(3)]
    assert _drive(calls) == [_shm.DONE] * 3
    assert all(np.array_equal(o, np.concatenate(blk)) for o in out)
    assert [node.pieces for node in nodes] == [0, 0, 0]  # (nothing through the slots)
    send = [np.arange(3 * n, dtype=np.uint8) + r for r in range(3)]
    got = [np.zeros(3 * n, np.uint8) for _ in range(3)]
    nodes[2].refuse_direct()
    calls = [_shm.Call(nodes[r], 2, "Alltoall", b"fp2", send[r], got[r], n, -1, 0, None,
                       True) for r in range(3)]
    assert _drive(calls) == [_shm.DONE] * 3
    for r in range(3):
        want = np.concatenate([send[k][r * n:(r + 1) * n] for k in range(3)])
        assert np.array_equal(got[r], want)
    assert all(node.pieces > 0 for node in nodes)  # (the slots this time)


@pytest.mark.parametrize("p", [2, 3])
def test_pushed_shares(p):
    """Single-copy mode, messages from ``push_min``: a Bcast root and a Gather's other
    members write a share of their readers' bytes into the readers' buffers
    (process_vm_writev; here one process, so into our own memory) while the readers
    read the rest: the results are the same bytes, and the pushers say how much they
    pushed (a Scatter root pushes nothing). A member that does not ask (push_min 0)
    keeps every call read-only. Checks off, a reader whose buffer is shorter gets
    nothing pushed."""
    nodes, _ = _members(p)
    for node in nodes:
        assert node.probe_direct()
        node.push_min = 1 << 16
    n = (1 << 17) + 8 * 3  # (a split that is not a multiple of 64 bytes)
    gen = 0

    def run(kind, root, send, recv, fp=b"fp", nb=None):
        nonlocal gen
        gen += 1
        calls = [_shm.Call(nodes[r], gen, kind, fp, send[r], recv[r],
                           n if nb is None else nb[r], root, 0, None, True)
                 for r in range(p)]
        return _drive(calls)

    for root in range(p):
        bufs = [np.arange(n, dtype=np.uint8) * 3 + 1 if r == root else np.zeros(n, np.uint8)
                for r in range(p)]
        assert run("Bcast", root, bufs, bufs) == [_shm.DONE] * p
        assert all(np.array_equal(b, bufs[root]) for b in bufs)
        src = [np.arange(n * p, dtype=np.uint8) * 5 + r for r in range(p)]
        got = [np.zeros(n, np.uint8) for _ in range(p)]
        assert run("Scatter", root, src, got) == [_shm.DONE] * p
        assert all(np.array_equal(got[r], src[root][r * n:(r + 1) * n]) for r in range(p))
        blk = [np.arange(n, dtype=np.uint8) * 7 + r for r in range(p)]
        out = [np.zeros(n * p, np.uint8) for _ in range(p)]
        assert run("Gather", root, blk, out) == [_shm.DONE] * p
        assert np.array_equal(out[root], np.concatenate(blk))
    assert all(node.pushed > 0 for node in nodes)
    assert all(node.pieces == 0 for node in nodes)  # (nothing through the slots)
    before = [node.pushed for node in nodes]
    src = [np.arange(n * p, dtype=np.uint8) + r for r in range(p)]
    got = [np.zeros(n, np.uint8) for _ in range(p)]
    assert run("Scatter", 0, src, got) == [_shm.DONE] * p
    assert all(np.array_equal(got[r], src[0][r * n:(r + 1) * n]) for r in range(p))
    assert [node.pushed for node in nodes] == before
    # One member that does not ask: nobody pushes.
    before = [node.pushed for node in nodes]
    nodes[p - 1].push_min = 0
    bufs = [np.full(n, 9, np.uint8) if r == 0 else np.zeros(n, np.uint8) for r in range(p)]
    assert run("Bcast", 0, bufs, bufs) == [_shm.DONE] * p
    assert all(np.array_equal(b, bufs[0]) for b in bufs)
    assert [node.pushed for node in nodes] == before
    # Checks off, a shorter reader: truncated, nothing written into it.
    nodes[p - 1].push_min = 1 << 16
    bufs = [np.full(n, 4, np.uint8)] + [np.zeros(n - 4096, np.uint8) for _ in range(p - 1)]
    got = run("Bcast", 0, bufs, bufs, fp=None, nb=[n] + [n - 4096] * (p - 1))
    assert got == [_shm.DONE] + [_shm.TRUNCATED] * (p - 1)
    assert not any(b.any() for b in bufs[1:])
    assert [node.pushed for node in nodes] == before


def test_differing_fingerprints_stop_before_any_write():
    nodes, _ = _members(2)
    bufs = [np.arange(8192, dtype=np.uint8), np.zeros(8192, np.uint8)]
    calls = [_shm.Call(nodes[r], 1, "Bcast", b"fp-%d" % r, bufs[r], bufs[r], 8192, 0, 0,
                       None) for r in range(2)]
    assert _drive(calls) == [_shm.MISMATCH] * 2
    assert not bufs[1].any()
    assert calls[1].fingerprints() == [b"fp-0", b"fp-1"]
    # A published verdict reaches a member still waiting for a record.
    nodes[0].ack(1)
    nodes[1].ack(1)
    c0 = _shm.Call(nodes[0], 2, "Bcast", b"same", bufs[0], bufs[0], 8192, 0, 0, None)
    assert c0.advance(0) == _shm.BLOCKED
    nodes[0].publish_verdict(2, b"rank 0 saw a member on another path")
    c1 = _shm.Call(nodes[1], 2, "Bcast", b"same", bufs[1], bufs[1], 8192, 0, 0, None)
    assert c1.advance(0) == _shm.ABORTED
    assert c1.aborted() == (0, "rank 0 saw a member on another path", False)
    assert not bufs[1].any()


def test_a_member_that_passed_the_call_is_a_mismatch():
    """A member whose acknowledgements are past this call never wrote its record: it
    took another path (found at once, not waited for)."""
    nodes, _ = _members(2)
    buf = np.zeros(8192, np.uint8)
    nodes[0].ack(5)
    call = _shm.Call(nodes[1], 3, "Bcast", b"fp", buf, buf, 8192, 0, 0, None)
    assert call.advance(0) == _shm.MISMATCH
    assert call.passed() == [0]


def test_checks_off_a_longer_message_is_truncation_and_bounded():
    """Checks off: a writer's record saying more bytes than this rank's buffer is
    refused (TRUNCATED), never copied past the buffer; fewer bytes complete."""
    nodes, _ = _members(2)
    big, small = np.ones(9000, np.uint8), np.zeros(8192, np.uint8)
    root = _shm.Call(nodes[0], 1, "Bcast", None, big, big, 9000, 0, 0, None)
    other = _shm.Call(nodes[1], 1, "Bcast", None, small, small, 8192, 0, 0, None)
    assert _drive([root, other]) == [_shm.DONE, _shm.TRUNCATED]
    assert not small.any()


def test_a_hostile_record_cannot_make_a_reader_overrun():
    """A record claiming a huge piece count only makes the reader take part in empty
    steps: its copies stop at its own buffer (and it waits, bounded by its caller)."""
    nodes, mems = _members(2)
    buf = np.zeros(8192, np.uint8)
    root = _shm.Call(nodes[0], 1, "Bcast", None, np.ones(8192, np.uint8),
                     np.ones(8192, np.uint8), 8192, 0, 0, None)
    assert root.advance(0) == _shm.DONE
    rec = _shm.DATA_OFFSET - 4 * 2048 + (1 % 4) * 2048  # member 0's record of gen 1
    np.frombuffer(mems[0], np.uint64)[(rec + 8) // 8] = 1 << 62  # its piece count
    reader = _shm.Call(nodes[1], 1, "Bcast", None, buf, buf, 8192, 0, 0, None)
    assert reader.advance(0) == _shm.BLOCKED  # (waits for pieces that never come)
    assert buf.all() and len(buf) == 8192


def test_a_segment_of_another_geometry_is_not_attached():
    total = _shm.DATA_OFFSET + SLOT * NSLOTS
    own = bytearray(total)
    node = _shm.Node(0, 2, SLOT, NSLOTS, own)
    other = bytearray(total)
    assert not node.attach(1, other)  # (no magic: its creator has not finished it)
    wrong = bytearray(_shm.DATA_OFFSET + SLOT * (NSLOTS + 1))
    _shm.Node(1, 2, SLOT, NSLOTS + 1, wrong)
    assert not node.attach(1, wrong)  # (another ring)
    short = bytearray(100)
    assert not node.attach(1, short)
    with pytest.raises(ValueError):
        _shm.Node(0, 2, 100, NSLOTS, own)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_every_collective_every_size(nranks):
    run_case(SHM_CASES, "every_collective_every_size", nranks)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_rooted_collectives(nranks):
    run_case(SHM_CASES, "rooted_collectives", nranks)


@pytest.mark.parametrize("name", ["every_collective_every_size", "rooted_collectives"])
def test_small_slots_wrap_the_ring_many_times(name):
    run_case(SHM_CASES, name, 3, env={"UCXCOMM_SHM_SLOT": "4096", "UCXCOMM_SHM_SLOTS": "2"})


@pytest.mark.parametrize("env", [{}, {"UCXCOMM_CHECK_COLLECTIVES": "0"}])
def test_lean_and_general_entries_meet(env):
    run_case(SHM_CASES, "lean_and_general_entries_meet", 3, env=env)


def test_engine_calls_across_the_sequence_wrap():
    run_case(SHM_CASES, "engine_calls_across_the_sequence_wrap", 3)


@pytest.mark.parametrize("env", [{}, {"UCXCOMM_CHECK_COLLECTIVES": "0"}])
def test_allreduce_in_two_stages(env):
    run_case(SHM_CASES, "allreduce_in_two_stages", 4, env=env)


@pytest.mark.parametrize("env", [{}, {"UCXCOMM_CHECK_COLLECTIVES": "0"}])
def test_reduce_in_two_stages(env):
    run_case(SHM_CASES, "reduce_in_two_stages", 4, env=env)


@pytest.mark.parametrize("env", [{}, {"UCXCOMM_CHECK_COLLECTIVES": "0"}])
def test_bad_input_once_the_engine_is_up(env):
    run_case(SHM_CASES, "bad_input_once_the_engine_is_up", 3, env=env)


def test_single_copy_mode_is_used_and_can_be_refused():
    run_case(SHM_CASES, "single_copy_mode", 3)
    run_case(SHM_CASES, "single_copy_mode", 3, env={"UCXCOMM_SHM_DIRECT": "no"})
    run_case(SHM_CASES, "single_copy_mode", 3, env={"UCXCOMM_SHM_PUSH": "no"})


def test_segment_names_are_unlinked_after_the_first_call():
    run_case(SHM_CASES, "names_go_once_mapped", 3)


@pytest.mark.parametrize("nranks", [2, 3])
def test_checks_off_root_runs_ahead(nranks):
    run_case(SHM_CASES, "checks_off_runs_ahead", nranks,
             env={"UCXCOMM_CHECK_COLLECTIVES": "0"})


def test_checks_off_a_writer_ahead_of_its_readers_segments():
    run_case(SHM_CASES, "checks_off_a_writer_ahead_of_its_readers_segments", 3,
             env={"UCXCOMM_CHECK_COLLECTIVES": "0", "UCXCOMM_SHM_SLOT": "4096",
                  "UCXCOMM_SHM_SLOTS": "2"})


@pytest.mark.parametrize("nranks", [2, 3])
def test_mismatch_across_paths(nranks):
    run_case(SHM_CASES, "mismatch_across_paths", nranks)


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_rank_without_the_engine(nranks):
    run_case(SHM_CASES, "a_rank_without_the_engine", nranks)


def test_a_dead_member_fails_the_wait():
    proc = run_case(SHM_CASES, "a_dead_member_fails_the_wait", 3)
    assert "CASE-OK a_dead_member_fails_the_wait rank 0" in proc.stdout


def test_a_late_root_times_out():
    run_case(SHM_CASES, "a_late_root_times_out", 2)


@pytest.mark.parametrize("env", [{"UCXCOMM_CHECK_COLLECTIVES": "0"}, {"UCXCOMM_SHM_DIRECT": "no"},
                                 {"UCXCOMM_SHM_PUSH": "no"}])
@pytest.mark.parametrize("name", ["every_collective_every_size", "rooted_collectives"])
def test_checks_off_or_no_single_copy(name, env):
    run_case(SHM_CASES, name, 3, env=env)


@pytest.mark.parametrize("env", [{}, {"UCXCOMM_CHECK_COLLECTIVES": "0"}])
def test_overlapping_calls(env):
    """Non-blocking engine calls of every kind posted back to back, blocking ones from
    concurrent tasks: one at a time on the engine, in call order (2-slot rings)."""
    run_case(SHM_CASES, "overlapping_calls", 3,
             env={"UCXCOMM_SHM_SLOT": "4096", "UCXCOMM_SHM_SLOTS": "2", **env})


class _Recorder:
    def start(self, *args):
        return 0

    def end(self, token):
        pass


class _Transport:
    def spin_policy(self):
        return 0.0, False

    def is_dead(self, member):
        return False


class _Group:
    """What NodeShm needs of a communicator's group: member ``rank`` of ``p`` (every
    member of one test in this process, over real segments under /dev/shm)."""

    def __init__(self, p, rank, salt):
        self.transport = _Transport()
        self.size, self.rank, self.cid = p, rank, 1
        self.members, self.lives = list(range(p)), [0] * p
        self.seq_wraps, self.closed = 0, False
        self.world = type("W", (), {})()
        self.world.addresses = [b"in-process-%s-%d" % (salt.encode(), k) for k in range(p)]
        self.world.rank, self.world.recorder, self.world.dead_reason = rank, _Recorder(), {}

    def check_open(self):
        pass


@pytest.fixture
def engines(monkeypatch, request):
    """Three members' NodeShm (checks off: no network), 2-slot rings of 4 KiB."""
    from ucxcomm.comm.shm import NodeShm

    monkeypatch.setenv("UCXCOMM_SHM_SLOT", str(SLOT))
    monkeypatch.setenv("UCXCOMM_SHM_SLOTS", str(NSLOTS))
    salt = f"{request.node.name}-{id(request)}"
    shms = [NodeShm(_Group(3, r, salt)) for r in range(3)]
    assert all(sh.ready() for sh in shms)
    yield shms
    for sh in shms:
        sh.close()


def _bcast(sh, seq, root, salt):
    """Member ``sh``'s Bcast number ``seq`` from ``root`` (three rings' worth of int64):
    what to await (None: done at once), its buffer, the data it must end with."""
    n = 3 * SLOT * NSLOTS // 8 + 5
    want = np.arange(n, dtype=np.int64) * 3 + 1000 * salt
    buf = want.copy() if sh.rank == root else np.full(n, -1, np.int64)
    res = sh.start("Bcast", seq, None, buf, buf, n * 8, root)
    return (None if res is DONE else res), buf, want


async def _all(awaitables):
    return await asyncio.wait_for(asyncio.gather(*(a for a in awaitables if a is not None)),
                                  20)


async def test_overlapping_calls_take_turns(engines):
    """Calls started back to back on every member, before any is awaited: each
    member's second and third wait for its first (they would share its piece counter,
    slots and records), then run in call order; all data right, the line empty after."""
    calls = [[_bcast(sh, seq, seq % 3, seq) for seq in range(3)] for sh in engines]
    for sh in engines:
        assert sh._busy is not None and len(sh._line) == 2
    await _all(c[0] for mine in calls for c in mine)
    for mine in calls:
        for _, buf, want in mine:
            assert np.array_equal(buf, want)
    for sh in engines:
        assert sh._busy is None and not sh._line


@pytest.mark.parametrize("how", ["cancelled in line", "holder cancelled",
                                 "holder never ran"])
async def test_a_call_that_gives_up_hands_the_engine_on(engines, how):
    """Member 0 gives up a call (its task cancelled while it waits in line or on the
    engine, or before it ever ran: its coroutine dropped unstarted): the call behind it
    still runs. (The other members never make the call given up: they skip its
    sequence number.)"""
    m0, others = engines[0], engines[1:]
    first = _bcast(m0, 0, 0, 0)
    if how == "cancelled in line":
        task = asyncio.ensure_future(_bcast(m0, 1, 0, 1)[0])
        await asyncio.sleep(0)  # (it waits in line)
        task.cancel()
        await asyncio.sleep(0)
        assert task.cancelled()
    calls = [_bcast(m0, 2, 0, 2)]
    if how == "cancelled in line":
        calls.append(first)
        for sh in others:
            calls += [_bcast(sh, 0, 0, 0), _bcast(sh, 2, 0, 2)]
    else:
        if how == "holder cancelled":
            task = asyncio.ensure_future(first[0])
            await asyncio.sleep(0.01)  # (its pieces fill its ring: it waits for readers)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            first[0].close()  # (what a task cancelled before its first step leaves)
            first = None
        calls += [_bcast(sh, 2, 0, 2) for sh in others]
    await _all(c[0] for c in calls)
    for _, buf, want in calls:
        assert np.array_equal(buf, want)
    for sh in engines:
        assert sh._busy is None and not sh._line


async def test_a_long_call_that_moves_never_polls_slowly(engines, monkeypatch):
    """A call that lasts longer than ``shm._BUSY_S`` while its pieces keep moving polls
    the engine on every event-loop turn: the slow poll (every ``_POLL_SLEEP_S``) is for
    a member that is late, not for a long call. (It once began 5 ms into any call: a
    64 MiB Reduce_scatter_block at 4 ranks on 2 cores took 3.5x MPICH's time.)"""
    from ucxcomm.comm import shm as shm_mod

    monkeypatch.setattr(shm_mod, "_BUSY_S", 0.0002)  # (every call here lasts longer)
    slow = 0
    real = asyncio.sleep

    async def sleep(delay, *args, **kwargs):
        nonlocal slow
        slow += delay == shm_mod._POLL_SLEEP_S
        return await real(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    n = (4 << 20) // 8  # (1024 pieces through each member's 2 slots)
    want = np.arange(n, dtype=np.int64) * 5
    bufs = [want.copy() if sh.rank == 0 else np.full(n, -1, np.int64) for sh in engines]
    rests = [sh.start("Bcast", 0, None, b, b, n * 8, 0)
             for sh, b in zip(engines, bufs, strict=True)]
    await _all(r for r in rests if r is not DONE)
    assert all(np.array_equal(b, want) for b in bufs)
    # (a member may see nothing move for 0.2 ms now and then on a loaded machine)
    assert slow < 50, f"{slow} slow polls while the pieces kept moving"
