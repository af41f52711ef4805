"""The flight recorder (``comm.trace()``, ``ucxcomm/comm/trace.py``) and ``ucxcomm
status``: records of known traffic, in-flight records kept, a hung 3-rank job named rank
by rank while it hangs, the launcher's ``--timeout`` report, hostile recorder files."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ucxcomm.comm import trace
from ucxcomm.launch import free_port
from ucxcomm.testing import clean_env, run_case

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "spmd" / "trace_cases.py"
HUNG = ROOT / "tests" / "spmd" / "hung_prog.py"


@pytest.mark.parametrize("nranks", [2, 3])
def test_records_known_traffic(nranks):
    run_case(CASES, "records_known_traffic", nranks)


def test_the_recorder_turned_off_records_nothing():
    run_case(CASES, "recorder_off", 2, env={"UCXCOMM_TRACE_DEPTH": "0"})


def test_in_flight_records_are_never_overwritten():
    run_case(CASES, "in_flight_records_stay", 3, env={"UCXCOMM_TRACE_DEPTH": "4"})


@pytest.mark.parametrize("nranks", [2, 3])
def test_window_synchronization_is_recorded(nranks):
    run_case(CASES, "window_synchronization", nranks)


def test_failed_and_abandoned_calls_are_recorded_so():
    run_case(CASES, "failed_and_timed_out_calls", 2)


# ------------------------------------------------------------------ a hung job
def _start_hung(timeout: float) -> tuple[subprocess.Popen, queue.Queue, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucxcomm.cli", "run", "-n", "3", "--timeout", str(timeout),
         sys.executable, str(HUNG)], env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    out: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines, out


def _ready(lines: queue.Queue, out: list[str], deadline: float) -> str:
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "no READY line:\n" + "".join(out)[-4000:]
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        assert line is not None, "the job ended before READY:\n" + "".join(out)[-4000:]
        if line.startswith("READY "):
            return line.split(None, 1)[1].strip()


def test_status_names_what_each_rank_of_a_hung_job_waits_in():
    """Rank 0 in a barrier, rank 1 in Recv(source=2, tag=7), rank 2 asleep in user code:
    ``ucxcomm status`` (found without arguments, and --json, --job) names each one's
    operation and why, within a second, while the job hangs."""
    mine = os.path.join(os.path.dirname(trace.job_dir()), f"ppid-{os.getpid()}")
    had_mine = os.path.exists(mine)
    proc, lines, out = _start_hung(120)
    try:
        jobdir = _ready(lines, out, time.monotonic() + 90)
        t0 = time.monotonic()
        text = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "status"], env=clean_env(),
                              capture_output=True, text=True, timeout=30)
        took = time.monotonic() - t0
        assert text.returncode == 0, text.stderr
        got = text.stdout
        name = os.path.basename(jobdir)
        assert f"job {name}" in got, got
        assert "rank 0 waits in barrier #1 for " in got, got
        assert ("rank 1 has not entered it (it waits in Recv(source=2, tag=7)); rank 2 has "
                "not entered it (it is in none of ucxcomm's calls)") in got, got
        assert ("rank 1 waits in Recv(source=2, tag=7) for ") in got, got
        assert ": rank 2 never sent it (it is in none of ucxcomm's calls)" in got, got
        assert "rank 2 is in none of ucxcomm's calls (its last: barrier #0" in got, got
        print(f"ucxcomm status answered in {took:.2f} s (a fresh Python included)")
        js = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "status", "--json", "--job",
                             jobdir], env=clean_env(), capture_output=True, text=True,
                            timeout=30)
        assert js.returncode == 0, js.stderr
        (job,) = json.loads(js.stdout)
        ranks = {r["rank"]: r for r in job["ranks"]}
        assert [o["call"] for o in ranks[0]["in_flight"]] == ["barrier #1"]
        assert [o["call"] for o in ranks[1]["in_flight"]] == ["Recv(source=2, tag=7)"]
        assert ranks[1]["in_flight"][0]["state"] == "waiting"
        assert ranks[2]["in_flight"] == []
        assert all(r["alive"] for r in ranks.values())
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    assert not os.path.exists(jobdir), "ucxcomm run left its job directory"
    # nor made one of its own (it did: named after its parent, this process, left empty)
    assert had_mine or not os.path.exists(mine), "ucxcomm run made a directory of its own"


def test_status_through_the_store_names_what_each_rank_waits_in():
    """A job started torchrun-style (rank 0 hosts the store; nothing of it in this
    host's job list is used): ``ucxcomm status --store HOST:PORT --token T`` asks its
    ranks through the store and names each one's operation while it hangs; a wrong
    token is refused with a clear error and no records."""
    mine = os.path.join(os.path.dirname(trace.job_dir()), f"ppid-{os.getpid()}")
    had_mine = os.path.exists(mine)
    port, token = free_port(), "status-through-the-store-" + os.urandom(8).hex()
    procs = [subprocess.Popen(
        [sys.executable, str(HUNG)], cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if r == 2 else subprocess.DEVNULL, stderr=subprocess.STDOUT,
        text=True, env=dict(clean_env(), RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                            LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), UCXCOMM_TOKEN=token))
        for r in range(3)]
    lines: queue.Queue = queue.Queue()
    out: list[str] = []

    def pump() -> None:
        assert procs[2].stdout is not None
        for line in procs[2].stdout:
            out.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    # (torchrun's convention: our store on MASTER_PORT + 1, served by rank 0)
    status = [sys.executable, "-m", "ucxcomm.cli", "status", "--store", f"127.0.0.1:{port + 1}"]
    try:
        _ready(lines, out, time.monotonic() + 90)
        text = subprocess.run([*status, "--token", token], env=clean_env(),
                              capture_output=True, text=True, timeout=30)
        assert text.returncode == 0, text.stdout + text.stderr
        got = text.stdout
        assert f"job store 127.0.0.1:{port + 1}: 3 rank(s) recorded" in got, got
        assert "rank 0 waits in barrier #1 for " in got, got
        assert "rank 1 waits in Recv(source=2, tag=7) for " in got, got
        assert "rank 2 is in none of ucxcomm's calls (its last: barrier #0" in got, got
        js = subprocess.run([*status, "--json"], env=dict(clean_env(), UCXCOMM_TOKEN=token),
                            capture_output=True, text=True, timeout=30)
        assert js.returncode == 0, js.stderr
        (job,) = json.loads(js.stdout)
        ranks = {r["rank"]: r for r in job["ranks"]}
        assert [o["call"] for o in ranks[1]["in_flight"]] == ["Recv(source=2, tag=7)"]
        bad = subprocess.run([*status, "--token", "not-the-token"], env=clean_env(),
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "could not ask the job" in bad.stderr, bad
        assert "Recv" not in bad.stdout
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)
        if not had_mine:
            shutil.rmtree(mine, ignore_errors=True)


def test_run_timeout_prints_the_status_before_the_stacks():
    proc, lines, out = _start_hung(15)
    try:
        _ready(lines, out, time.monotonic() + 60)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while lines.get(timeout=max(0.1, deadline - time.monotonic())) is not None:
        pass  # (until the reader saw the end of the output)
    text = "".join(out)
    assert proc.returncode == 124, text[-4000:]
    at = text.find("rank 1 waits in Recv(source=2, tag=7) for ")
    assert at >= 0, text[-4000:]
    assert "rank 2 never sent it" in text, text[-4000:]
    stacks = text.find("asyncio tasks at SIGUSR1")
    assert stacks < 0 or at < stacks, text[-4000:]


# ------------------------------------------------------------------ the file format
def _file(records: list[dict], nslots: int = 8) -> bytes:
    hdr = np.zeros(1, trace.HEADER)
    hdr["magic"], hdr["version"], hdr["nslots"] = trace.MAGIC, trace.VERSION, nslots
    hdr["pid"], hdr["rank"], hdr["size"], hdr["next"] = os.getpid(), 1, 2, len(records)
    recs = np.zeros(nslots, trace.RECORD)
    for i, r in enumerate(records):
        for k, v in r.items():
            recs[i][k] = v
    return hdr.tobytes() + recs.tobytes()


def test_parse_reads_records_in_order_and_names_calls():
    now = int(time.time() * 1e9)
    data = _file([
        dict(n=2, t0=now, t1=0, kind=trace.KIND["Recv"], state=trace.WAITING, peer=0, wpeer=0,
             tag=7, seq=-1, crank=1, csize=2),
        dict(n=1, t0=now - 10**9, t1=now - 10**9 + 5000, kind=trace.KIND["Bcast"],
             state=trace.DONE, peer=1, wpeer=1, tag=-2, seq=4, crank=1, csize=2, nbytes=64,
             cid=3),
    ])
    head, ops = trace.parse(data, data)
    assert head["rank"] == 1 and head["size"] == 2 and head["pid"] == os.getpid()
    assert [o.number for o in ops] == [1, 2]
    assert ops[0].call() == "Bcast(root=1, 64 B) #4 on comm 3"
    assert ops[1].call() == "Recv(source=0, tag=7)" and ops[1].in_flight
    assert ops[1].end is None and ops[0].waited() == pytest.approx(5e-6, abs=1e-6)


def test_parse_keeps_only_records_read_the_same_twice():
    now = int(time.time() * 1e9)
    a = _file([dict(n=1, t0=now, kind=1, state=trace.DONE, seq=-1, peer=1, wpeer=1, tag=0),
               dict(n=2, t0=now, kind=2, state=trace.WAITING, seq=-1, peer=1, wpeer=1, tag=0)])
    b = bytearray(a)
    b[64 + 64 + 60] = 3  # record 2's kind changed between the two reads (torn)
    assert [o.number for o in trace.parse(a, bytes(b))[1]] == [1]


@pytest.mark.parametrize("bad", [
    b"", b"UCXTRACE", b"NOTTRACE" + bytes(120),
    # announces 65535 records in 128 bytes: refused, nothing allocated for them
    _file([], 1)[:8] + np.array([trace.VERSION, 65535], "<u4").tobytes() + _file([], 1)[16:],
])
def test_parse_refuses_what_is_not_a_recorder(bad):
    with pytest.raises(ValueError):
        trace.parse(bad)


def test_hostile_values_read_as_unknown_not_a_crash():
    data = _file([dict(n=1, kind=65535, state=200, seq=-1, peer=-7, wpeer=-7, tag=-9)])
    (op,) = trace.parse(data)[1]
    assert op.kind == "?" and op.state == "?"
    assert isinstance(op.call(), str)


def test_diagnose_names_a_collective_called_by_one_rank_as_another():
    now = time.time()

    def op(kind, seq, state="waiting"):
        return trace.Op(kind=kind, state=state, rank=0, size=2, cid=0, peer=None,
                        world_peer=None, tag=None, seq=seq, nbytes=0, start=now - 2,
                        end=None if state == "waiting" else now - 1, number=1)

    a = trace.Rank(0, 2, os.getpid(), True, [op("Allreduce", 5)], 0, "")
    b = trace.Rank(1, 2, os.getpid(), True, [op("Bcast", 5)], 0, "")
    lines = trace.diagnose([a, b], now)
    assert lines[0] == "rank 0 waits in Allreduce #5 for 2.0 s: rank 1 called Bcast #5 there"


def test_stale_job_directories_are_pruned_and_recent_ones_kept(tmp_path):
    """A dead job's records stay for ``ucxcomm status --all`` until STALE_S passed, then
    the next world's rank 0 removes them; a live job's are never removed."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    root = os.path.dirname(trace.job_dir())
    os.makedirs(root, mode=0o700, exist_ok=True)
    made = {}
    for name, pid, age in [("old-dead", dead_pid, 2 * trace.STALE_S),
                           ("new-dead", dead_pid, 60.0),
                           ("old-alive", os.getpid(), 2 * trace.STALE_S)]:
        path = os.path.join(root, f"test-{os.getpid()}-{name}")
        os.makedirs(path, exist_ok=True)
        data = bytearray(_file([dict(n=1, kind=1, state=trace.DONE, seq=-1)], 1))
        data[16:20] = np.array([pid], "<u4").tobytes()
        file = os.path.join(path, "rank0.trace")
        with open(file, "wb") as f:
            f.write(data)
        then = time.time() - age
        os.utime(file, (then, then))
        os.utime(path, (then, then))
        made[name] = path
    try:
        assert trace.load_job(made["old-dead"]).ranks[0].pid == dead_pid
        trace.prune()
        assert not os.path.exists(made["old-dead"])
        assert os.path.exists(made["new-dead"]) and os.path.exists(made["old-alive"])
        assert made["new-dead"] in [j.path for j in trace.find_jobs(include_ended=True)]
        assert made["new-dead"] not in [j.path for j in trace.find_jobs()]
    finally:
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)


def test_a_directory_another_user_could_write_is_refused(tmp_path, monkeypatch):
    """Shared memory is world-writable: the recorder files go only into a directory of
    this user's that nobody else can write, never through a planted symlink."""
    open_dir = tmp_path / "job"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    monkeypatch.setenv("UCXCOMM_JOB_DIR", str(open_dir))
    with pytest.raises(PermissionError):
        trace.job_dir(create=True)
    mem, path = trace.open_file(0, 4)  # (falls back to private memory)
    assert path is None and len(mem) == 64 * 5
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, private / "rank0.trace")
    monkeypatch.setenv("UCXCOMM_JOB_DIR", str(private))
    mem, path = trace.open_file(0, 4)
    assert path is None
    assert victim.read_bytes() == b"keep me"


def test_a_failure_with_the_recorder_off_is_still_the_failure():
    """UCXCOMM_TRACE_DEPTH=0: ending a failed operation's record leaves the PeerFailure
    as it was (it was masked by a ValueError from reading an empty recorder)."""
    from ucxcomm.errors import PeerFailure
    from ucxcomm.transport import _ucx

    _ucx.load()
    from ucxcomm.comm import _fast

    off = _fast.Recorder(bytearray(64), None, 0, 0, 1, os.getpid())
    exc = PeerFailure("rank 1 died", peer=1)
    trace.ended(off, 0, exc)
    assert exc.operations == ()
    assert off.snapshot() == b"" and off.start("Send", trace.POSTED, 0, 0, 1) == 0
