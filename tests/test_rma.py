"""One-sided communication through real processes: remote memory (transport level) and
windows, at 1-4 ranks over the default transports and over TCP
(tests/spmd/rma_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucxcomm.testing import launch, run_case

ROOT = Path(__file__).resolve().parent.parent
RMA_CASES = ROOT / "tests" / "spmd" / "rma_cases.py"

CASES = ["remote_memory", "shared_counter", "put_get_fence", "accumulate",
         "exclusive_locks", "out_of_range", "busy_target"]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CASES)
def test_rma(name, nranks):
    run_case(RMA_CASES, name, nranks)


@pytest.mark.parametrize("name", CASES)
def test_rma_over_tcp(name):
    """UCX emulates RMA and atomics over TCP: the targets' progress threads serve them."""
    run_case(RMA_CASES, name, 3, env={"UCX_TLS": "tcp,self"})


def test_work_queue_example():
    """examples/work_queue.py: every task handed out exactly once via Fetch_and_op."""
    import sys

    proc = launch(3, [sys.executable, "examples/work_queue.py"], timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "200 tasks over 3 ranks" in proc.stdout
