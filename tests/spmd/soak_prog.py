"""A bounded soak (tests/test_soak.py): every rank sends ``COUNT`` messages of mixed sizes
and tags to random peers (itself included) while receiving with a mix of named and
``ANY_SOURCE``/``ANY_TAG`` receives, some of them cancelled at random.

Every rank derives every rank's plan from the same seed, so each knows exactly what it
must receive. Messages carry (sender, tag, sequence number, payload checksum); the
receiver checks that from each (sender, tag) the sequence numbers arrive 0, 1, 2, ...
(nothing lost, duplicated or reordered: MPI's non-overtaking rule) and that each
payload is intact. The run goes in rounds of ROUND messages per rank, each closed by a
barrier, so that what waits unreceived stays bounded. RSS is sampled after every round;
the rank prints ``SOAK r sent S received R cancelled C seconds T rss_mib start A warm B
max C end D`` (B: after the first half of the rounds, C: the most after it).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import zlib

import numpy as np

import ucxcomm

SEED = 20261203
TAGS = 4  # tags 0..3 carry messages; nobody sends tag 4
SIZES = [0, 8, 200, 4096, 40_000, 200_000]  # eager and rendezvous, bytes and arrays
WEIGHTS = [0.2, 0.25, 0.2, 0.2, 0.1, 0.05]
WINDOW = 32  # sends in flight per rank
CANCEL_P = 0.05
ROUND = 1000  # messages per rank between barriers
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def plan(rank: int, size: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank ``rank``'s messages: destination, tag and payload size of each."""
    rng = np.random.default_rng([SEED, rank])
    dests = rng.integers(0, size, count)
    tags = rng.integers(0, TAGS, count)
    sizes = rng.choice(SIZES, count, p=WEIGHTS)
    return dests, tags, sizes


def payload(src: int, seq: int, nbytes: int) -> object:
    if nbytes >= 4096 and seq % 2:  # an array (out-of-band frame)
        return np.full(nbytes // 8, src * 1_000_003 + seq, np.int64)
    return bytes([(src + seq) % 251]) * nbytes


async def sender(comm, plan_: tuple, lo: int, hi: int, seqs: np.ndarray) -> None:
    """Send this rank's messages ``lo:hi``, at most WINDOW in flight."""
    dests, tags, sizes = plan_
    inflight: list[ucxcomm.Request] = []
    for i in range(lo, hi):
        d, t, n = int(dests[i]), int(tags[i]), int(sizes[i])
        seq = int(seqs[d, t])
        seqs[d, t] += 1
        body = payload(comm.rank, seq, n)
        crc = zlib.crc32(memoryview(body).cast("B"))
        inflight.append(comm.isend((comm.rank, t, seq, crc, body), d, tag=t))
        if len(inflight) >= WINDOW:
            await inflight.pop(0)
    await ucxcomm.Request.waitall(inflight)


class Receiver:
    """Receives a round's messages with random criteria, checking order and content."""

    def __init__(self, comm, plans: list[tuple]) -> None:
        self.comm, self.plans = comm, plans
        self.nxt = np.zeros((comm.size, TAGS), np.int64)
        self.rng = np.random.default_rng([SEED, 1000 + comm.rank])
        self.got = self.cancelled = 0

    def take(self, msg, source: int, tag: int, left: np.ndarray) -> None:
        src, t, seq, crc, body = msg
        assert source == src and tag == t, (source, tag, src, t)
        want = self.nxt[src, t]
        assert seq == want, f"from {src} tag {t}: got #{seq}, expected #{want}"
        assert zlib.crc32(memoryview(body).cast("B")) == crc, f"{src}/{t}/#{seq} corrupt"
        self.nxt[src, t] += 1
        left[src, t] -= 1
        self.got += 1

    async def round(self, lo: int, hi: int) -> None:
        comm, rng = self.comm, self.rng
        left = np.zeros((comm.size, TAGS), np.int64)  # what this round brings here
        for src, (dests, tags, _) in enumerate(self.plans):
            mine = dests[lo:hi] == comm.rank
            left[src] += np.bincount(tags[lo:hi][mine], minlength=TAGS)
        while left.any():
            pairs = np.argwhere(left > 0)  # criteria that something still matches
            src, t = (int(x) for x in pairs[rng.integers(len(pairs))])
            kind = rng.random()
            source = ucxcomm.ANY_SOURCE if kind < 0.4 else src
            tag = ucxcomm.ANY_TAG if 0.4 <= kind < 0.6 else t
            if rng.random() < CANCEL_P:  # post, then cancel at once (it may have matched)
                idle = rng.random() < 0.5  # or criteria nothing matches: it must cancel
                req = comm.irecv(ucxcomm.ANY_SOURCE, TAGS) if idle else comm.irecv(source, tag)
                cancelled = req.cancel()
                assert cancelled or not idle, "an unmatched receive was not cancelled"
                if cancelled:
                    self.cancelled += 1
                    try:
                        await req
                    except asyncio.CancelledError:
                        pass
                    else:
                        raise AssertionError("a cancelled receive completed")
                    continue
                msg = await req  # (no status: the message names its sender and tag)
                self.take(msg, msg[0], msg[1], left)
                continue
            msg, status = await comm.recv(source, tag, return_status=True, timeout=60)
            self.take(msg, status.source, status.tag, left)
        assert not (left < 0).any(), left


async def main(count: int) -> None:
    comm = await ucxcomm.init()
    plans = [plan(r, comm.size, count) for r in range(comm.size)]
    receiver = Receiver(comm, plans)
    seqs = np.zeros((comm.size, TAGS), np.int64)
    rounds = max(1, count // ROUND)
    await comm.barrier()
    start_rss = rss_mib()
    rss = []
    t0 = time.perf_counter()
    for k in range(rounds):
        lo, hi = k * count // rounds, (k + 1) * count // rounds
        # A round ends when everything sent in it arrived: the backlog of messages that
        # arrived before their receive was posted stays bounded (eager sends complete
        # as soon as UCX buffered them, so without rounds it grew with the run).
        await asyncio.gather(sender(comm, plans[comm.rank], lo, hi, seqs),
                             receiver.round(lo, hi))
        await comm.barrier(timeout=60)
        rss.append(rss_mib())
    took = time.perf_counter() - t0
    half = len(rss) // 2
    warm = rss[half - 1]  # after the first half (UCX's pools and malloc settle by ~10k)
    expect = sum(int((d == comm.rank).sum()) for d, _, _ in plans)
    assert receiver.got == expect, (receiver.got, expect)
    print(f"SOAK {comm.rank} sent {count} received {receiver.got} cancelled "
          f"{receiver.cancelled} seconds {took:.1f} rss_mib start {start_rss:.1f} warm "
          f"{warm:.1f} max {max(rss[half:]):.1f} end {rss[-1]:.1f}", flush=True)
    if os.environ.get("SOAK_TRACE"):
        print("TRACE", comm.rank, [round(x) for x in rss], flush=True)
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
