"""``ucxcomm bench elastic``: what surviving a death costs (docs/elastic.md).

Every figure comes from jobs of ``ucxcomm run --elastic`` on this host:

* **detect-to-shrunk**: the ranks loop an 8 B ``Allreduce``; the last rank kills itself
  (SIGKILL) at a random iteration, printing its monotonic clock just before; each
  survivor catches the failure, revokes, agrees and shrinks, and prints its clock once it
  holds the shrunk communicator. A trial's figure is the slowest survivor's. p50 and p99
  over the trials, at 2, 4 and 8 ranks (one job per trial).
* **revoke**: at 4 ranks, rank 0 revokes a fresh communicator while the others are
  blocked in a receive on it; the time to the last one's ``Revoked`` (20 trials, one
  job).
* **rejoin**: with ``--max-restarts 1``, the time from the replacement's process start
  (``/proc/self/stat``, 10 ms resolution) to its ``init()`` returning the grown
  communicator (Python and UCX start-up included); the survivors call ``grow`` as soon as
  they agreed.
* **bandwidth before and after a shrink**: at 4 ranks, rank 0 streams 4 MiB messages to
  rank 1 (4 in flight) on the world communicator, rank 3 dies, and the same on the
  shrunk communicator; best of 5 batches each.

Run: ``ucxcomm bench elastic [--quick] [--json OUT.jsonl]`` (or ``python -m
ucxcomm.bench.elastic``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main", "run"]

BW_BYTES = 4 << 20
BW_WINDOW = 4


# ------------------------------------------------------------------ rank side
def _started_s() -> float:
    """This process's start, in CLOCK_BOOTTIME seconds (``/proc/self/stat``)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


async def _bandwidth(comm: Any) -> float:
    """GB/s of rank 0 streaming to rank 1 on ``comm`` (the others wait), best batch."""
    import numpy as np

    buf = np.ones(BW_BYTES, np.uint8)
    best = 0.0
    for _ in range(5):
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(8):
            if comm.rank == 0:
                await asyncio.gather(*(comm.Isend(buf, 1, tag=1) for _ in range(BW_WINDOW)))
            elif comm.rank == 1:
                await asyncio.gather(*(comm.Irecv(buf, 0, tag=1) for _ in range(BW_WINDOW)))
        if comm.rank == 1:
            await comm.Send(buf[:1], 0, tag=2)
        elif comm.rank == 0:
            await comm.Recv(buf[:1], 1, tag=2)
        best = max(best, 8 * BW_WINDOW * BW_BYTES / (time.perf_counter() - t0) / 1e9)
    return best


async def _revoke_trials(comm: Any, trials: int = 20) -> None:
    """Rank 0 revokes a fresh dup while every other rank is blocked in a receive on it;
    prints the time from the revoke to the last rank's ``Revoked``, per trial."""
    import numpy as np

    import ucxcomm

    for _ in range(trials):
        c = await comm.dup()
        if comm.rank == 0:
            for s in range(1, comm.size):
                await comm.recv(s, tag=3)  # (each is about to block)
            t0 = time.monotonic()
            c.revoke()
        else:
            req = c.Irecv(np.empty(1), 0, tag=4)
            await comm.send(None, 0, tag=3)
            try:
                await req
            except ucxcomm.Revoked:
                pass
            t0 = time.monotonic()
        got = await comm.gather(t0, root=0)
        if comm.rank == 0:
            print(f"REVOKE {max(got[1:]) - got[0]:.6f}", flush=True)
        await c.close()


async def _rank(mode: str) -> None:
    import numpy as np

    import ucxcomm
    from ucxcomm import settings

    restart = settings.get("UCXCOMM_RESTART_COUNT")
    comm = await ucxcomm.init()
    if mode == "revoke":
        await _revoke_trials(comm)
        await ucxcomm.finalize()
        return
    if restart:  # the replacement (mode "rejoin")
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        print(f"REJOIN {now - _started_s():.4f}", flush=True)
        await comm.barrier()
        await ucxcomm.finalize()
        return
    p, victim = comm.size, comm.size - 1
    if mode == "bandwidth":
        before = await _bandwidth(comm)
    kill_at = int(os.environ.get("ELASTIC_KILL_AT", "50"))
    x, y = np.ones(1), np.empty(1)
    i = 0
    try:
        while True:
            if comm.rank == victim and i == kill_at:
                print(f"KILL {time.monotonic():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            await comm.Allreduce(x, y)
            i += 1
    except (ucxcomm.PeerFailure, ucxcomm.Revoked):
        comm.revoke()
    _, failed = await comm.agree(True, timeout=30)
    assert failed == {victim}, failed
    if mode == "rejoin":
        new = await comm.grow(timeout=60)
        await new.barrier()
        await new.close()
    else:
        new = await comm.shrink(timeout=30)
        print(f"SHRUNK {comm.rank} {time.monotonic():.6f}", flush=True)
        if mode == "bandwidth":
            after = await _bandwidth(new)
            if comm.rank == 0:
                print(f"BW {before:.4f} {after:.4f}", flush=True)
        await new.close()
    await ucxcomm.finalize()
    assert p >= 2


# ------------------------------------------------------------------ driver side
def _job(n: int, mode: str, timeout: float) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "RANK", "WORLD_SIZE",
                        "UCXCOMM_RESTART_COUNT")}
    env["ELASTIC_KILL_AT"] = str(random.randrange(20, 200))
    cmd = [sys.executable, "-m", "ucxcomm.cli", "run", "--elastic", "-n", str(n),
           "--timeout", str(timeout)]
    if mode == "rejoin":
        cmd += ["--max-restarts", "1"]
    cmd += [sys.executable, "-m", "ucxcomm.bench.elastic", "--rank", mode]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=timeout + 30, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"elastic {mode} job at {n} ranks failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(sizes: tuple[int, ...] = (2, 4, 8), trials: int = 20,
        timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every measurement; a record per trial."""
    records: list[dict[str, Any]] = []
    for n in sizes:
        for t in range(trials):
            lines = _job(n, "shrink", timeout)
            kill = next(float(x.split()[1]) for x in lines if x.startswith("KILL "))
            shrunk = [float(x.split()[2]) for x in lines if x.startswith("SHRUNK ")]
            assert len(shrunk) == n - 1, lines
            records.append({"what": "detect_to_shrunk", "ranks": n, "trial": t,
                            "seconds": max(shrunk) - kill})
    for line in _job(4, "revoke", timeout):
        if line.startswith("REVOKE "):
            records.append({"what": "revoke", "ranks": 4, "seconds": float(line.split()[1])})
    for t in range(max(3, trials // 4)):
        lines = _job(3, "rejoin", timeout)
        records.append({"what": "rejoin", "ranks": 3, "trial": t,
                        "seconds": next(float(x.split()[1]) for x in lines
                                        if x.startswith("REJOIN "))})
    for t in range(3):
        lines = _job(4, "bandwidth", timeout)
        before, after = (float(v) for v in
                         next(x for x in lines if x.startswith("BW ")).split()[1:])
        records.append({"what": "bandwidth", "ranks": 4, "trial": t, "before_GBps": before,
                        "after_GBps": after})
    return records


def table(records: list[dict[str, Any]]) -> str:
    out = ["detect-to-shrunk (kill -9 -> every survivor holds the shrunk communicator):"]
    for n in sorted({r["ranks"] for r in records if r["what"] == "detect_to_shrunk"}):
        ms = [r["seconds"] * 1e3 for r in records
              if r["what"] == "detect_to_shrunk" and r["ranks"] == n]
        out.append(f"  {n} ranks: p50 {_pct(ms, 0.5):7.1f} ms  p99 {_pct(ms, 0.99):7.1f} ms  "
                   f"max {max(ms):7.1f} ms  ({len(ms)} trials)")
    revoke = [r["seconds"] * 1e3 for r in records if r["what"] == "revoke"]
    if revoke:
        out.append(f"revoke (rank 0 revokes -> the last of 3 ranks blocked in a receive "
                   f"raises Revoked), 4 ranks: p50 {_pct(revoke, 0.5):.2f} ms, max "
                   f"{max(revoke):.2f} ms ({len(revoke)} trials)")
    rejoin = [r["seconds"] for r in records if r["what"] == "rejoin"]
    if rejoin:
        out.append(f"rejoin (replacement's start -> its init() returns the grown "
                   f"communicator), 3 ranks: median {statistics.median(rejoin):.2f} s, "
                   f"max {max(rejoin):.2f} s ({len(rejoin)} trials)")
    bw = [r for r in records if r["what"] == "bandwidth"]
    if bw:
        ratios = [r["after_GBps"] / r["before_GBps"] for r in bw]
        out.append("bandwidth rank 0 -> 1, 4 MiB x 4 in flight, 4 ranks, before / after a "
                   "shrink: " + ", ".join(f"{r['before_GBps']:.2f} / {r['after_GBps']:.2f} "
                                          "GB/s" for r in bw)
                   + f"; after/before median {statistics.median(ratios):.3f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--rank"]:
        asyncio.run(_rank(args[1]))
        return 0
    quick = "--quick" in args
    path = args[args.index("--json") + 1] if "--json" in args else None
    records = run(trials=3 if quick else 20)
    print(table(records))
    if path:
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
