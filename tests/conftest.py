"""Shared test helpers: run SPMD programs through our own launcher, with deadlines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPMD = ROOT / "tests" / "spmd"


def launch(nranks: int, argv: list[str], *, timeout: float = 90.0, env: dict | None = None,
           tag_output: bool = True) -> subprocess.CompletedProcess:
    """``ucxcomm run -n N`` a program; the launcher's own --timeout fires first (stack
    dumps from every rank), the subprocess timeout is the outer deadline."""
    cmd = [sys.executable, "-m", "ucxcomm.cli", "run", "-n", str(nranks),
           "--timeout", str(timeout)]
    if tag_output:
        cmd.append("--tag-output")
    cmd += argv
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                          env=full_env, cwd=ROOT, stdin=subprocess.DEVNULL)


def run_case(script: str, name: str, nranks: int, *, timeout: float = 90.0,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run SPMD case ``name`` of ``tests/spmd/<script>`` on ``nranks`` ranks and require
    that it exits 0 and that every rank reported success."""
    proc = launch(nranks, [sys.executable, str(SPMD / script), name], timeout=timeout,
                  env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    for r in range(nranks):
        assert f"CASE-OK {name} rank {r}" in proc.stdout, f"rank {r} did not finish\n{out[-6000:]}"
    return proc


def pytest_collection_modifyitems(config, items):
    try:
        import cupy

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs CUDA and cupy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
