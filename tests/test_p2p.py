"""Point-to-point through real processes: every case on 1-4 ranks (3 = a non-power of two)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucxcomm.testing import OVER_TCP, run_case

P2P_CASES = Path(__file__).resolve().parent / "spmd" / "p2p_cases.py"

SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("nranks", SIZES)
@pytest.mark.parametrize("name", [
    "ring_objects", "buffers_all_kinds", "nonblocking_waitall", "any_source_fan_in",
    "self_messages", "truncation", "posted_receives", "irecv_at_the_call", "fast_path",
    "cancellation", "bad_input", "probe",
    "communicators", "barrier_and_timeouts",
])
def test_p2p(name, nranks):
    run_case(P2P_CASES, name, nranks)


@pytest.mark.parametrize("nranks", [2, 3])
def test_ordering_many_in_flight(nranks):
    run_case(P2P_CASES, "ordering_many_in_flight", nranks)


@pytest.mark.parametrize("nranks", [2, 3])
def test_peer_failure(nranks):
    proc = run_case(P2P_CASES, "peer_failure", nranks)
    assert "died or left" in proc.stderr


@pytest.mark.parametrize("split", ["", "0"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_split_rendezvous(nranks, split):
    """Large messages on one host through the split rendezvous (and, with
    UCXCOMM_P2P_SPLIT=0, through UCX's own: the same results, no split tallies)."""
    run_case(P2P_CASES, "split_rendezvous", nranks,
             env={"UCXCOMM_P2P_SPLIT": split} if split else None)


def test_split_closed_endpoint():
    """A split request matched after the endpoint to its sender was closed: PeerFailure,
    no control message on the released endpoint."""
    run_case(P2P_CASES, "split_closed_endpoint", 2)


@pytest.mark.parametrize("split", ["", "0"])
def test_split_peer_dies(split):
    proc = run_case(P2P_CASES, "split_peer_dies", 2,
                    env={"UCXCOMM_P2P_SPLIT": split} if split else None)
    assert "died or left" in proc.stderr


def test_send_to_exited_peer(tmp_path):
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    proc = run_case(P2P_CASES, "send_to_exited_peer", 2, env={"UCXCOMM_TEST_FIFO": str(fifo)})
    out = proc.stdout + proc.stderr  # (UCX logs to stdout)
    assert "UCX  ERROR" not in out and "UCX ERROR" not in out, out[-3000:]


def test_closed():
    run_case(P2P_CASES, "closed", 2)


@pytest.mark.parametrize("name", ["ring_objects", "buffers_all_kinds", "any_source_fan_in",
                                  "truncation", "posted_receives", "irecv_at_the_call",
                                  "fast_path", "cancellation"])
def test_p2p_over_tcp(name):
    """The same cases with UCX restricted to TCP (our fallback where there is no RDMA)."""
    run_case(P2P_CASES, name, 2, env=OVER_TCP)


def test_over_tcp_cases_ignore_an_exported_transport(monkeypatch):
    """Regression (found in issue 14): with UCXCOMM_TRANSPORT=rdma exported, as
    docs/transports.md says to run the suite on an RDMA host, the over-TCP cases
    inherited it and failed by design (rdma refuses TCP; here, with no RDMA at all,
    init fails). OVER_TCP pins the policy to auto for them."""
    monkeypatch.setenv("UCXCOMM_TRANSPORT", "rdma")
    run_case(P2P_CASES, "ring_objects", 2, env=OVER_TCP)


@pytest.mark.gpu
@pytest.mark.parametrize("nranks", [2, 3])
def test_gpu_buffers(nranks):
    """cupy buffers through UCX's CUDA transports (skipped without CUDA and cupy)."""
    run_case(P2P_CASES, "gpu_buffers", nranks)


@pytest.mark.gpu
@pytest.mark.parametrize("nranks", [2, 3])
def test_gpu_stream_order(nranks):
    """Regression (H200, 2026-12-04): GPU buffers went to UCX before the kernels writing
    them had run; gpu_buffers at 3 ranks then failed on every one of six tries."""
    run_case(P2P_CASES, "gpu_stream_order", nranks)


@pytest.mark.gpu
def test_gpu_stream_order_torch():
    """The same with torch CUDA tensors (their interface names no stream)."""
    pytest.importorskip("torch")
    run_case(P2P_CASES, "gpu_stream_order_torch", 2)
