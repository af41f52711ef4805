"""One-sided communication through real processes: remote memory (transport level) and
windows, at 1-4 ranks over the default transports and over TCP
(tests/spmd/rma_cases.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ucxcomm.testing import OVER_TCP, launch, run_case

ROOT = Path(__file__).resolve().parent.parent
RMA_CASES = ROOT / "tests" / "spmd" / "rma_cases.py"
RMA_CONFIG = ROOT / "tests" / "spmd" / "rma_config_prog.py"

CASES = ["remote_memory", "allocated_memory", "shared_counter", "put_get_fence", "accumulate",
         "exclusive_locks", "out_of_range", "busy_target"]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CASES)
def test_rma(name, nranks):
    run_case(RMA_CASES, name, nranks)


@pytest.mark.parametrize("name", CASES)
def test_rma_over_tcp(name):
    """UCX emulates RMA and atomics over TCP: the targets' progress threads serve them."""
    run_case(RMA_CASES, name, 3, env=OVER_TCP)


@pytest.mark.parametrize("nranks", [2, 3])
def test_lock_holder_dies(nranks):
    run_case(RMA_CASES, "lock_holder_dies", nranks, timeout=60)


def test_close_without_free_is_quiet():
    proc = run_case(RMA_CASES, "close_without_free", 2)
    out = proc.stdout + proc.stderr  # (UCX logs to stdout)
    assert "UCX" not in out, out[-3000:]


def test_work_queue_example():
    """examples/work_queue.py: every task handed out exactly once via Fetch_and_op."""
    proc = launch(3, [sys.executable, "examples/work_queue.py"], timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "200 tasks over 3 ranks" in proc.stdout


def _rma_config_reports(mode: str) -> list[dict]:
    proc = launch(2, [sys.executable, str(RMA_CONFIG), mode], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads(line.split("RMA-LANES ", 1)[1])
               for line in proc.stdout.splitlines() if "RMA-LANES " in line]
    assert len(reports) == 2, proc.stdout + proc.stderr
    return reports


def test_ucx_config_reaches_one_sided_traffic():
    """Regression: the RMA engines' UCX context was built from the environment only, so
    ``init(ucx_config={"TLS": "tcp,self"})`` moved tag messages over TCP but window
    traffic over shared memory. Now both contexts get the same options."""
    for rep in _rma_config_reports("ucx_config"):
        peer = str(1 - rep["rank"])
        assert {tl for tl, _ in rep["tag"][peer]} == {"tcp"}, rep
        assert {tl for tl, _ in rep["rma"][peer]} == {"tcp"}, rep  # sysv/posix/cma before
        assert [o["TLS"] for o in rep["rma_options"]] == ["tcp,self"] * 2, rep
        assert rep["direct"] == {"0": False, "1": False}, rep  # tcp: the target's thread


def test_transport_plan_reaches_one_sided_traffic():
    """``init(transport="tcp")`` (plan: UCX_TLS=tcp,sm,self) configures the RMA engines
    too: the bulk one as planned, the atomics one with UCX_PROTO_ENABLE=n on top."""
    for rep in _rma_config_reports("tcp"):
        plan = {"TLS": "tcp,sm,self", "RESOLVE_REMOTE_EP_ID": "y"}
        assert rep["rma_options"] == [plan, {**plan, "PROTO_ENABLE": "n"}], rep
        peer = str(1 - rep["rank"])
        assert rep["rma"][peer] and {tl for tl, _ in rep["rma"][peer]} <= {
            "tcp", "sysv", "posix", "cma", "self"}, rep


def test_allocated_windows_are_reached_directly():
    """``Win.Allocate`` memory comes from UCX (shared-memory capable): a peer on this host
    does atomics on it directly, not through the owner's emulation thread (before, every
    fetch-and-op took that detour: ~8 us instead of ~0.3). A window over the caller's
    numpy array is not shared memory, so its atomics keep the detour."""
    for rep in _rma_config_reports("default"):
        assert rep["direct"] == {"0": True, "1": True}, rep
        assert rep["direct_created"][str(1 - rep["rank"])] is False, rep
