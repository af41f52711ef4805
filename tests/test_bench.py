"""``ucxcomm bench`` (issue 13): the sweeps run end to end and their JSON and PNG parse;
bad options fail before anything runs. Timings are never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucxcomm.bench import driver, launchers
from ucxcomm.bench.spec import SUITES, applies, parse_sizes
from ucxcomm.testing import clean_env

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"impl", "op", "size", "nranks", "unit", "median", "min", "max", "suite", "settings"}


def bench(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucxcomm.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=clean_env(), stdin=subprocess.DEVNULL)


def records(path: Path) -> list[dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        assert FIELDS <= r.keys(), r
        assert 0 < r["min"] <= r["median"] <= r["max"], r
    return recs


def test_p2p_smoke_writes_json_and_png(tmp_path):
    """What CI runs: every p2p op of ucxcomm at both sizes, the installed peers beside it,
    a PNG that is one."""
    out, png = tmp_path / "p2p.jsonl", tmp_path / "p2p.png"
    proc = bench("p2p", "--quick", "--sizes", "8,1M", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(out)
    ours = {(r["op"], r["size"]) for r in recs if r["impl"] == "ucxcomm"}
    assert ours == {(op, s) for op in SUITES["p2p"] for s in (8, 1 << 20)}
    assert {r["settings"]["transport"] for r in recs} == {"shm"}
    assert all(r["settings"]["binding"].startswith("one core per rank") for r in recs)
    peers = {r["impl"] for r in recs} - {"ucxcomm"}
    assert {"ucxx", "asyncio", "ucx_perftest"} <= peers  # always installed with ucxcomm
    for peer in peers:  # the table has a speedup column per peer that ran
        assert f"x {peer}" in proc.stdout
    assert "[p2p 1/" in proc.stderr  # the progress display
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_rma_and_collectives_over_tcp(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = bench("rma", "--quick", "--sizes", "8,64K", "--compare", "perftest",
                 "--transport", "tcp", "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # --quiet: no progress display; only notes (e.g. a peer that failed) may remain
    assert all(ln.startswith("ucxcomm bench: ") for ln in proc.stderr.splitlines()), \
        proc.stderr
    recs = records(out)
    ours = {(r["op"], r["size"]) for r in recs if r["impl"] == "ucxcomm"}
    want = {(op, s) for op in SUITES["rma"] for s in (8, 65536) if applies(op, s, [8, 65536])}
    assert ours == want
    assert all(r["settings"]["UCX_TLS"] == "tcp,self" for r in recs)
    out3 = tmp_path / "c.jsonl"
    proc = bench("collectives", "-n", "3", "--quick", "--sizes", "8", "--compare", "none",
                 "--json", str(out3), "--quiet", "--no-bind")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(out3)
    assert {r["settings"]["binding"] for r in recs} == {"none (--no-bind)"}
    assert {r["op"] for r in recs} == set(SUITES["collectives"])
    assert {r["nranks"] for r in recs} == {3}
    for r in recs:
        assert r["busbw_GBps"] > 0 and r["algbw_GBps"] > 0


@pytest.mark.parametrize("args, message", [
    (["--sizes", "8,abc"], "bad size"),
    (["--sizes", "0"], "out of range"),
    (["--compare", "nccl"], "unknown nccl"),
    (["-n", "1"], "-n must be >= 2"),
    (["--timeout", "0"], "--timeout must be > 0"),
])
def test_bad_options_fail_before_any_job(args, message):
    t0 = time.monotonic()
    proc = bench("p2p", *args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "[p2p" not in proc.stderr and time.monotonic() - t0 < 30


def test_jobs_bind_one_rank_per_core_when_there_is_a_core_each():
    """One decision for every launcher (``ucxcomm.bench.launchers``): ``ucxcomm run
    --bind-to core``, ``mpiexec -bind-to core``, ``ucx_perftest``'s pair and gloo's ranks
    pinned, when there is a core per rank; none with ``bind=False`` (``--no-bind``) or
    more ranks than cores. ``ucxcomm bench`` and the tracking scripts both use it."""
    import os

    prog = ["python", "prog.py"]
    four, two = [3, 1, 2, 0], [5, 7]
    assert launchers.bound_cores(2, available=four) == [0, 1]
    assert launchers.bound_cores(3, available=two) is None
    assert launchers.bound_cores(1, bind=False, available=four) is None
    for n, cores, bound in ((2, four, True), (4, four, True), (3, two, False),
                            (1, four, True)):
        run = launchers.ucxcomm_run_cmd(n, prog, timeout=60.0, available=cores)
        assert run[run.index("run"):] == ["run", "-n", str(n), "--timeout", "60",
                                          *(["--bind-to", "core"] if bound else []), *prog]
        mpi = launchers.mpiexec_cmd(n, prog, available=cores, exe="mpiexec")
        assert mpi == ["mpiexec", *(["-bind-to", "core"] if bound else []), "-n", str(n),
                       *prog]
        unbound = launchers.ucxcomm_run_cmd(n, prog, timeout=60, bind=False, available=cores)
        assert "--bind-to" not in unbound
        assert "-bind-to" not in launchers.mpiexec_cmd(n, prog, bind=False, available=cores,
                                                       exe="mpiexec")
    assert launchers.perftest_cores(available=four) == [0, 1]
    assert launchers.perftest_cores(available=[9]) is None
    assert launchers.perftest_cores(bind=False, available=four) is None
    assert launchers.pin(None, 0) is None and callable(launchers.pin([0, 1], 1))
    # this machine: the driver of ``ucxcomm bench`` asks the same function
    cpus = sorted(os.sched_getaffinity(0))
    on, off = driver.Options(suites=["p2p"]), driver.Options(suites=["p2p"], bind=False)
    assert driver._cores(on, 2) == (cpus[:2] if len(cpus) >= 2 else None)
    assert driver._cores(on, len(cpus) + 1) is None
    assert driver._cores(off, 1) is None


def test_tracking_scripts_build_their_jobs_with_ucxcomm_bench(monkeypatch):
    """benchmarks/_driver.py starts its jobs through ``ucxcomm.bench.launchers`` (the
    same command lines as ``ucxcomm bench``), ``--no-bind`` included."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _driver

    seen: list[list[str]] = []
    monkeypatch.setattr(_driver, "run_bench", lambda cmd, env, timeout=0: seen.append(cmd)
                        or [])
    monkeypatch.setattr(_driver, "find_mpiexec", lambda: "mpiexec")
    for bind in (True, False):
        monkeypatch.setattr(_driver, "BIND", bind)
        seen.clear()
        _driver.ucxcomm_run(2, "p2p.py", "--rank", env={})
        _driver.mpiexec_run(2, "baselines/mpi_p2p.py", env={})
        py = sys.executable
        assert seen[0] == launchers.ucxcomm_run_cmd(
            2, [py, str(ROOT / "benchmarks" / "p2p.py"), "--rank"], timeout=900, bind=bind)
        assert seen[1] == launchers.mpiexec_cmd(
            2, [py, str(ROOT / "benchmarks" / "baselines" / "mpi_p2p.py")], bind=bind,
            exe="mpiexec")
        assert _driver.bound(2) == (launchers.bound_cores(2, bind) is not None)


def test_sizes_parse():
    assert parse_sizes("8,4K,1M,64M") == [8, 4096, 1 << 20, 64 << 20]
    assert parse_sizes("1m, 8, 8") == [8, 1 << 20]
    assert parse_sizes("2KiB,1G") == [2048, 1 << 30]


def test_speedup_direction():
    """x > 1 means ucxcomm is better, for times (smaller) and bandwidths (larger) alike."""
    base = {"suite": "p2p", "nranks": 2, "size": 8, "min": 1, "max": 9,
            "settings": {"transport": "shm"}}
    recs = [dict(base, impl="ucxcomm", op="latency", unit="us", median=2.0),
            dict(base, impl="mpi4py", op="latency", unit="us", median=4.0),
            dict(base, impl="ucxcomm", op="bw", unit="GB/s", median=3.0),
            dict(base, impl="mpi4py", op="bw", unit="GB/s", median=1.5)]
    text = driver.table(recs)
    rows = [ln.split() for ln in text.splitlines() if ln.strip().startswith("8 ")]
    assert [row[-1] for row in rows] == ["2.00", "2.00"]


def test_pipeline_suite(tmp_path):
    """The pipeline suite: ucxcomm streams and asyncio streams, producer -> consumer."""
    out = tmp_path / "p.jsonl"
    proc = bench("pipeline", "--quick", "--sizes", "64K", "--compare", "asyncio",
                 "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(out)
    assert {(r["impl"], r["op"], r["size"]) for r in recs} == {
        ("ucxcomm", "stream", 65536), ("asyncio", "stream", 65536)}
    assert "x asyncio" in proc.stdout


def test_torch_suite(tmp_path):
    """The torch suite: all_reduce and a DDP step over the ucxcomm backend and gloo."""
    out = tmp_path / "t.jsonl"
    proc = bench("torch", "--quick", "--sizes", "8", "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(out)
    assert {(r["impl"], r["op"]) for r in recs} == {
        (i, op) for i in ("ucxcomm", "gloo") for op in ("all_reduce", "ddp_step")}
    assert "x gloo" in proc.stdout


def test_gpu_without_cupy_fails_before_running(tmp_path):
    """``--gpu`` where cupy cannot be imported: a usage error naming what is missing,
    before any job starts (before the fix, every job started, failed on ``import cupy``
    in its ranks, and the run ended with 'no ucxcomm measurement completed')."""
    fake = tmp_path / "nocupy" / "cupy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('cupy hidden by the test')\n")
    env = dict(clean_env(), PYTHONPATH=f"{fake.parent}:{ROOT}")
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "bench", "p2p", "--gpu",
                           "--quick"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--gpu: needs cupy" in proc.stderr
    assert "[p2p" not in proc.stderr  # no job started


@pytest.mark.gpu
def test_gpu_suites(tmp_path):
    """``--gpu``: p2p on device buffers for ucxcomm, raw ucxx and ``ucx_perftest -m
    cuda``; collectives and torch (CUDA tensors, ucxcomm and gloo) likewise."""
    out = tmp_path / "g.jsonl"
    proc = bench("p2p", "--gpu", "--quick", "--sizes", "8,1M", "--compare", "ucxx,perftest",
                 "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(out)
    assert {(r["impl"], r["op"]) for r in recs} >= {
        (i, op) for i in ("ucxcomm-gpu", "ucxx-gpu", "ucx_perftest-gpu")
        for op in ("latency", "bw")}
    assert all("gpu" in r["settings"] for r in recs)
    proc = bench("torch", "--gpu", "--quick", "--sizes", "8", "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {(r["impl"], r["op"]) for r in records(out)} == {
        (i, op) for i in ("ucxcomm-gpu", "gloo-gpu") for op in ("all_reduce", "ddp_step")}


def test_elastic_suite(tmp_path):
    """``ucxcomm bench elastic --quick``: detect-to-shrunk at 2, 4 and 8 ranks, a
    replacement's rejoin, bandwidth before and after a shrink, each from real deaths."""
    out = tmp_path / "elastic.jsonl"
    proc = bench("elastic", "--quick", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    shrunk = [r for r in recs if r["what"] == "detect_to_shrunk"]
    assert sorted({r["ranks"] for r in shrunk}) == [2, 4, 8]
    assert all(0 < r["seconds"] < 30 for r in shrunk), shrunk
    assert [r for r in recs if r["what"] == "rejoin" and 0 < r["seconds"] < 60]
    assert all(r["before_GBps"] > 0 and r["after_GBps"] > 0
               for r in recs if r["what"] == "bandwidth")
    assert len([r for r in recs if r["what"] == "revoke" and 0 < r["seconds"] < 5]) == 20
    for line in ("detect-to-shrunk", "2 ranks: p50", "8 ranks: p50", "revoke (rank 0",
                 "rejoin", "before / after a shrink"):
        assert line in proc.stdout, proc.stdout
