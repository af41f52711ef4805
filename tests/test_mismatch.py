"""Collective fingerprints (issue 31): ranks whose calls differ all raise
``CollectiveMismatch`` naming the calls, within a deadline, with nothing written into a
receive buffer, and go on with the next matching collective; ``comm/fingerprint.py``'s
verdict on hostile or odd messages."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import ucxcomm
from ucxcomm.comm import fingerprint as fpm
from ucxcomm.testing import launch, run_case

CASES = Path(__file__).resolve().parent / "spmd" / "mismatch_cases.py"


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_every_mismatch_raises_everywhere(nranks):
    run_case(CASES, "every_mismatch_raises_everywhere", nranks, timeout=240)


@pytest.mark.parametrize("nranks", [2, 3])
def test_every_mismatch_when_receives_wait(nranks):
    """The same with no spinning: every receive of the checked exchange waits (the
    compiled call hands its scratch to the Python side, which checks it)."""
    run_case(CASES, "every_mismatch_raises_everywhere", nranks, timeout=240,
             env={"UCXCOMM_SPIN_US": "0"})


@pytest.mark.parametrize("nranks", [2, 3])
def test_matching_calls_of_mixed_buffers(nranks):
    run_case(CASES, "matching_calls_of_mixed_buffers", nranks)


@pytest.mark.parametrize("checks", ["1", "0"])
def test_failures_fail_everywhere(checks):
    run_case(CASES, "failures_fail_everywhere", 3, env={"UCXCOMM_CHECK_COLLECTIVES": checks})


def _fp(kind="Allreduce", **kw):
    return fpm.make(kind, **{"dtype": np.float64, "count": 4, "op": ucxcomm.SUM, **kw})


def test_verdict_names_each_call():
    fps = [_fp(), _fp(count=5), _fp()]
    err = fpm.verdict(fps, "Allreduce", 7)
    assert isinstance(err, ucxcomm.CollectiveMismatch)
    assert str(err) == ("collective #7 does not match: rank 1 called "
                        "Allreduce(float64[5], SUM) where ranks 0, 2 called "
                        "Allreduce(float64[4], SUM)")
    assert err.calls[1] == "Allreduce(float64[5], SUM)" and err.seq == 7
    assert fpm.verdict([_fp(), _fp()], "Allreduce", 0) is None


def test_verdict_on_hostile_messages():
    """Short, foreign, odd-length and lying messages give a verdict, never a crash."""
    good = _fp()
    for bad in (b"", b"\x00" * 40, good[:31], b"\xc5" + b"\xff" * 31,
                fpm.make("Alltoallv", count=-1, vec=[1, 2, 3]) + b"\x01\x02\x03",
                fpm.make("Alltoallv", count=-1, vec=[1] * 10**3)):
        err = fpm.verdict([good, bad], "Allreduce", 1)
        assert isinstance(err, ucxcomm.CollectiveMismatch), bad[:8]
        str(err)
    # per-rank counts of the wrong length
    short = fpm.make("Alltoallv", count=-1, vec=[1, 1])
    err = fpm.verdict([short, short], "Alltoallv", 2)
    assert isinstance(err, ucxcomm.CollectiveMismatch) and "counts" in str(err)


def test_capacity_holds_any_first_message():
    for size in (2, 32, 33, 1000):
        longest = len(fpm.make("Alltoallv", count=-1, vec=[0] * 2 * size))
        assert fpm.capacity(size) >= longest
        if size <= fpm.SMALL_MAX_RANKS:  # (the combined form: fingerprint and data)
            assert fpm.capacity(size) >= fpm.HDR + fpm.SMALL_MAX
    assert fpm.capacity(1000) == fpm.HDR + 16 * 1000  # (not 8 KiB per rank per call)


def test_descriptions_are_the_same_on_every_rank():
    """A user's own op is shown by its code (only the built-in ops by name: every rank
    can name those); a peer's dtype code is never parsed as a dtype string."""
    mine = fpm.make("Allreduce", op=ucxcomm.Op("MYOP", lambda a, b: a), dtype=np.float64,
                    count=2)
    assert "MYOP" not in fpm.describe(mine) and "op 0x" in fpm.describe(mine)
    assert "SUM" in fpm.describe(_fp())
    hostile = bytearray(_fp())
    for code in (ord(",") << 24 | 5, ord("1") << 24 | 5, 0xFFFFFFFF):
        hostile[12:16] = code.to_bytes(4, "little")
        assert "dtype code" in fpm.describe(bytes(hostile))


@pytest.mark.parametrize("nranks", [2, 3])
def test_torch_backend_names_mismatches(nranks):
    """torch.distributed on the ucxcomm backend: a dtype mismatch in all_reduce and a
    root mismatch in broadcast raise on every rank, naming the calls."""
    pytest.importorskip("torch", reason="the torch backend needs torch ('ucxcomm[torch]')")

    prog = str(Path(__file__).resolve().parent / "spmd" / "torch_prog.py")
    proc = launch(nranks, [sys.executable, prog, "mismatch"], timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(nranks):
        assert f"TORCH-OK mismatch rank {r}" in proc.stdout, out[-4000:]
