"""Link cuts in a network-namespace cluster (ucxcomm/bench/netns.py): one rank per host,
UCX over TCP, a victim takes its own host's link down at the bridge in the middle of the
elastic fuzzer's workload (tests/spmd/elastic_fuzz_prog.py). Its peers hear nothing from
it (no reset, no end of stream) until ``UCXCOMM_LIVENESS_S``: the survivors must shrink,
check every result and finish; the cut rank must leave with ``PeerFailure`` (it lost the
store) and never go on as a job of its own; a store that a rank hosts on the minority
side of the partition must fence it (launch/store.py, "Partitions"). Needs root and
iproute2; every namespace is made and removed by the test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ucxcomm.bench.netns import unavailable

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parent.parent
TAIL = 6000
sys.path.insert(0, str(ROOT / "tools"))
import elastic_fuzz  # noqa: E402

_port = iter(range(23000, 24000))


@pytest.fixture(autouse=True)
def _needs_netns():
    why = unavailable()
    if why is not None:
        pytest.skip(f"needs a network-namespace cluster: {why}")


def _run(ranks: int, launcher: str, victims: dict[int, list]) -> str:
    sched = {"ranks": ranks, "rounds": elastic_fuzz.ROUNDS, "deadline": 60.0,
             "launcher": launcher, "victims": {str(v): a for v, a in victims.items()}}
    outcome, out = elastic_fuzz.run_netns(sched, 90.0, next(_port))
    assert outcome == "ok", f"{outcome}: {sched}\n{out[-TAIL:]}"
    return out


def test_torchrun_style_store_host_cut_off_is_fenced():
    """Rank 0 hosts the store and is cut off: ranks 1 and 2 go on with rank 1's standby;
    rank 0's store, which now hears from nobody, refuses to decide instead of making
    rank 0 a job of one (before fencing: FUZZ-OK rank 0 ... members [0])."""
    out = _run(3, "torchrun", {0: [1, "ring", "cut", None]})
    assert "FUZZ-OUT rank 0: " in out and "minority of a network partition" in out, out
    for r in (1, 2):
        assert f"FUZZ-OK rank {r} rounds 4 size 2 recoveries 1 members [1, 2]" in out, out


def test_torchrun_style_standby_host_cut_off_is_fenced():
    """Rank 1 (the standby's host) is cut off: its standby takes over, hears from nobody
    and fences; ranks 0, 2, 3 go on with the primary."""
    out = _run(4, "torchrun", {1: [2, "allgather", "cut", None]})
    assert "minority of a network partition" in out, out
    assert "FUZZ-OK rank 3 rounds 4 size 3 recoveries 1 members [0, 2, 3]" in out, out


def test_a_store_outside_the_ranks_is_the_arbiter():
    """With the store outside the ranks (UCXCOMM_STORE), a cut rank simply loses it, and
    even a lone survivor of three goes on: nothing is fenced."""
    out = _run(3, "arbiter", {0: [1, "allreduce_big", "cut", None],
                              1: [2, "window", "cut", None]})
    assert "FUZZ-OK rank 2 rounds 4 size 1 recoveries " in out, out
    assert "minority" not in out, out


def test_a_cut_and_a_kill_together():
    _run(4, "arbiter", {1: [0, "bcast", "cut", None], 3: [2, "ring_big", "kill", None]})


def test_a_healed_link_brings_no_stale_data():
    """The link comes back after the cut rank was declared dead: it must not rejoin its
    old communicators (it is out or fenced), and the survivors see no stale byte."""
    _run(3, "torchrun", {2: [1, "ring_big", "cut", 3 * elastic_fuzz.NETNS_LIVENESS_S]})


def test_random_link_cut_schedules(capsys):
    """A few random schedules of ``tools/elastic_fuzz.py --netns``; the seed is printed
    (UCXCOMM_FUZZ_SEED sets it): ``python tools/elastic_fuzz.py --netns --seed S``
    replays them."""
    import random

    seed = int(os.environ.get("UCXCOMM_FUZZ_SEED") or random.randrange(1 << 31))
    with capsys.disabled():
        print(f"\nelastic fuzz --netns seed {seed}")
    failures: list[str] = []
    counts = elastic_fuzz.fuzz(4, seed, timeout=90.0, log=failures.append, netns=True)
    assert counts["ok"] == 4, f"seed {seed}: {counts}\n" + "\n".join(failures)[-TAIL:]
