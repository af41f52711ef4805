"""Fault injection: kill -9 a rank in the middle of each kind of operation, with ranks
started torchrun-style (no ``ucxcomm run`` to end a hang); every survivor must raise
``PeerFailure`` within the configured timeout (tests/spmd/fault_cases.py).

The victim is rank 0 (it hosts the bootstrap store: the survivors lose the store) or
the last rank (the store tells the others).
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ucxcomm.launch import free_port
from ucxcomm.testing import clean_env

ROOT = Path(__file__).resolve().parent.parent
PROG = str(ROOT / "tests" / "spmd" / "fault_cases.py")
#: The survivors' deadline (their loop runs under it); detection takes well under a
#: second (50 ms grace + notice), the rest is room for a loaded machine.
TIMEOUT_S = 20.0
NOISE = ("Traceback", "Segmentation fault", "Fatal Python error", "never retrieved")


def free_port_pair() -> int:
    """A port P with P, P+1 and P+2 free now (MASTER_PORT, our store, the listener)."""
    return free_port(span=3)


def _pump(rank: int, stream, lines: queue.Queue, out: list[str]) -> None:
    for line in stream:
        out.append(line)
        lines.put((rank, line))


def run_fault(name: str, nranks: int, victim: int,
              outs_seen: list[list[str]] | None = None) -> dict[int, float]:
    """Start ``nranks`` ranks torchrun-style on case ``name``, kill ``victim`` once every
    rank is under way, and check the survivors; returns each survivor's seconds from the
    kill to its exit (``outs_seen`` gets each rank's output lines)."""
    port = free_port_pair()
    procs = []
    outs: list[list[str]] = [[] for _ in range(nranks)]
    if outs_seen is not None:
        outs_seen[:] = outs
    lines: queue.Queue = queue.Queue()
    threads = []
    deadline = time.monotonic() + 60
    try:
        for r in range(nranks):
            if name == "stream" and r == 1:  # the client connects once the server listens
                _wait_for(lines, outs, {0}, "LISTENING ", deadline)
            env = dict(clean_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nranks),
                       LOCAL_WORLD_SIZE=str(nranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), UCXCOMM_TEST_FAULT_TIMEOUT=str(TIMEOUT_S),
                       PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
            p = subprocess.Popen([sys.executable, PROG, name, str(victim)], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 stdin=subprocess.DEVNULL)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(r, p.stdout, lines, outs[r]), daemon=True)
            t.start()
            threads.append(t)
        _wait_for(lines, outs, set(range(nranks)), "READY ", deadline)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        took = {}
        for r, p in enumerate(procs):
            if r == victim:
                p.wait(timeout=30)
                continue
            try:
                p.wait(timeout=max(0.1, killed + TIMEOUT_S + 30 - time.monotonic()))
            except subprocess.TimeoutExpired:  # stuck past its own deadline: stacks
                p.send_signal(signal.SIGABRT)  # (PYTHONFAULTHANDLER=1)
                p.wait(timeout=10)
                time.sleep(0.5)  # (let the reader threads take the dump)
                raise AssertionError(f"rank {r} hung after the kill\n{_show(outs)}") from None
            took[r] = time.monotonic() - killed
        for t in threads:
            t.join(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[victim].returncode == -signal.SIGKILL, _show(outs)
    for r, p in enumerate(procs):
        if r == victim:
            continue
        text = "".join(outs[r])
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{_show(outs)}"
        assert f"PEER-FAILURE {r} peer " in text, f"rank {r}: no PeerFailure\n{_show(outs)}"
        for word in NOISE:
            assert word not in text, f"rank {r}: {word!r}\n{_show(outs)}"
        if name == "stream":  # closing a connection to a dead peer is quiet too, and
            # so is the exit (UCX warned that the send in flight to it "was not returned
            # to mpool", its buffer "destroying inuse region": it cannot be purged;
            # dropped once a peer failed)
            for word in ("UCX  ERROR", "UCX  WARN"):
                assert word not in text, f"rank {r}: {word!r}\n{_show(outs)}"
        if name == "cma":  # and so is a copy that failed because its peer died
            for word in ("UCX  ERROR", "UCX  WARN", "process_vm"):
                assert word not in text, f"rank {r}: {word!r}\n{_show(outs)}"
        assert took[r] < TIMEOUT_S, f"rank {r} ended {took[r]:.1f} s after the kill"
    return took


def _wait_for(lines: queue.Queue, outs: list[list[str]], ranks: set[int], prefix: str,
              deadline: float) -> None:
    """Until each of ``ranks`` printed a line starting with ``prefix`` (or the deadline:
    AssertionError)."""
    seen: set[int] = set()
    while not ranks <= seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {prefix!r} from ranks {ranks - seen}: {_show(outs)}"
        try:
            rank, line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            seen.add(rank)


def _show(outs: list[list[str]]) -> str:
    return "\n".join(f"--- rank {r}\n{''.join(o)[-3000:]}" for r, o in enumerate(outs))


@pytest.mark.parametrize("victim", ["first", "last"])
@pytest.mark.parametrize("name", ["send", "recv", "recv_any", "allreduce", "fence", "lock",
                                  "lock_all", "flush"])
def test_kill_during(name, victim):
    nranks = 3
    v = 0 if victim == "first" else nranks - 1
    took = run_fault(name, nranks, v)
    print(f"{name}, rank {v} killed: survivors ended after "
          + ", ".join(f"{t:.2f} s" for t in took.values()))


@pytest.mark.parametrize("victim", [0, 2])
def test_peer_failure_names_the_operations_it_interrupted(victim):
    """The flight recorder after a death: each survivor's PeerFailure carries its
    operation in flight on the dead rank (an Irecv from it, or a barrier), marked failed
    (``PeerFailure.operations``, from ``comm.trace()``'s records)."""
    outs: list[list[str]] = []
    run_fault("recorded", 3, victim, outs)
    first = 1 if victim == 0 else 0
    for r in range(3):
        if r == victim:
            continue
        ops = next((line for line in outs[r] if line.startswith(f"OPERATIONS {r}:")), "")
        want = (f"failed Irecv(source={victim}, tag=5)" if r == first
                else "failed barrier #1")
        assert want in ops, f"rank {r}: {ops!r}\n{_show(outs)}"


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_during_two_rank_small_allreduce(victim):
    """Two ranks, 8 B Allreduce in a loop (each call one exchange in the compiled
    engine, finished inside the call when the peer is quick): the survivor raises
    PeerFailure."""
    took = run_fault("allreduce_small", 2, victim)
    print(f"allreduce_small, rank {victim} killed: the survivor ended after "
          + ", ".join(f"{t:.2f} s" for t in took.values()))


@pytest.mark.parametrize("victim", [0, 2])
def test_kill_during_group_small_allreduce(victim):
    """Three ranks, 8 B Allreduce in a loop (each call one compiled call: sends to both
    peers, receives waited for in place): the survivors raise PeerFailure."""
    took = run_fault("allreduce_small", 3, victim)
    print(f"allreduce_small at 3 ranks, rank {victim} killed: the survivors ended after "
          + ", ".join(f"{t:.2f} s" for t in took.values()))


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_during_stream(victim):
    """Connected endpoints (listen/connect): the server or the client dies mid-transfer."""
    took = run_fault("stream", 2, victim)
    print(f"stream, process {victim} killed: the other ended after "
          + ", ".join(f"{t:.2f} s" for t in took.values()))



@pytest.mark.parametrize("victim", [0, 1])
def test_kill_during_cma_copy(victim):
    """Two ranks on one host with the default transports: the survivor is in the middle
    of a kernel copy (CMA) out of the victim's memory when it dies. UCX treats that
    copy's failure as fatal on an endpoint without an error callback (the survivor
    aborted: "process_vm_readv ... No such process"); it must raise PeerFailure."""
    took = run_fault("cma", 2, victim)
    print(f"cma, rank {victim} killed: the survivor ended after "
          + ", ".join(f"{t:.2f} s" for t in took.values()))
