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


LAUNCHER_VARS = ("UCXCOMM_", "RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "OMPI_", "PMI_",
                 "MPI_LOCALNRANKS", "LOCAL_RANK", "TORCHELASTIC")


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}


def run_ranks(commands: list[list[str]], envs: list[dict[str, str]], ok_line: str,
              timeout: float = 90.0) -> list[str]:
    """Start one process per rank (no launcher in between), wait for all (killing any
    left at the deadline), require exit 0 and ``ok_line.format(rank=r)`` from each.
    Returns each rank's stdout."""
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for cmd, env in zip(commands, envs, strict=True)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out}\n{err[-4000:]}"
        assert ok_line.format(rank=r) in out, f"rank {r}:\n{out}\n{err[-4000:]}"
    return [out for out, _ in outs]


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
