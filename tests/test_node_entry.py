"""ci/softroce/node-entry.sh, the soft-RoCE node entrypoint of the Docker kit and the VM
harness: what can run without an RDMA device — its refusals, each before it touches any
device. (The device checks and the ranks run in the VM harness.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ucxcomm.testing import clean_env

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "ci" / "softroce" / "node-entry.sh"


def entry(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ENTRY), *args], capture_output=True, text=True, timeout=60,
                          env=dict(clean_env(), **env), stdin=subprocess.DEVNULL)


def test_it_is_executable():
    assert os.access(ENTRY, os.X_OK)


def test_a_program_is_required_unless_checking():
    proc = entry()
    assert proc.returncode == 2
    assert proc.stderr == f"usage: {ENTRY} [--check] [--] PROGRAM [ARGS...]\n"


@pytest.mark.parametrize("env, message", [
    ({"NODE_RANK": "2", "NNODES": "2"},
     "node-entry: NODE_RANK=2 must be below NNODES=2 and NPROC_PER_NODE=1 at least 1\n"),
    ({"NPROC_PER_NODE": "two"},
     "node-entry: NODE_RANK, NNODES, NPROC_PER_NODE and NODE_TIMEOUT must be non-negative "
     "integers (got 'two')\n"),
    ({"NODE_CHECKS": "some"},
     "node-entry: NODE_CHECKS must be full or devices (got 'some')\n"),
    ({"RXE_NETDEV": "nonexistent0"},
     "node-entry[0]: no network interface nonexistent0 (set RXE_NETDEV)\n"),
])
def test_bad_placement_or_interface_fails_before_any_device(env, message):
    proc = entry("--check", **env)
    assert proc.returncode == 2 and proc.stderr == message, proc.stderr
    assert proc.stdout == ""  # (it creates a device only after these checks)
