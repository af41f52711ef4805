"""Which UCX a process loads (``UCXCOMM_UCX``): the mpich wheel's verbs UCX for real, in
jobs and in ``ucxcomm info``; bad values at ``init()``; ``auto``'s decision on recorded
device listings; a UCX loaded before ucxcomm (an MPI library) is kept."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucxcomm
from ucxcomm import testing
from ucxcomm.errors import UnsupportedError
from ucxcomm.transport import config as tc
from ucxcomm.transport import library

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "transports"
MPICH = library.pip_installed().get("mpich")
# The test extra installs mpich (its UCX is the rdma extra's): a missing one is a broken
# environment, not a reason to skip.
assert MPICH, "the mpich package (test extra) is not installed"

RANK_PROG = """
import asyncio, ucxcomm
from ucxcomm.transport import _ucx

async def main():
    comm = await ucxcomm.init()
    peer = (comm.rank + 1) % comm.size
    got = await comm.sendrecv(comm.rank, peer, source=(comm.rank - 1) % comm.size)
    win = await ucxcomm.Win.Allocate(comm, 8)  # (an RMA engine: one more UCX context)
    await win.Free()
    print(f"UCX rank {comm.rank} {_ucx.ucx_version()} {_ucx.libucp_path()} "
          f"{_ucx.library.source} got {got}")
    await ucxcomm.finalize()

asyncio.run(main())
"""


def info(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ucxcomm.cli", "info", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(testing.clean_env(), **env), stdin=subprocess.DEVNULL)


def test_a_job_on_mpichs_ucx(tmp_path):
    prog = tmp_path / "which_ucx.py"
    prog.write_text(RANK_PROG)
    proc = testing.launch(2, [sys.executable, str(prog)], timeout=60,
                          env={"UCXCOMM_UCX": "mpich"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        line = next(li for li in proc.stdout.splitlines() if f"UCX rank {rank} " in li)
        assert f" 1.20.1 {MPICH} mpich got {(rank - 1) % 2}" in line, line
    # UCX 1.20 printed "UCX WARN UCP API version is incompatible: required >= 1.21" to
    # stdout at every context (ucxx and our extension use 1.21's headers): now logged
    # once at info level.
    assert "WARN" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_info_names_mpichs_ucx_and_why():
    proc = info({"UCXCOMM_UCX": "mpich"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ucx_version"] == "1.20.1"
    assert report["libucp"] == MPICH
    assert report["ucx_source"] == "mpich"
    assert report["ucx_source_why"] == "UCXCOMM_UCX=mpich: the UCX inside the mpich package"
    assert report["verbs"] is True and report["rdmacm"] is True
    # Resources listed by the wheel's ucx_info running on mpich's libraries.
    assert "tcp/lo (network)" in report["ucx_resources"]
    # Regression (issue 14): ucxx reports CUDA support whenever UCX_TLS allows CUDA
    # ("all" here, no RDMA port), although mpich's UCX has no CUDA module at all.
    assert report["cuda_support"] is False


def test_cuda_support_needs_the_cuda_module(tmp_path):
    with_cuda = _fake_ucx(tmp_path / "a", "wheel", ["uct_cma", "uct_cuda"])
    without = _fake_ucx(tmp_path / "b", "mpich", ["uct_ib", "uct_rdmacm", "uct_cma"])
    assert tc.ucx_has_cuda(str(with_cuda))
    assert not tc.ucx_has_cuda(str(without))


def test_a_path_names_a_ucx_too(tmp_path):
    # The directory, the libucp file itself, or (here) a prefix whose lib/ holds it.
    prefix = tmp_path / "ucx"
    prefix.mkdir()
    (prefix / "lib").symlink_to(os.path.dirname(MPICH))
    for value in (str(prefix), MPICH):
        report = json.loads(info({"UCXCOMM_UCX": value}).stdout)
        assert report["ucx_version"] == "1.20.1", value
        assert report["ucx_source"] == "path"


def test_system_is_what_the_loader_finds_at_start():
    """The route the issue verified by hand: the loader's path set when the process
    starts (here mpich's directory: its libucp.so.0 is found by soname)."""
    report = json.loads(info({"UCXCOMM_UCX": "system",
                              "LD_LIBRARY_PATH": os.path.dirname(MPICH)}).stdout)
    assert report["ucx_version"] == "1.20.1" and report["libucp"] == MPICH
    assert report["ucx_source"] == "system"


def test_auto_without_an_rdma_port_keeps_the_wheel():
    report = json.loads(info({"UCXCOMM_UCX": "auto"}).stdout)
    active = [p.name for p in tc.scan_sysfs() if p.active]
    if not active:  # this machine (and CI): no RDMA
        assert report["ucx_source"] == "wheel"
        assert report["ucx_source_why"] == ("UCXCOMM_UCX=auto: no active RDMA port, so the "
                                            "libucx wheel's UCX (ucxx's default)")
        assert report["ucx_version"].startswith("1.21.")
    else:
        assert active[0] in report["ucx_source_why"]


@pytest.mark.parametrize("value, message", [
    ("infiniband", "UCXCOMM_UCX='infiniband': must be auto, wheel, system, mpich or the "
                   "path of a UCX install"),
    ("/nonexistent/ucx", "UCXCOMM_UCX='/nonexistent/ucx': no libucp.so.0 in /nonexistent/ucx, "
                         "/nonexistent/ucx/lib or /nonexistent/ucx/lib64"),
])
def test_a_bad_value_fails_at_init(monkeypatch, value, message):
    monkeypatch.setenv("UCXCOMM_UCX", value)
    with pytest.raises(ValueError) as exc:
        ucxcomm.init()  # the call itself, before anything is awaited
    assert str(exc.value) == message
    proc = info({"UCXCOMM_UCX": value})
    assert proc.returncode == 1 and proc.stderr == f"ucxcomm info: {message}\n"


def test_a_file_that_is_not_libucp_is_refused(tmp_path):
    other = tmp_path / "libfoo.so"
    other.write_text("")
    with pytest.raises(ValueError, match="is not a libucp shared object"):
        library.requested({"UCXCOMM_UCX": str(other)})


def test_probe_reads_the_version_in_a_child():
    before = library.loaded_libucp()  # (earlier tests of the session may have loaded one)
    version, ibverbs = library.probe(MPICH)
    assert version == (1, 20, 1)
    try:
        ctypes.CDLL("libibverbs.so.1")
        here = True
    except OSError:
        here = False
    assert ibverbs is here
    assert library.loaded_libucp() == before  # the probe loaded nothing into this process


def _rxe_sysfs(tmp_path: Path) -> str:
    from test_transport_policy import sysfs

    return sysfs(tmp_path, "rxe")


def _fake_ucx(tmp_path: Path, name: str, modules: list[str]) -> str:
    from test_transport_policy import ucx_install

    return ucx_install(tmp_path / name, modules)


@pytest.mark.parametrize("probed, picked, why", [
    (((1, 20, 1), True), "mpich", "the UCX 1.20.1 inside the mpich package (verbs, rdmacm)"),
    (((1, 20, 1), False), "ucxx", "mpich's UCX needs libibverbs.so.1 (Debian: apt-get "
                                  "install libibverbs1 ibverbs-providers)"),
    (((1, 18, 0), True), "ucxx", "mpich's UCX 1.18.0 is older than 1.19"),
])
def test_auto_with_an_rdma_port(tmp_path, monkeypatch, probed, picked, why):
    """auto on a recorded soft-RoCE host whose wheel UCX has no verbs: the verbs UCX pip
    installed is taken only if it loads with libibverbs and is new enough (its probe's
    findings are recorded, as the device listings are)."""
    monkeypatch.delenv("UCX_MODULE_DIR", raising=False)
    root = _rxe_sysfs(tmp_path)
    wheel = _fake_ucx(tmp_path, "wheel", ["uct_cma", "uct_cuda"])
    copy = _fake_ucx(tmp_path, "mpich", ["uct_ib", "uct_rdmacm", "uct_cma"])
    choice = library.choose("auto", {}, sysfs=root, probe_fn=lambda _: probed,
                            installed={"mpich": copy}, wheel=wheel, already="")
    assert choice.source == picked
    assert choice.libucp == (copy if picked == "mpich" else None)
    assert "rxe0:1 soft-RoCE" in choice.reason and why in choice.reason
    # Without the port, or with a wheel that has verbs, the wheel stays and nothing runs.
    for sysroot, whl in ((str(tmp_path / "none"), wheel),
                         (root, _fake_ucx(tmp_path, "verbs-wheel", ["uct_ib"]))):
        kept = library.choose("auto", {}, sysfs=sysroot, probe_fn=None,  # type: ignore
                              installed={"mpich": copy}, wheel=whl, already="")
        assert kept.source == "ucxx" and kept.libucp is None


def test_ucxx_loader_when_the_user_prefers_the_system_library(tmp_path):
    choice = library.choose("auto", {"RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true"},
                            sysfs=_rxe_sysfs(tmp_path), installed={}, wheel=None,
                            already="")
    assert choice.source == "ucxx" and "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" in choice.reason


def test_an_mpi_library_loaded_first_keeps_its_ucx(tmp_path):
    """MPICH links libucp.so.0: loaded before ucxcomm (``from mpi4py import MPI`` does),
    ucxx's wheel loader then added the wheel's UCX on top and ``import ucxx`` failed
    ("undefined symbol: ucs_ifname_to_ndev_index"). Now the loaded UCX is kept; and an
    explicit choice of another UCX says why it cannot be had."""
    libmpi = os.path.join(os.path.dirname(os.path.dirname(MPICH)), "libmpi.so.12")
    prog = tmp_path / "mpi_first.py"
    prog.write_text(f"""
import ctypes
ctypes.CDLL({libmpi!r}, ctypes.RTLD_GLOBAL)  # as mpi4py loads MPICH
""" + RANK_PROG)
    proc = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                          timeout=60, env=testing.clean_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"UCX rank 0 1.20.1 {MPICH} preloaded got 0" in proc.stdout
    proc = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                          timeout=60, env=dict(testing.clean_env(), UCXCOMM_UCX="wheel"),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1
    assert (f"UnsupportedError: UCXCOMM_UCX=wheel, but the UCX at {MPICH} was loaded into "
            "this process before ucxcomm") in proc.stderr


def test_clean_env_keeps_the_ucx_choice(monkeypatch):
    """Ranks started by run_ranks(clean_env()) loaded the wheel's UCX while the suite ran
    with UCXCOMM_UCX=mpich: clean_env dropped it with the launcher variables."""
    monkeypatch.setenv("UCXCOMM_UCX", "mpich")
    monkeypatch.setenv("UCXCOMM_RANK", "1")
    env = testing.clean_env()
    assert env["UCXCOMM_UCX"] == "mpich" and "UCXCOMM_RANK" not in env


def test_unsupported_when_the_named_package_is_missing():
    with pytest.raises(UnsupportedError, match=r"the mpich package is not installed \(pip "
                       r"install 'ucxcomm\[rdma\]' installs it\)"):
        library.choose("mpich", {}, installed={}, wheel=None, already="")


def test_the_wheel_loader_stays_off_after_another_ucx_was_chosen(tmp_path):
    """Review finding: the libucx wheel's load_library() was restored after ``import
    ucxx``, so a later caller (ucx-py, distributed-ucxx) loaded the wheel's UCX next to
    mpich's: two copies in one process."""
    prog = tmp_path / "later_loader.py"
    prog.write_text("""
import asyncio

import libucx

import ucxcomm


async def main():
    async with ucxcomm.init():
        pass

asyncio.run(main())
libucx.load_library()  # what another UCX user in the process would call
maps = open("/proc/self/maps").read().splitlines()
print("LIBUCP", sorted({ln.split()[-1] for ln in maps if "libucp.so" in ln}))
""")
    proc = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                          timeout=60, env=dict(testing.clean_env(), UCXCOMM_UCX="mpich"),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"LIBUCP ['{MPICH}']" in proc.stdout, proc.stdout
