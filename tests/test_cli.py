"""``ucxcomm info`` tells what this machine's UCX can do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_info_json():
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "info", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ucx_version"].startswith("1.")
    assert "libucp.so" in report["libucp"]
    assert report["self_endpoint_lanes"]
    # Answers are booleans, explanations apart (issue 15: the JSON mixed prose and yes/no).
    for key in ("verbs", "rdmacm", "rdma", "tag_offload", "cuda_support"):
        assert isinstance(report[key], bool), (key, report[key])
    if not os.path.isdir("/sys/class/infiniband"):
        assert report["rdma_devices"] == [] and report["rdma"] is False
        assert report["rdma_why"].startswith("no RDMA device under /sys/class/infiniband")
    if not report["verbs"]:
        assert "UCXCOMM_UCX" in report["verbs_why"]


def test_help_is_for_users():
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "--help"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and "run" in proc.stdout and "info" in proc.stdout
    assert "parses argv" not in proc.stdout  # (an internal note used to be the help)


def test_info_table():
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "info"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "ucx_version" in proc.stdout and "cuda_support" in proc.stdout
