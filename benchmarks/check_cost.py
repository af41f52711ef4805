"""What collective fingerprints (``UCXCOMM_CHECK_COLLECTIVES``, docs/debugging.md) cost.

Run: ``python benchmarks/check_cost.py [ROUNDS] [--sizes 2,4] [--calls Allreduce,...]
[--json FILE]`` (``--calls``: the rows printed, by the call's name).

For each communicator size, ``ucxcomm run -n N`` starts the rank program below with the
checks on (``1``) and off (``0``), alternated ROUNDS times (default 3, the order flipped
every round; ranks bound to cores where there are enough). Each rank times 8 B
``Allreduce`` (the issue's budget: at most 2 % of its time), 8 B ``Bcast``,
``Allgather``, ``Alltoall``, ``barrier``, and 64 KiB ``Bcast`` (the general form: a
round of fingerprints before the data) as the best of 15 batches, every
batch started together (a barrier); rank 0 prints the slowest rank's best per call. The
table gives each call's median and minimum over the rounds, on and off, and their
ratios.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

CALLS = ("Allreduce 8B", "Bcast 8B", "Allgather 8B", "Alltoall 8B", "barrier", "Bcast 64KiB")


async def _rank() -> None:
    import numpy as np

    import ucxcomm

    comm = await ucxcomm.init()
    p = comm.size
    a, b = np.ones(1), np.empty(1)
    g = np.empty(p)
    s, t = np.ones(p), np.empty(p)
    big = np.ones(8192)
    calls = {
        "Allreduce 8B": (lambda: comm.Allreduce(a, b), 4000),
        "Bcast 8B": (lambda: comm.Bcast(b, 0), 4000),
        "Allgather 8B": (lambda: comm.Allgather(a, g), 4000),
        "Alltoall 8B": (lambda: comm.Alltoall(s, t), 4000),
        "barrier": (lambda: comm.barrier(), 4000),
        "Bcast 64KiB": (lambda: comm.Bcast(big, 0), 500),
    }
    out = {}
    wanted = os.environ.get("CHECK_COST_CALLS", ",".join(CALLS)).split(",")
    for name in CALLS:
        if name not in wanted:
            continue
        fn, n = calls[name]
        if p > 2:
            n //= 4
        for _ in range(n // 4):
            await fn()
        best = float("inf")
        for _ in range(15):
            await comm.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                await fn()
            best = min(best, (time.perf_counter() - t0) / n)
        out[name] = max(await comm.allgather(best)) * 1e6
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    await comm.close()


def _run(n: int, checks: str, calls: list[str]) -> dict[str, float]:
    env = dict(os.environ, UCXCOMM_CHECK_COLLECTIVES=checks, CHECK_COST_CALLS=",".join(calls))
    for k in ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    bind = ["--bind-to", "core"] if n <= (os.cpu_count() or 1) else []
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "run", "-n", str(n), *bind,
                           "--timeout", "600", sys.executable, __file__, "--rank"],
                          env=env, capture_output=True, text=True, timeout=700, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"rank program failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def main() -> None:
    args = sys.argv[1:]
    if args == ["--rank"]:
        asyncio.run(_rank())
        return
    sizes, path = [2, 4], None
    if "--sizes" in args:
        i = args.index("--sizes")
        sizes = [int(x) for x in args[i + 1].split(",")]
        del args[i:i + 2]
    calls = list(CALLS)
    if "--calls" in args:
        i = args.index("--calls")
        calls = [c for c in CALLS if c.split()[0] in args[i + 1].split(",")]
        del args[i:i + 2]
    if "--json" in args:
        i = args.index("--json")
        path = args[i + 1]
        del args[i:i + 2]
    rounds = int(args[0]) if args else 3
    lines = []
    for n in sizes:
        rows: dict[str, list[dict[str, float]]] = {"1": [], "0": []}
        for i in range(rounds):
            for checks in (("1", "0") if i % 2 == 0 else ("0", "1")):
                got = _run(n, checks, calls)
                rows[checks].append(got)
                lines.append({"ranks": n, "checks": checks, "round": i, **got})
        bound = " (ranks bound to cores)" if n <= (os.cpu_count() or 1) else ""
        print(f"\n{n} ranks{bound}, {rounds} rounds: median (min) in us per call, the "
              "slowest rank's best batch")
        print(f"{'call':<14} {'checks on':>16} {'off':>16} {'on/off':>14}")
        for name in calls:
            on = [r[name] for r in rows["1"]]
            off = [r[name] for r in rows["0"]]
            mon, moff = statistics.median(on), statistics.median(off)
            print(f"{name:<14} {mon:>8.2f} ({min(on):5.2f}) {moff:>8.2f} ({min(off):5.2f}) "
                  f"{mon / moff:>6.3f} ({min(on) / min(off):.3f})")
    if path:
        with open(path, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
