"""ucxcomm.testing itself: the SPMD case registry (in process, with a stand-in world) and
the process helpers (on trivial programs, and one real 1-rank and 2-rank case file)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import ucxcomm
from ucxcomm import testing
from ucxcomm.testing import Cases, clean_env, run_case, run_ranks

CASE_FILE = textwrap.dedent("""\
    from ucxcomm.testing import Cases

    cases = Cases(check_init_idempotent=True)


    @cases.case
    async def ring(comm):
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        assert await comm.sendrecv(comm.rank, right, source=left, timeout=30) == left


    @cases.case
    async def fails(comm):
        raise AssertionError("boom-marker")


    if __name__ == "__main__":
        cases.main()
""")


class FakeComm:
    """What Cases.run touches of a communicator."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.barriers: list[float | None] = []

    async def barrier(self, timeout: float | None = None) -> None:
        self.barriers.append(timeout)


async def noop(comm):
    pass


@pytest.fixture
def fake_world(monkeypatch):
    """ucxcomm.init/finalize replaced: no UCX, a record of what was called."""
    calls = {"init": 0, "finalize": 0}
    comm = FakeComm(rank=2)

    async def init():
        calls["init"] += 1
        return comm

    async def finalize():
        calls["finalize"] += 1

    monkeypatch.setattr(ucxcomm, "init", init)
    monkeypatch.setattr(ucxcomm, "finalize", finalize)
    return comm, calls


def test_import_has_no_side_effects():
    """Beyond importing ucxcomm (tests/test_api.py checks that one): nothing."""
    code = (
        "import os, sys, threading, json\n"
        "import ucxcomm\n"
        "before = dict(os.environ); threads = threading.active_count()\n"
        "modules = set(sys.modules)\n"
        "import ucxcomm.testing\n"
        "new = set(sys.modules) - modules\n"
        "print(json.dumps({'env_changed': dict(os.environ) != before,"
        " 'ucx_loaded': any(m.startswith(('ucxx', 'ucxcomm.transport')) for m in new),"
        " 'threads': threading.active_count() - threads}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out) == {"env_changed": False, "ucx_loaded": False, "threads": 0}


def test_registry():
    cases = Cases()

    @cases.case
    async def first(comm):
        pass

    @cases.case
    async def second(comm):
        pass

    assert cases.names() == ["first", "second"] == list(cases)
    assert len(cases) == 2 and "first" in cases and "third" not in cases
    assert cases["second"] is second
    with pytest.raises(KeyError, match=r"unknown SPMD case 'third'; known cases: first, second"):
        cases["third"]
    with pytest.raises(ValueError, match="registered twice"):
        cases.case(first)


def test_unknown_case_fails_before_init(monkeypatch):
    def no_init(*args, **kwargs):
        raise AssertionError("ucxcomm.init called for an unknown case")

    monkeypatch.setattr(ucxcomm, "init", no_init)
    cases = Cases()
    cases.case(noop)
    with pytest.raises(SystemExit, match=r"unknown SPMD case 'nope'; known cases: noop"):
        cases.main(["nope"])
    with pytest.raises(SystemExit, match=r"usage: .* CASE \(one of: noop\)"):
        cases.main([])
    with pytest.raises(SystemExit, match="usage"):
        cases.main(["noop", "extra"])


def test_case_ok_after_barrier_and_finalize(fake_world, capsys):
    comm, calls = fake_world
    cases = Cases()
    seen = []

    @cases.case
    async def works(c):
        seen.append(c)

    cases.main(["works"])
    assert seen == [comm]
    assert comm.barriers == [60] and calls == {"init": 1, "finalize": 1}
    assert capsys.readouterr().out == "CASE-OK works rank 2\n"


@pytest.mark.parametrize("outcome", ["aborted", "closed"])
def test_case_that_ends_its_world_skips_barrier_and_finalize(fake_world, capsys, outcome):
    comm, calls = fake_world
    cases = Cases(collect_garbage=True)

    @cases.case
    async def ends(c):
        return outcome

    cases.main(["ends"])
    assert comm.barriers == [] and calls == {"init": 1, "finalize": 0}
    assert capsys.readouterr().out == "CASE-OK ends rank 2\n"


def test_failing_case_prints_no_case_ok(fake_world, capsys):
    cases = Cases()

    @cases.case
    async def broken(c):
        raise AssertionError("broken on purpose")

    with pytest.raises(AssertionError, match="broken on purpose"):
        cases.main(["broken"])
    assert "CASE-OK" not in capsys.readouterr().out


def test_init_idempotence_check(fake_world, monkeypatch, capsys):
    _, calls = fake_world
    cases = Cases(check_init_idempotent=True)
    cases.case(noop)
    cases.main(["noop"])
    assert calls["init"] == 2
    assert capsys.readouterr().out == "CASE-OK noop rank 2\n"

    async def fresh_init():
        return FakeComm()

    monkeypatch.setattr(ucxcomm, "init", fresh_init)
    with pytest.raises(AssertionError, match="another communicator"):
        cases.main(["noop"])


def test_clean_env(monkeypatch):
    monkeypatch.setenv("UCXCOMM_RANK", "1")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("UCXCOMMTEST_UNRELATED", "kept")
    env = clean_env()
    assert not any(k.startswith(testing.LAUNCHER_VARS) for k in env)
    assert env["UCXCOMMTEST_UNRELATED"] == "kept"


def test_run_ranks(tmp_path):
    prog = "import os; print('HELLO rank', os.environ['R'])"
    envs = [dict(clean_env(), R=str(r)) for r in range(2)]
    outs = run_ranks([[sys.executable, "-c", prog]] * 2, envs, "HELLO rank {rank}",
                     timeout=60, cwd=tmp_path)
    assert outs == ["HELLO rank 0\n", "HELLO rank 1\n"]
    with pytest.raises(AssertionError, match="rank 1: exit 3"):
        run_ranks([[sys.executable, "-c", "pass"],
                   [sys.executable, "-c", "raise SystemExit(3)"]],
                  [clean_env()] * 2, "", timeout=60)


def test_unknown_case_from_the_command_line(tmp_path):
    script = tmp_path / "my_cases.py"
    script.write_text(CASE_FILE)
    proc = subprocess.run([sys.executable, str(script), "nope"], capture_output=True,
                          text=True, timeout=60, env=clean_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert "unknown SPMD case 'nope'; known cases: ring, fails" in proc.stderr
    assert "CASE-OK" not in proc.stdout


@pytest.mark.parametrize("nranks", [1, 2])
def test_run_case_end_to_end(tmp_path, nranks):
    script = tmp_path / "my_cases.py"
    script.write_text(CASE_FILE)
    proc = run_case(script, "ring", nranks, timeout=60)
    for r in range(nranks):
        assert f"[{r}] CASE-OK ring rank {r}" in proc.stdout


def test_run_case_reports_a_failing_case(tmp_path):
    script = tmp_path / "my_cases.py"
    script.write_text(CASE_FILE)
    with pytest.raises(AssertionError, match=r"(?s)^exit 1\n.*boom-marker"):
        run_case(script, "fails", 1, timeout=60)
