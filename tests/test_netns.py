"""Ranks on separate 'hosts': network namespaces joined by a veth pair, talking TCP
between distinct addresses (our CI stand-in for a multi-host job). Needs root and
iproute2; the namespaces are created and removed by the test itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ucxcomm.testing import clean_env, run_ranks

pytestmark = pytest.mark.netns

PROG = str(Path(__file__).resolve().parent / "spmd" / "netns_prog.py")
SUBNET = "10.200.77"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:6]
    ns = [f"ucxc{tag}a", f"ucxc{tag}b"]
    veth = [f"vu{tag}a", f"vu{tag}b"]
    try:
        for n in ns:
            _ip("netns", "add", n)
            _ip("-n", n, "link", "set", "lo", "up")
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i, (n, v) in enumerate(zip(ns, veth, strict=True)):
            _ip("link", "set", v, "netns", n)
            _ip("-n", n, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", v)
            _ip("-n", n, "link", "set", v, "up")
        yield ns, [f"{SUBNET}.1", f"{SUBNET}.2"]
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


def test_two_hosts_over_tcp(two_hosts):
    ns, addrs = two_hosts
    port = 29655
    envs = []
    for rank in range(2):
        # torchrun-style variables; shared memory is visible across namespaces on one
        # machine, so restrict UCX to TCP as between real hosts.
        envs.append(dict(clean_env(), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=addrs[0],
                         MASTER_PORT=str(port - 1), UCX_TLS="tcp,self"))
    outs = run_ranks([["ip", "netns", "exec", n, sys.executable, PROG] for n in ns], envs,
                     "NETNS-OK rank {rank}")
    for out in outs:
        assert "tcp" in out and "vu" in out, out  # TCP over the veth, not loopback
