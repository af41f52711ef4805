"""What the flight recorder (docs/debugging.md) costs per operation, in one process.

Run: ``python benchmarks/recorder_cost.py [ROUNDS]``

A world of one rank sends to and receives from itself (no peer, no scheduler between two
ranks: the noise of a shared machine is mostly gone): 8 B ``Send`` + ``Recv`` (both
finish in their calls) and ``Irecv`` posted, 8 B ``Send``, ``await`` (a receive that
waits). Each is timed as the best of 20 batches, in a fresh process with the recorder on
(``UCXCOMM_TRACE_DEPTH=64``) and off (``0``), alternated ROUNDS times (default 3).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _selfloop import self_loops


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rows: dict[str, list[list[float]]] = {"on": [], "off": []}
    for i in range(rounds):
        for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
            env = dict(os.environ, UCXCOMM_TRACE_DEPTH="64" if side == "on" else "0")
            for k in ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "RANK", "WORLD_SIZE"):
                env.pop(k, None)
            got = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                                 capture_output=True, text=True, timeout=300).stdout
            rows[side].append([float(x) for x in got.split()])
    print("ns per iteration (best of 20 batches; one line per process)")
    for name, col in (("Send + Recv, 8 B, both finished in their calls", 0),
                      ("Irecv posted, Send 8 B, await (a receive that waits)", 1)):
        on = [r[col] for r in rows["on"]]
        off = [r[col] for r in rows["off"]]
        diff = sorted(on)[len(on) // 2] - sorted(off)[len(off) // 2]
        print(f"{name}: on {min(on):.0f}-{max(on):.0f}, off {min(off):.0f}-{max(off):.0f}, "
              f"difference of the medians {diff:+.0f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        asyncio.run(self_loops())
    else:
        main()
