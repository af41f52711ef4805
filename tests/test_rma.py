"""One-sided communication through real processes: remote memory (transport level) and
windows, at 1-4 ranks over the default transports and over TCP
(tests/spmd/rma_cases.py)."""

from __future__ import annotations

import pytest

from conftest import run_case

CASES = ["remote_memory", "shared_counter", "put_get_fence", "accumulate",
         "exclusive_locks", "out_of_range", "busy_target"]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CASES)
def test_rma(name, nranks):
    run_case("rma_cases.py", name, nranks)


@pytest.mark.parametrize("name", CASES)
def test_rma_over_tcp(name):
    """UCX emulates RMA and atomics over TCP: the targets' progress threads serve them."""
    run_case("rma_cases.py", name, 3, env={"UCX_TLS": "tcp,self"})


def test_work_queue_example():
    """examples/work_queue.py: every task handed out exactly once via Fetch_and_op."""
    import sys

    from conftest import launch

    proc = launch(3, [sys.executable, "examples/work_queue.py"], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "200 tasks over 3 ranks" in proc.stdout
