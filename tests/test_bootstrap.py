"""World formation from each launcher convention: unit checks of detect(), and real
processes started with each convention's environment (no launcher in between)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ucxcomm import BootstrapError
from ucxcomm.launch import free_port
from ucxcomm.launch.bootstrap import detect, parse_nodelist
from ucxcomm.testing import clean_env, launch, run_ranks

ROOT = Path(__file__).resolve().parent.parent
SPMD = ROOT / "tests" / "spmd"
PROG = str(SPMD / "world_prog.py")


def test_parse_nodelist():
    assert parse_nodelist("node1") == ["node1"]
    assert parse_nodelist("gpu[01-03,7],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]
    assert parse_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_detect_conventions():
    assert detect({}).size == 1 and detect({}).source == "singleton"
    s = detect({"UCXCOMM_RANK": "1", "UCXCOMM_SIZE": "4", "UCXCOMM_STORE": "h:5",
                "UCXCOMM_TOKEN": "t"})
    assert (s.rank, s.size, s.host, s.port, s.host_store) == (1, 4, "h", 5, False)
    s = detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "100"})
    assert (s.port, s.host_store, s.source) == (101, True, "torchrun")
    s = detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_NODELIST": "n[4-5]",
                "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"})
    assert (s.rank, s.size, s.host, s.port) == (3, 8, "n4", 20000 + (77 * 16 + 1) % 20000)
    s = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                "UCXCOMM_STORE": "x:9"})
    assert (s.host, s.port, s.source) == ("x", 9, "open mpi")
    s = detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"})
    assert s.host == "127.0.0.1" and s.host_store
    s = detect({}, rank=1, size=2, store="127.0.0.1:7")
    assert (s.rank, s.size, s.port, s.host_store) == (1, 2, 7, False)


@pytest.mark.parametrize("env, missing", [
    ({"RANK": "0", "MASTER_ADDR": "x"}, "WORLD_SIZE, MASTER_PORT"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_NODELIST"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}, "UCXCOMM_STORE"),
    ({"UCXCOMM_RANK": "0", "UCXCOMM_SIZE": "2"}, "UCXCOMM_STORE, UCXCOMM_TOKEN"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"}, "RANK='x'"),
    ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"}, "out of range"),
])
def test_detect_names_what_is_missing(env, missing):
    with pytest.raises(BootstrapError, match=missing.replace("(", r"\(")):
        detect(env)


def test_explicit_arguments_must_be_complete():
    with pytest.raises(BootstrapError):
        detect({}, rank=0)
    with pytest.raises(BootstrapError, match="store"):
        detect({}, rank=0, size=2)


def spawn_world(nranks: int, rank_env) -> None:
    envs = [dict(clean_env(), **rank_env(r)) for r in range(nranks)]
    run_ranks([[sys.executable, PROG]] * nranks, envs,
              "WORLD-OK rank {rank} size " + str(nranks))


def test_torchrun_env():
    port = free_port()  # our store listens on MASTER_PORT + 1
    spawn_world(3, lambda r: {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1)})


def test_clean_torchrun_style_exit_is_silent():
    """Regression (issue 15, defect 8): on Python 3.11 rank 0 printed a CancelledError
    traceback from the store at every clean torchrun-style exit (the event loop cancels
    the store's connection handlers, and 3.11's stream server logs each)."""
    port = free_port()
    envs = [dict(clean_env(), RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port - 1)) for r in range(2)]
    run_ranks([[sys.executable, PROG]] * 2, envs, "WORLD-OK rank {rank} size 2", quiet=True)


def test_slurm_env():
    port = free_port()
    spawn_world(2, lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2",
                              "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "4242",
                              "UCXCOMM_PORT": str(port)})


def test_open_mpi_env_single_host():
    # One host: rank 0 serves the store at a port derived from the common parent pid.
    spawn_world(2, lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                              "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_pmi_env_with_store_address():
    port = free_port()
    spawn_world(3, lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "3",
                              "UCXCOMM_STORE": f"127.0.0.1:{port}"})


def _rank_1_fails_init(extra: list[dict[str, str]]) -> str:
    """Two PMI-style ranks (rank 0 serves the store), ``extra[r]`` added to rank r's
    environment: rank 1's stderr, once it exited with an error."""
    port = free_port()
    procs = []
    for r in range(2):
        env = clean_env()
        env.update({"PMI_RANK": str(r), "PMI_SIZE": "2", "UCXCOMM_TOKEN": "t",
                    "UCXCOMM_STORE": f"127.0.0.1:{port}", "UCXCOMM_TIMEOUT": "20", **extra[r]})
        procs.append(subprocess.Popen([sys.executable, PROG], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        _out1, err1 = procs[1].communicate(timeout=60)
        assert procs[1].returncode != 0, err1[-3000:]
        return err1
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_explicit_token_mismatch_is_a_bootstrap_error():
    err1 = _rank_1_fails_init([{"UCXCOMM_TOKEN": "right"}, {"UCXCOMM_TOKEN": "wrong"}])
    assert "BootstrapError" in err1 and "refused" in err1, err1[-3000:]


def test_collective_checks_must_match_rank_0():
    """Issue 31: UCXCOMM_CHECK_COLLECTIVES off on rank 1, on (the default) on rank 0: rank
    1's init raises BootstrapError naming the setting (a mix would wait forever in the
    first collective whose fingerprint one side never sends)."""
    err1 = _rank_1_fails_init([{}, {"UCXCOMM_CHECK_COLLECTIVES": "0"}])
    assert "BootstrapError" in err1 and ("UCXCOMM_CHECK_COLLECTIVES is off on rank 1 and on "
                                         "on rank 0") in err1, err1[-3000:]


def test_singleton_without_launcher():
    proc = subprocess.run([sys.executable, PROG], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WORLD-OK rank 0 size 1" in proc.stdout


def test_finalize_then_init_again_under_the_launcher():
    proc = launch(3, [sys.executable, str(SPMD / "reinit_prog.py")], timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in range(3):
        assert f"[{r}] REINIT-OK rank {r}" in proc.stdout


def test_store_entries_carry_the_host():
    """Each rank publishes its host identity with its worker address (issue 14: RDMA
    endpoints to other hosts get UCX peer error handling); unknown hosts are never
    "other"."""
    from ucxcomm.comm import World
    from ucxcomm.launch.bootstrap import pack_address, unpack_address

    for host, addr in ((b"boot:1:2", b"\x00ucx\xff" * 40), (b"", b"a"), (b"h" * 300, b"")):
        assert unpack_address(pack_address(host, addr)) == (host, addr)
    world = World.__new__(World)
    world.rank, world.hosts = 0, [b"a", b"a", b"b", b""]
    assert [world.other_host(r) for r in range(4)] == [False, False, True, False]
    world.hosts = None
    assert not world.other_host(2)
