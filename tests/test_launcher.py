"""``ucxcomm run`` behaves like mpirun: exit codes, signals, timeouts, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucxcomm.launch import free_port
from ucxcomm.testing import launch

ROOT = Path(__file__).resolve().parent.parent
PROG = str(ROOT / "tests" / "spmd" / "launcher_progs.py")


def pids(out: str) -> list[int]:
    return [int(p) for p in re.findall(r"PID \d+ (\d+)", out)]


def assert_all_gone(pid_list: list[int]) -> None:
    assert pid_list, "the ranks never reported their pids"
    for pid in pid_list:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie would be reaped by its parent (the launcher, now gone): check state.
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(")")[-1].split()[0]
        assert state == "Z", f"rank process {pid} is still running (state {state})"


def test_first_failure_ends_job_with_its_code():
    proc = launch(3, [sys.executable, PROG, "fail"], timeout=60)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 1 failed (exit code 3)" in proc.stderr
    assert_all_gone(pids(proc.stdout))


def test_signal_death_gives_128_plus_signal():
    proc = launch(2, [sys.executable, PROG, "signal"], timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert_all_gone(pids(proc.stdout))


def test_rank_exiting_zero_does_not_end_job():
    proc = launch(2, [sys.executable, PROG, "early_exit"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[0] still-here" in proc.stdout


def test_ok_job_and_tagged_output():
    proc = launch(3, [sys.executable, PROG, "ok"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        assert f"[{r}] OK {r}" in proc.stdout


def test_untagged_output_is_forwarded_in_whole_lines():
    """Regression (issue 15, defect 9): without --tag-output the ranks wrote straight to
    the launcher's stdout, so lines written in pieces mixed mid-line."""
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "run", "-n", "2", "--timeout",
                           "60", sys.executable, PROG, "lines"], capture_output=True,
                          text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("PID ")]
    assert len(lines) == 600, len(lines)
    mixed = [ln[:40] for ln in lines if ln not in ("A" * 4000, "B" * 4000)]
    assert not mixed, f"{len(mixed)} lines mixed, e.g. {mixed[:3]}"


def test_exit_without_close_is_quiet():
    """Regression (issue 15, defect 8): ranks that end without close() made the others
    print "peer rank N died or left without closing" and "lost the bootstrap store"."""
    proc = launch(3, [sys.executable, PROG, "no_close"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        assert f"[{r}] OK {r}" in proc.stdout
    assert "died" not in proc.stderr and "lost the bootstrap store" not in proc.stderr, \
        proc.stderr[-3000:]


def test_timeout_dumps_stacks_and_kills():
    proc = launch(2, [sys.executable, PROG, "hang"], timeout=8)
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert "timed out after 8 s" in proc.stderr
    # every rank's asyncio tasks (SIGUSR1), then faulthandler's dump, prefixed with the rank
    assert "[0] rank 0: asyncio tasks at SIGUSR1" in proc.stderr, proc.stderr[-3000:]
    assert "block_forever" in proc.stderr
    assert re.search(r"\[[01]\] .*(Current thread|Thread 0x)", proc.stderr), proc.stderr[-3000:]
    assert_all_gone(pids(proc.stdout))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig,background", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                            (signal.SIGINT, True)])
def test_signal_to_launcher_reaches_every_rank(sig, background):
    """``background``: the launcher starts with SIGINT ignored, as a shell script's
    background job does. Regression (issue 15, defect 3): its ranks inherited the
    ignored SIGINT, so the SIGINT it forwards did nothing and every rank waited for the
    SIGKILL 5 s later; now the ranks are interrupted (KeyboardInterrupt)."""
    cmd = [sys.executable, "-m", "ucxcomm.cli", "run", "-n", "3", "--tag-output",
           "--timeout", "60", sys.executable, PROG, "hang"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, stdin=subprocess.DEVNULL,
                         preexec_fn=_ignore_sigint if background else None)
    seen: list[str] = []
    deadline = time.monotonic() + 60
    assert p.stdout is not None
    while sum("READY" in line for line in seen) < 3:
        assert time.monotonic() < deadline, seen
        line = p.stdout.readline()
        assert line, f"launcher output ended early: {seen}"
        seen.append(line)
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig, err[-3000:]
    assert f"got signal {int(sig)}" in err
    assert_all_gone(pids("".join(seen) + out))
    if sig == signal.SIGINT:  # the ranks were interrupted, not left for the SIGKILL
        # (once one rank ends, the launcher stops the others: they may end by SIGTERM)
        assert "] KeyboardInterrupt" in err, err[-3000:]


def test_usage_errors():
    for args in (["-n", "0", "x.py"], ["-n", "2"]):
        proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "run", *args],
                              capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr


def test_missing_program():
    proc = launch(2, ["/nonexistent/program"], timeout=30)
    assert proc.returncode == 127
    assert "cannot start" in proc.stderr


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    """Ports handed to a process that binds them later: free now, ``span`` in a row, and
    never where the kernel picks bind(0) and outgoing-connection ports."""
    import socket

    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
              .split())
    for span in (1, 3):
        for _ in range(20):
            port = free_port(span=span)
            assert not (lo <= port + span - 1 and port <= hi), (port, lo, hi)
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
    with pytest.raises(ValueError, match="span"):
        free_port(span=0)



_AFFINITY = """
import os, threading
from ucxcomm.transport.worker import spin_yield
seen = []
t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print("AFF", os.environ["UCXCOMM_RANK"], sorted(os.sched_getaffinity(0)), seen[0],
      os.environ.get("UCXCOMM_RANKS_PER_CORE"), spin_yield(), flush=True)
"""


def _affinities(nranks: int, *bind: str, **extra: str) -> dict[int, tuple[str, ...]]:
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "run", "-n", str(nranks),
                           "--timeout", "60", *bind, sys.executable, "-c", _AFFINITY],
                          capture_output=True, text=True, timeout=90, cwd=ROOT,
                          env={**{k: v for k, v in os.environ.items()
                                  if not k.startswith("UCXCOMM_")}, **extra})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"AFF (\d+) (\[.*?\]) (\[.*?\]) (\S+) (\S+)$", line)
        if m:
            got[int(m[1])] = m.groups()[1:]
    assert sorted(got) == list(range(nranks)), proc.stdout
    return got


def test_bind_to_core_gives_each_rank_its_own_core():
    """``--bind-to core``: rank r (and every thread it starts) runs only on the r-th CPU
    the launcher may use, round robin when ranks outnumber them; each rank knows how many
    share its CPU, so spinning waiters yield only then. Without it nothing is bound, and
    a count inherited from a bound job is not passed on (review)."""
    from ucxcomm.launch.launcher import core_binding
    from ucxcomm.transport.worker import quota_cores

    cpus = sorted(os.sched_getaffinity(0))
    quota = quota_cores()  # (a cgroup CPU quota below the rank count makes them yield)
    n = min(len(cpus), 4)
    got = _affinities(n, "--bind-to", "core", UCXCOMM_SPIN_YIELD="auto")
    crowded = str(quota is not None and n > quota)
    for r in range(n):
        assert got[r] == (f"[{cpus[r]}]", f"[{cpus[r]}]", "1", crowded), got
    over = _affinities(len(cpus) + 1, "--bind-to", "core", UCXCOMM_SPIN_YIELD="auto")
    assert over[len(cpus)][:2] == (f"[{cpus[0]}]",) * 2, over
    crowded = str(quota is not None and len(cpus) + 1 > quota)
    for r in range(len(cpus) + 1):  # rank 0 and the last share cpus[0]
        want = ("2", "True") if r in (0, len(cpus)) else ("1", crowded)
        assert over[r][2:] == want, over
    free = _affinities(2, UCXCOMM_RANKS_PER_CORE="1")
    assert {v[:3] for v in free.values()} == {(str(cpus), str(cpus), "None")}, free
    assert core_binding(5, [3, 7]) == [3, 7, 3, 7, 3]
    with pytest.raises(ValueError, match="no CPU"):
        core_binding(1, [])


def test_bind_to_rejects_unknown_policies():
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "run", "-n", "1", "--bind-to",
                           "socket", sys.executable, "-c", "pass"],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 2 and "--bind-to" in proc.stderr, proc.stderr
    from ucxcomm.launch.launcher import run_job

    with pytest.raises(ValueError, match="bind"):
        run_job(1, ["true"], bind="socket")
