"""Collectives through real processes on 1-4 ranks (3 = a non-power of two), checked
against numpy references (tests/spmd/coll_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucxcomm.testing import OVER_TCP, run_case

COLL_CASES = Path(__file__).resolve().parent / "spmd" / "coll_cases.py"

SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("nranks", SIZES)
@pytest.mark.parametrize("name", [
    "allreduce_ops_dtypes", "allreduce_large_and_in_place", "bcast_reduce_every_root",
    "gather_scatter_allgather", "v_variants", "alltoall_and_reduce_scatter", "scans",
    "objects", "nonblocking_overlap", "bad_input", "tuning_switch_points",
    "small_paths_match_general", "object_buffers_refused",
])
def test_collectives(name, nranks):
    run_case(COLL_CASES, name, nranks)


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_object_collective_failures_reach_every_rank(nranks):
    run_case(COLL_CASES, "object_collective_failures_reach_every_rank", nranks)


def test_member_death_fails_every_rank():
    proc = run_case(COLL_CASES, "member_death", 3)
    assert "died or left" in proc.stderr


@pytest.mark.parametrize("checks", ["1", "0"])
def test_mismatched_sizes_named(checks):
    run_case(COLL_CASES, "mismatched_sizes_named", 2, env={"UCXCOMM_CHECK_COLLECTIVES": checks})


@pytest.mark.parametrize("checks", ["1", "0"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_mismatched_sizes_named_when_the_receive_waits(nranks, checks):
    """Regression (flaky before: ~2 runs in 12): a compiled small collective whose receive
    had to wait (no spinning, the root arrives late) did not check the message's size:
    the overflowing Bcast raised nothing on the receiving rank (3 ranks: the group path)."""
    run_case(COLL_CASES, "mismatched_sizes_named", nranks,
             env={"UCXCOMM_SPIN_US": "0", "UCXCOMM_TEST_LATE_ROOT": "1",
                  "UCXCOMM_CHECK_COLLECTIVES": checks})


@pytest.mark.parametrize("name", ["two_rank_compiled_allreduce", "two_rank_compiled_others",
                                  "closed_two_rank_allreduce"])
def test_two_rank_compiled_allreduce(name):
    run_case(COLL_CASES, name, 2)


@pytest.mark.parametrize("name", ["group_compiled_allreduce", "group_compiled_others"])
@pytest.mark.parametrize("nranks", [3, 4, 8])
def test_group_compiled_collectives(name, nranks):
    run_case(COLL_CASES, name, nranks)


def test_cancelled_collective():
    run_case(COLL_CASES, "cancelled_collective", 2)


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_every_collective_takes_a_timeout(nranks):
    run_case(COLL_CASES, "every_collective_takes_a_timeout", nranks)


def test_collective_timeout_leaves_the_communicator_out_of_step():
    run_case(COLL_CASES, "collective_timeout_leaves_the_communicator_out_of_step", 2)


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_window_timeouts_and_async_with(nranks):
    run_case(COLL_CASES, "window_timeouts_and_async_with", nranks)


@pytest.mark.parametrize("name", ["allreduce_large_and_in_place", "objects",
                                  "alltoall_and_reduce_scatter"])
def test_collectives_over_tcp(name):
    """The same cases with UCX restricted to TCP."""
    run_case(COLL_CASES, name, 3, env=OVER_TCP)


@pytest.mark.gpu
@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_gpu_collectives(nranks):
    """cupy buffers: device reductions, CUDA transports (skipped without CUDA and cupy)."""
    run_case(COLL_CASES, "gpu_collectives", nranks)


@pytest.mark.parametrize("hosts", ["0,0,1,1", "0,0,0,1,1", "0,1,1", "0,1,0,1", "a,b,b,c,c,c"])
def test_hierarchical_collectives(hosts):
    """Ranks on several hosts (host labels), some sharing one: the large Allreduce,
    Allgather(v) and Reduce_scatter(_block) go through one leader per host (results and
    each rank's traffic checked); interleaved hosts keep the flat ring for the block
    collectives."""
    run_case(COLL_CASES, "hierarchical_collectives", len(hosts.split(",")),
             env={"UCXCOMM_TEST_HOSTS": hosts}, timeout=180)


@pytest.mark.parametrize("hosts", ["a,b,c,d", "0,0,1,1,2"])
def test_alltoall_across_hosts(hosts):
    """Alltoall(v) across hosts: mid-size blocks one pairwise step at a time (counted),
    the others all at once, and an Alltoallv whose ranks choose differently."""
    run_case(COLL_CASES, "alltoall_across_hosts", len(hosts.split(",")),
             env={"UCXCOMM_TEST_HOSTS": hosts}, timeout=120)


def test_bcast_across_hosts():
    """Every rank on a host of its own: Bcast from 64 KiB is the chain (each rank sends
    the message once), below it the tree."""
    run_case(COLL_CASES, "bcast_across_hosts", 4, env={"UCXCOMM_TEST_HOSTS": "a,b,c,d"},
             timeout=120)


@pytest.mark.parametrize("nranks", [3, 4, 5])
def test_bcast_chain(nranks):
    """Large Bcast at 3 ranks or more off the engine (a pipelined chain): odd sizes,
    every root; each rank but the last sends the message once."""
    run_case(COLL_CASES, "bcast_chain", nranks, env={"UCXCOMM_SHM": "0"})
