"""An elastic worker pool: the ranks share a list of tasks, round by round; one of them
dies half-way (this example kills its last rank with SIGKILL), and the others agree on
what happened, shrink to a communicator of the survivors, take over the lost round's
tasks and finish the job, every task counted exactly once.

    ucxcomm run --elastic -n 4 python examples/elastic_pool.py

The pattern (docs/elastic.md): do a round's work, exchange it, then ``agree`` on
whether the exchange completed everywhere; a round that did not is done again, on the
shrunk communicator when a member died. ``comm.events()`` reports the death as it
happens.
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


async def watch(comm: ucxcomm.Comm) -> None:
    async for event in comm.events():
        print(f"[rank {comm.rank}] event: {event}", flush=True)


async def main() -> None:
    comm = world = await ucxcomm.init()
    me = comm.rank  # (the world rank, for the messages)
    victim = comm.size - 1 if comm.size > 2 else None
    watcher = asyncio.ensure_future(watch(comm))
    results: dict[int, float] = {}
    remaining = list(range(TASKS))
    rounds = 0
    while remaining:
        rounds += 1
        batch = remaining[:PER_RANK * comm.size]
        mine = batch[comm.rank::comm.size]
        if me == victim and rounds == 3:
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
            old = comm
            comm = await comm.shrink()
            print(f"[rank {me}] round {rounds}: ranks {sorted(failed)} died; "
                  f"{'kept' if ok else 'redoing'} the round on {comm.size} ranks "
                  f"(now rank {comm.rank})", flush=True)
            if old is not world:  # (closing the world would end ucxcomm here)
                await old.close()  # (local: it has a dead member)
            watcher.cancel()
            watcher = asyncio.ensure_future(watch(comm))
    watcher.cancel()
    assert sorted(results) == list(range(TASKS)), "each task exactly once"
    total = math.fsum(results[t] for t in range(TASKS))
    serial = math.fsum(map(work, range(TASKS)))
    if comm.rank == 0:
        print(f"{TASKS} tasks in {rounds} rounds, finished by {comm.size} ranks; checksum "
              f"{total:.6f} (serial {serial:.6f})", flush=True)
    assert total == serial
    await comm.close()
    await ucxcomm.finalize()


if __name__ == "__main__":
    asyncio.run(main())
