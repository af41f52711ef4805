"""A bounded soak: 4 ranks each send 20,000 objects of mixed sizes (0 B to 200 KB, bytes
and arrays) and tags to random ranks, receiving with named, ANY_SOURCE and ANY_TAG
receives, 5 % of them cancelled at once (tests/spmd/soak_prog.py). Nothing may be lost,
duplicated, reordered or corrupted, and RSS must stay flat once warm (issue 15)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ucxcomm.testing import launch

PROG = str(Path(__file__).resolve().parent / "spmd" / "soak_prog.py")
NRANKS = 4
COUNT = 20_000
#: RSS growth allowed over the second half of the run (10,000 messages a rank). Measured
#: here: 2-5 MiB, once a 9 MiB step as a pool grew, once (a fresh-clone CI run,
#: 2026-12-03) 24.5 MiB: UCX's pools keep their high-water mark, and a burst of
#: unexpected eager messages can step them up twice (docs/design.md, "Memory of
#: unexpected messages"); RSS then stays put (an 80,000-message run grew 1-2 MiB after
#: 20,000). A leak of 3.3 KB a message would exceed the bound; without the rounds
#: (senders far ahead of a receiver), RSS grew 90+ MiB over the same stretch.
GROWTH_MIB = 32.0
_LINE = re.compile(r"SOAK (\d+) sent (\d+) received (\d+) cancelled (\d+) seconds ([\d.]+) "
                   r"rss_mib start ([\d.]+) warm ([\d.]+) max ([\d.]+) end ([\d.]+)")


@pytest.mark.timeout(400)
def test_soak_nothing_lost_rss_flat():
    proc = launch(NRANKS, [sys.executable, PROG, str(COUNT)], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = {int(m[1]): m for m in _LINE.finditer(proc.stdout)}
    assert sorted(rows) == list(range(NRANKS)), out[-4000:]
    received = sum(int(m[3]) for m in rows.values())
    assert received == NRANKS * COUNT  # (each rank also checked its own share, in order)
    for r, m in sorted(rows.items()):
        warm, peak = float(m[7]), float(m[8])
        assert peak - warm < GROWTH_MIB, f"rank {r}: RSS {warm} -> {peak} MiB\n{m[0]}"
        print(f"rank {r}: sent {m[2]}, received {m[3]} ({m[4]} cancelled receives) in "
              f"{m[5]} s; RSS MiB start {m[6]}, warm {m[7]}, max after {m[8]}, end {m[9]}")


UNEXPECTED_PROG = str(Path(__file__).resolve().parent / "spmd" / "unexpected_prog.py")
_UNEXP = re.compile(r"UNEXPECTED cycle (\d+) rss_mib ([-\d.]+) objects (-?\d+)")


@pytest.mark.timeout(300)
def test_unexpected_backlog_memory_is_reused_not_leaked():
    """Two senders post 4,000 sends each to rank 0 before it receives any, four times
    over (tests/spmd/unexpected_prog.py). The first backlog raises rank 0's RSS by what
    UCX buffered for the early arrivals (~190 MiB here: docs/design.md, "Memory of
    unexpected messages"); once drained, that memory is reused: later cycles add almost
    nothing. Memory kept for consumed messages would add as much again every cycle."""
    proc = launch(3, [sys.executable, UNEXPECTED_PROG, "4000", "4"], timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [(float(m[2]), int(m[3])) for m in _UNEXP.finditer(proc.stdout)]
    assert len(rows) == 4, out[-4000:]
    first = rows[0][0]
    later = rows[-1][0] - rows[1][0]
    assert later < max(16.0, 0.25 * first), f"RSS after each drain (MiB): {rows}"
    assert rows[-1][1] < 1000, f"Python objects left after each drain: {rows}"
    print(f"RSS over the start after each drain (MiB): {[r for r, _ in rows]}")
