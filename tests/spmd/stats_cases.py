"""SPMD cases of the traffic counters (``comm.stats()``, ``win.stats()``;
tests/test_stats.py). Run one: ``ucxcomm run -n 3 python tests/spmd/stats_cases.py NAME``;
each rank prints ``CASE-OK NAME rank R`` when its assertions passed.

Counters are per process and peer: a collective between two ranks counts too. So the
known traffic between ranks 0 and 1 is ordered through rank 2 (object messages to and
from it count for rank 2 only), and every count is a difference of two snapshots.
"""

from __future__ import annotations

import json

import numpy as np

import ucxcomm
from ucxcomm.testing import Cases

cases = Cases()
case = cases.case

SMALL, BIG = 8, 1 << 20


def _delta(after: dict, before: dict) -> dict:
    """``after - before`` of every count (nested dicts of ints; lists left out)."""
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = _delta(v, before.get(k, {}))
        elif isinstance(v, int) and not isinstance(v, bool):
            out[k] = v - before.get(k, 0)
    return out


def _row(side: dict, nbytes: int, variant: str) -> dict:
    """The protocol row of ``variant`` whose sizes hold ``nbytes`` (among the rows that
    counted messages)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

    def size(text: str) -> float:
        if text == "inf":
            return float("inf")
        return int(text.rstrip("KMG")) * units.get(text[-1], 1)

    rows = []
    for row in side["protocols"]:
        first, _, last = row["sizes"].partition("..")
        if row["variant"] == variant and size(first) <= nbytes <= size(last or first):
            rows.append(row)
    assert len(rows) == 1, side["protocols"]
    return rows[0]


@case
async def known_traffic(comm):
    """Rank 0 sends rank 1 three 8 B messages and one of 1 MiB, received by receives
    posted before they were sent (expected), then one 8 B message received after it
    arrived (unexpected); each side counts exactly those, by protocol and lane."""
    assert comm.size == 3
    r = comm.rank
    small = np.arange(1, dtype=np.float64)
    big = np.zeros(BIG // 8, np.float64)
    await comm.barrier()
    before = comm.stats()
    if r == 1:
        reqs = [comm.Irecv(np.empty(1), 0, tag=1) for _ in range(3)]
        reqs.append(comm.Irecv(np.empty(BIG // 8), 0, tag=2))
        await comm.send("posted", 2)
        await ucxcomm.Request.waitall(reqs)
        assert await comm.recv(2) == "go"  # (rank 0's tag-3 message is here by now)
        await comm.Recv(np.empty(1), 0, tag=3)
    elif r == 2:
        assert await comm.recv(1) == "posted"
        await comm.send("go", 0)
        assert await comm.recv(0) == "sent"
        await comm.send("go", 1)
    else:
        assert await comm.recv(2) == "go"
        for _ in range(3):
            await comm.Send(small, 1, tag=1)
        await comm.Send(big, 1, tag=2)
        await comm.Send(small, 1, tag=3)
        await comm.send("sent", 2)
    after = comm.stats()
    json.dumps(after)  # (a plain dict)
    d = {q: _delta(after["peers"][q], before["peers"][q]) for q in range(3)}
    nbytes = 4 * SMALL + BIG
    zero = {"messages": 0, "bytes": 0}
    if r == 0:
        sent = d[1]["sent"]
        assert (sent["messages"], sent["bytes"]) == (5, nbytes), sent
        assert d[1]["received"]["messages"] == 0, d[1]
        assert (d[2]["sent"]["messages"], d[2]["received"]["messages"]) == (1, 1), d[2]
    elif r == 1:
        got = d[0]["received"]
        assert (got["messages"], got["bytes"]) == (5, nbytes), got
        assert got["unexpected"] == {"messages": 1, "bytes": SMALL}, got
        assert d[0]["sent"]["messages"] == 0, d[0]
        assert (d[2]["sent"]["messages"], d[2]["received"]["messages"]) == (1, 1), d[2]
    else:
        for q in (0, 1):
            assert (d[q]["sent"]["messages"], d[q]["received"]["messages"]) == (1, 1), d
    if r in (0, 1):
        peer = after["peers"][1 - r]
        side = peer["sent" if r == 0 else "received"]
        counted = d[1 - r]["sent" if r == 0 else "received"]
        assert peer["world_rank"] == 1 - r and peer["lanes"], peer
        assert counted["unclassified"] == zero, counted  # (host memory, protocols v2)
        # eager vs rendezvous and the lane: as UCX's protocol table of the endpoint
        # says for each size (default transports here: shared memory)
        # (the variant: sends up to 8184 B ask for fast completion, 1 MiB does not)
        row8, row_big = _row(side, SMALL, "fast"), _row(side, BIG, "plain")
        assert "rendezvous" not in row8["protocol"], row8
        assert "rendezvous" in row_big["protocol"], row_big
        assert counted["rendezvous"] == {"messages": 1, "bytes": BIG}, counted
        assert counted["eager"] == {"messages": 4, "bytes": 4 * SMALL}, counted
        for row in (row8, row_big):  # (a lane, or a split "52% on tcp/lo and 48% on...")
            assert any(lane in row["lane"] for lane in peer["lanes"]), (row, peer["lanes"])
        lanes = {k: v for k, v in counted["lanes"].items() if v["messages"]}
        assert lanes == ({row8["lane"]: {"messages": 4, "bytes": 4 * SMALL},
                          row_big["lane"]: {"messages": 1, "bytes": BIG}}
                         if row8["lane"] != row_big["lane"] else
                         {row8["lane"]: {"messages": 5, "bytes": nbytes}}), lanes
    # A sub-communicator's peers are its ranks; its traffic is the same process's
    # counters of the world peer (shared per process).
    sub = await comm.split(0 if r != 1 else None)
    if sub is not None:
        other = 1 - sub.rank
        assert sub.stats()["peers"][other]["world_rank"] == (2 if r == 0 else 0)
        await sub.barrier()
        before = comm.stats()["peers"][2 if r == 0 else 0]
        if sub.rank == 0:
            await sub.Send(small, 1, tag=5)
        else:
            await sub.Recv(np.empty(1), 0, tag=5)
        after_world = comm.stats()["peers"][2 if r == 0 else 0]
        after_sub = sub.stats()["peers"][other]
        side = "sent" if sub.rank == 0 else "received"
        assert after_world[side]["messages"] - before[side]["messages"] == 1
        assert after_sub[side] == after_world[side]
        await sub.close()


@case
async def window_calls(comm):
    """Each rank's calls on a window, per target rank: puts, gets, atomics (every
    accumulate and atomic call, native or locked), flushes (Flush, Flush_all, Unlock,
    Free), with their bytes; listed by the communicator, readable after Free."""
    r, p = comm.rank, comm.size
    t = (r + 1) % p
    win = await ucxcomm.Win.Allocate(comm, 256, disp_unit=8)
    await win.Put(np.ones(1), t, 0)
    await win.Put(np.ones(2), t, 1)
    await win.Get(np.empty(3), t, 0)
    await win.Accumulate(np.ones(4, np.int64), t, 4)            # remote atomics
    await win.Accumulate(np.ones(2, np.float64), t, 8)          # get-op-put, locked
    await win.Fetch_and_op(1, t, 10)
    await win.Compare_and_swap(5, 0, t, 11)
    await win.Flush(t)
    await win.Lock(t)
    await win.Unlock(t)
    await win.Flush_all()
    s = win.stats()
    want = {"puts": 2, "put_bytes": 24, "gets": 1, "get_bytes": 24, "atomics": 4,
            "atomic_bytes": 32 + 16 + 8 + 8, "flushes": 3}
    assert s["targets"][t] == want, s
    assert {k: s[k] for k in want} == {**want, "flushes": 3 + (p - 1)}, s
    assert s["size"] == p and not s["freed"], s
    assert all(s["targets"][q]["puts"] == 0 for q in range(p) if q != t), s
    listed = comm.stats()["windows"]
    assert listed == [s], listed
    await win.Free()
    freed = win.stats()
    assert freed["freed"] and freed["flushes"] == s["flushes"] + p, freed
    json.dumps(comm.stats())


if __name__ == "__main__":
    cases.main()
