"""An elastic worker pool: the ranks share a list of tasks, round by round; one of them
dies half-way (this example kills its last rank with SIGKILL); the others agree on what
happened, shrink to a communicator of the survivors, redo the lost round's tasks
between them, and two rounds later admit the replacement the launcher started, which
picks up the pool's state and works on to the end. Every task is counted exactly once.

    ucxcomm run --elastic --max-restarts 1 -n 4 python examples/elastic_pool.py

The pattern (docs/elastic.md): do a round's work, exchange it, then ``agree`` on
whether the exchange completed everywhere; a round that did not is done again, on the
shrunk communicator when a member died. ``comm.events()`` reports the death and the
join as they happen.
"""

import asyncio
import math
import os
import signal

import ucxcomm

TASKS = 240
PER_RANK = 10  # tasks per rank and round


def work(task: int) -> float:
    return math.fsum(math.sin(task * k) for k in range(2000))


async def watch(comm: ucxcomm.Comm, me: int) -> None:
    async for event in comm.events():
        print(f"[rank {me}] event: {event}", flush=True)


async def main() -> None:
    comm = await ucxcomm.init()
    me = int(os.environ.get("UCXCOMM_RANK", "0"))  # (the world rank, for the messages)
    restarted = int(os.environ.get("UCXCOMM_RESTART_COUNT", "0")) > 0
    victim = comm.size - 1 if comm.size > 2 else None
    results: dict[int, float] = {}
    remaining = list(range(TASKS))
    rounds, shrunk_at = 0, None
    if restarted:  # a replacement: init() returned the grown communicator; catch up
        states = await comm.allgather(None)
        results, remaining, rounds = next(s for s in states if s is not None)
        print(f"[rank {me}] joined as rank {comm.rank} of {comm.size} at round {rounds}",
              flush=True)
    watched = comm
    watchers = [asyncio.ensure_future(watch(comm, me))]  # (each ends as its comm closes)
    while remaining:
        rounds += 1
        batch = remaining[:PER_RANK * comm.size]
        mine = batch[comm.rank::comm.size]
        if me == victim and rounds == 3 and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of its share
        done = {t: work(t) for t in mine}
        try:
            parts = await comm.allgather(done)
            completed = True
        except (ucxcomm.PeerFailure, ucxcomm.Revoked):
            comm.revoke()  # everyone leaves the round, wherever they are in it
            completed = False
        ok, failed = await comm.agree(completed)
        if ok:  # the exchange completed on every live member: the round counts
            for part in parts:
                results.update(part)
            remaining = remaining[len(batch):]
        if failed:
            comm = await comm.shrink()
            shrunk_at = rounds
            print(f"[rank {me}] round {rounds}: ranks {sorted(failed)} died; "
                  f"{'kept' if ok else 'redoing'} the round on {comm.size} ranks "
                  f"(now rank {comm.rank})", flush=True)
        elif shrunk_at is not None and rounds == shrunk_at + 2 and remaining:
            old = comm
            comm = await comm.grow(timeout=60)  # back to the original size
            shrunk_at = None
            await comm.allgather((results, remaining, rounds))  # (the joiner catches up)
            print(f"[rank {me}] round {rounds}: admitted a replacement, {comm.size} ranks",
                  flush=True)
            await old.close()  # (the shrunk one: its members are all here)
        if comm is not watched:
            watched = comm
            watchers.append(asyncio.ensure_future(watch(comm, me)))
    assert sorted(results) == list(range(TASKS)), "each task exactly once"
    total = math.fsum(results[t] for t in range(TASKS))
    serial = math.fsum(map(work, range(TASKS)))
    if comm.rank == 0:
        print(f"{TASKS} tasks in {rounds} rounds, finished by {comm.size} ranks; checksum "
              f"{total:.6f} (serial {serial:.6f})", flush=True)
    assert total == serial
    await comm.close()
    await ucxcomm.finalize()
    await asyncio.gather(*watchers)  # (every communicator is closed: they ended)


if __name__ == "__main__":
    asyncio.run(main())
