"""Transport selection: detection on recorded device listings, the policy's decisions,
and, for real on this machine (no RDMA), `ucxcomm info` and `transport=` at init."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucxcomm.errors import PeerFailure, UnsupportedError
from ucxcomm.testing import launch, run_case
from ucxcomm.transport import config as tc

#: What every plan sets (endpoints resolved when made: see transport/config.py).
RESOLVE = {"RESOLVE_REMOTE_EP_ID": "y"}

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "transports"


def sysfs(tmp_path: Path, name: str) -> str:
    """Materialize tests/data/transports/sysfs-<name>.txt as a directory tree."""
    root = tmp_path / f"sys-{name}" / "infiniband"
    root.mkdir(parents=True)
    for line in (DATA / f"sysfs-{name}.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if " -> " in line:
            path, target = line.split(" -> ")
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, root / path)
        else:
            path, content = line.split(": ", 1)
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(content + "\n")
    return str(root)


def ucx_install(tmp_path: Path, modules: list[str]) -> str:
    """A fake UCX lib dir with these loadable modules; returns the libucp path."""
    lib = tmp_path / ("lib-" + "-".join(modules))
    (lib / "ucx").mkdir(parents=True, exist_ok=True)
    for m in modules:
        (lib / "ucx" / f"lib{m}.so.0").write_text("")
    (lib / "libucp.so.0").write_text("")
    return str(lib / "libucp.so.0")


VERBS = ["uct_ib", "uct_rdmacm", "uct_cma"]
WHEEL = ["uct_cma", "uct_cuda"]  # what the PyPI libucx wheel ships


def detection(tmp_path, tree: str | None, modules=VERBS) -> tc.Detection:
    root = sysfs(tmp_path, tree) if tree else str(tmp_path / "none")
    return tc.detect(ucx_install(tmp_path, modules), sysfs=root)


@pytest.fixture(autouse=True)
def _no_module_dir(monkeypatch):
    monkeypatch.delenv("UCX_MODULE_DIR", raising=False)


# ------------------------------------------------------------------ detection
def test_scan_mlx5_infiniband(tmp_path):
    ports = tc.scan_sysfs(sysfs(tmp_path, "mlx5-ib-cx6"))
    assert [(p.name, p.kind, p.state, p.driver, p.hca_type) for p in ports] == [
        ("mlx5_0:1", "InfiniBand", "ACTIVE", "mlx5", "MT4123"),
        ("mlx5_1:1", "InfiniBand", "DOWN", "mlx5", "MT4123")]
    assert tc.tag_matching(ports[0]) == (True, "mlx5_0:1 (MT4123) is ConnectX-5 or later")


def test_scan_roce_cx4_and_rxe(tmp_path):
    (roce,) = tc.scan_sysfs(sysfs(tmp_path, "mlx5-roce-cx5"))
    assert roce.kind == "RoCE" and tc.tag_matching(roce)[0]
    (cx4,) = tc.scan_sysfs(sysfs(tmp_path, "mlx5-ib-cx4"))
    assert tc.tag_matching(cx4) == (False, "mlx5_0:1 is a ConnectX-4: no tag matching")
    (rxe,) = tc.scan_sysfs(sysfs(tmp_path, "rxe"))
    assert (rxe.driver, rxe.kind, rxe.active) == ("rxe", "soft-RoCE", True)
    assert tc.tag_matching(rxe) == (False, "rxe0:1 is soft-RoCE: no hardware tag matching")


def test_no_rdma_and_modules(tmp_path):
    assert tc.scan_sysfs(str(tmp_path / "missing")) == []
    det = detection(tmp_path, None, WHEEL)
    assert not det.verbs and not det.rdmacm and det.ports == []
    assert det.modules == {"uct_cma", "uct_cuda"}


@pytest.mark.parametrize("name,expected", [
    ("mlx5-ib", {("rc_verbs", "mlx5_0:1", "network"), ("rc_mlx5", "mlx5_0:1", "network"),
                 ("dc_mlx5", "mlx5_0:1", "network"), ("ud_verbs", "mlx5_0:1", "network"),
                 ("ud_mlx5", "mlx5_0:1", "network"), ("tcp", "ib0", "network"),
                 ("sysv", "memory", "intra-node"), ("cma", "memory", "intra-node"),
                 ("self", "memory", "loopback")}),
    ("rxe", {("rc_verbs", "rxe0:1", "network"), ("ud_verbs", "rxe0:1", "network"),
             ("tcp", "eth0", "network"), ("posix", "memory", "intra-node")}),
    ("no-rdma", {("self", "memory", "loopback"), ("tcp", "eth0", "network"),
                 ("tcp", "lo", "network"), ("posix", "memory", "intra-node"),
                 ("cma", "memory", "intra-node")}),
])
def test_parse_ucx_info(name, expected):
    got = tc.parse_ucx_info_devices((DATA / f"ucx_info-{name}.txt").read_text())
    assert set(got) == expected and len(got) == len(expected)
    rdma = {tl for tl, _, _ in got if tc.lane_kind(tl) == "rdma"}
    assert bool(rdma) == (name != "no-rdma")


def test_ucx_info_of_this_machine():
    """The real `ucx_info -d` of the UCX we load: no RDMA transport here."""
    from ucxcomm.transport import _ucx
    from ucxcomm.transport.info import ucx_info_devices

    got = ucx_info_devices(_ucx.libucp_path())
    assert got, "ucx_info not found next to libucp"
    assert any(r.startswith("tcp/") for r in got)
    if not os.path.isdir("/sys/class/infiniband"):
        assert not any(tc.lane_kind(r.split("/")[0]) == "rdma" for r in got)


# ------------------------------------------------------------------ decisions
def test_auto_on_connectx6_enables_rdma_and_tag_offload(tmp_path):
    p = tc.plan(tc.policy_from(env={}), detection(tmp_path, "mlx5-ib-cx6"), env={})
    assert p.rdma and p.tag_offload
    assert "TLS" not in p.config  # auto: UCX picks RDMA, shm and TCP per peer
    assert p.env == {"UCX_RC_MLX5_TM_ENABLE": "y", "UCX_DC_MLX5_TM_ENABLE": "y"}
    assert any("mlx5_0:1 InfiniBand" in r for r in p.reasons)


def test_roce_tag_offload_is_rc_only(tmp_path):
    p = tc.plan(tc.policy_from(env={}), detection(tmp_path, "mlx5-roce-cx5"), env={})
    assert p.tag_offload and p.env == {"UCX_RC_MLX5_TM_ENABLE": "y"}


@pytest.mark.parametrize("tree,why", [("mlx5-ib-cx4", "ConnectX-4"), ("rxe", "soft-RoCE")])
def test_rdma_without_tag_matching(tmp_path, tree, why):
    det = detection(tmp_path, tree)
    p = tc.plan(tc.policy_from(env={}), det, env={})
    assert p.rdma and not p.tag_offload and not p.env
    assert any(r.startswith("tag offload off") and why in r for r in p.reasons)
    with pytest.raises(UnsupportedError, match=why):
        tc.plan(tc.policy_from(tag_offload=True, env={}), det, env={})


def test_pypi_wheel_ucx_means_no_rdma(tmp_path):
    """An mlx5 device, but the loaded UCX has no verbs: auto falls back to TCP and
    says how to load another UCX; rdma fails fast with that advice."""
    det = detection(tmp_path, "mlx5-ib-cx6", WHEEL)
    p = tc.plan(tc.policy_from(env={}), det, env={})
    assert not p.rdma and not p.tag_offload
    assert p.no_rdma == ["the loaded UCX has no verbs support"]
    with pytest.raises(UnsupportedError, match="UCXCOMM_UCX"):
        tc.plan(tc.policy_from("rdma", env={}), det, env={})


def test_rdma_needs_an_active_port(tmp_path):
    det = detection(tmp_path, "mlx5-ib-cx6")
    with pytest.raises(UnsupportedError, match="mlx5_9:1 not found"):
        tc.plan(tc.policy_from("rdma", devices="mlx5_9:1", env={}), det, env={})
    with pytest.raises(UnsupportedError, match="no active RDMA port"):
        tc.plan(tc.policy_from("rdma", devices=["mlx5_1:1"], env={}), det, env={})
    p = tc.plan(tc.policy_from("rdma", devices=["mlx5_0:1"], env={}), det, env={})
    assert p.config == {"TLS": "rc,ud,dc,sm,self", "NET_DEVICES": "mlx5_0:1", **RESOLVE}


def test_no_device_at_all(tmp_path):
    det = detection(tmp_path, None, WHEEL)
    with pytest.raises(UnsupportedError, match="no RDMA device under /sys/class/infiniband"):
        tc.plan(tc.policy_from("rdma", env={}), det, env={})
    p = tc.plan(tc.policy_from("tcp", env={}), det, env={})
    assert p.config == {"TLS": "tcp,sm,self", **RESOLVE} and not p.rdma and not p.tag_offload


def test_user_ucx_variables_win(tmp_path):
    det = detection(tmp_path, "mlx5-ib-cx6")
    env = {"UCX_TLS": "rc,self", "UCX_RC_MLX5_TM_ENABLE": "n", "UCX_TM_THRESH": "2048"}
    p = tc.plan(tc.policy_from("rdma", env={}), det, env=env)
    assert "TLS" not in p.config and not p.tag_offload
    assert "UCX_RC_MLX5_TM_ENABLE" not in p.env and "UCX_TM_THRESH" not in p.env
    assert any("UCX_TLS=rc,self set by you" in r for r in p.reasons)
    assert p.user_overrides == env


def test_oversized_shared_memory_segments_are_refused(tmp_path):
    """UCX writes a shared-memory fragment's length in 16 bits: segments over 65535 bytes
    lose or corrupt messages, so the plan refuses them (every spelling UCX reads)."""
    det, pol = detection(tmp_path, None, WHEEL), tc.policy_from("auto", env={})
    for var, value in (("UCX_MM_SEG_SIZE", "65536"), ("UCX_MM_SEG_SIZE", "64k"),
                       ("UCX_SYSV_SEG_SIZE", "128KB"), ("UCX_POSIX_SEG_SIZE", " 1m ")):
        with pytest.raises(UnsupportedError, match=f"{var}=.*over 65535 bytes"):
            tc.plan(pol, det, env={var: value})
    for value in ("65535", "8256", "32k", "auto", "inf", ""):  # fine, or left to UCX
        tc.plan(pol, det, env={"UCX_MM_SEG_SIZE": value})


def test_policy_from_environment_and_thresholds(tmp_path):
    env = {"UCXCOMM_TRANSPORT": "RDMA", "UCXCOMM_TAG_OFFLOAD": "off",
           "UCXCOMM_DEVICES": "mlx5_0:1, mlx5_1:1", "UCXCOMM_TM_THRESH": "4096",
           "UCXCOMM_TM_MAX_BB_SIZE": "8192"}
    pol = tc.policy_from(env=env)
    assert (pol.transport, pol.tag_offload, pol.devices) == ("rdma", False,
                                                             ["mlx5_0:1", "mlx5_1:1"])
    assert tc.policy_from("tcp", True, env=env).transport == "tcp"  # arguments first
    pol = tc.policy_from(env={"UCXCOMM_TM_THRESH": "4096", "UCXCOMM_TM_MAX_BB_SIZE": "8192"})
    p = tc.plan(pol, detection(tmp_path, "mlx5-ib-cx6"), env={})
    assert p.env["UCX_TM_THRESH"] == "4096" and p.env["UCX_TM_MAX_BB_SIZE"] == "8192"
    for bad in ({"UCXCOMM_TRANSPORT": "verbs"}, {"UCXCOMM_TAG_OFFLOAD": "maybe"},
                {"UCXCOMM_TM_THRESH": "big"}):
        with pytest.raises(ValueError):
            tc.policy_from(env=bad)


def test_rdma_policy_refuses_a_tcp_only_peer(tmp_path, caplog):
    """The per-peer lane check (run by Worker.connect on every new endpoint)."""
    det = detection(tmp_path, "mlx5-ib-cx6")
    strict = tc.plan(tc.policy_from("rdma", env={}), det, env={})
    with pytest.raises(PeerFailure, match="not reachable over RDMA") as info:
        tc.check_lanes(strict, 3, [("tcp", "eth0")])
    assert info.value.peer == 3
    tc.check_lanes(strict, 1, [("rc_mlx5", "mlx5_0:1")])  # fine
    tc.check_lanes(strict, 1, [("sysv", "memory"), ("cma", "memory")])
    relaxed = tc.plan(tc.policy_from("auto", env={}), det, env={})
    tc.check_lanes(relaxed, 2, [("tcp", "eth0")])  # logged, not raised
    assert "reached without RDMA" in caplog.text


# ------------------------------------------------------------------ this machine, for real
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ucxcomm.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, **(env or {})},
                          stdin=subprocess.DEVNULL)


@pytest.mark.skipif(os.path.isdir("/sys/class/infiniband"), reason="this host has RDMA")
def test_info_says_no_rdma_and_why():
    proc = _cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["rdma"] is False
    assert report["rdma_why"].startswith("no RDMA device under /sys/class/infiniband")
    assert report["tag_offload"] is False and "needs RDMA" in report["tag_offload_why"]
    if not report["verbs"]:
        assert "UCXCOMM_UCX" in report["verbs_why"]
    assert report["transport"] == "auto" and report["ucx_resources"]
    tcp = json.loads(_cli("info", "--json", "--transport", "tcp").stdout)
    assert tcp["UCX_TLS"] == "tcp,sm,self" and tcp["tag_offload"] is False
    proc = _cli("info", "--transport", "rdma")
    assert proc.returncode == 1 and "transport='rdma' is not available" in proc.stderr
    proc = _cli("info", "--tag-offload", "on")
    assert proc.returncode == 1 and "tag_offload=True" in proc.stderr


@pytest.mark.skipif(os.path.isdir("/sys/class/infiniband"), reason="this host has RDMA")
def test_init_rdma_fails_fast_here():
    """Every rank fails at init with the reason, before connecting to anything."""
    prog = ("import asyncio, ucxcomm\n"
            "async def main():\n"
            "    try:\n"
            "        await ucxcomm.init(transport='rdma')\n"
            "    except ucxcomm.UnsupportedError as exc:\n"
            "        print('REFUSED', exc, flush=True)\n"
            "        raise SystemExit(3)\n"
            "asyncio.run(main())\n")
    proc = launch(2, [sys.executable, "-c", prog], timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "REFUSED transport='rdma' is not available: no RDMA device" in proc.stdout
    with pytest.raises(ValueError, match="transport must be one of"):
        import ucxcomm

        ucxcomm.init(transport="infiniband")


def test_oversized_segment_refused_at_init():
    """With UCX_MM_SEG_SIZE=128k this UCX delivered a 100 000-byte message with its first
    64 KiB zero (and with 64k it never delivered it): init now refuses the setting."""
    prog = ("import asyncio, numpy as np, ucxcomm\n"
            "async def main():\n"
            "    try:\n"
            "        comm = await ucxcomm.init()\n"
            "    except ucxcomm.UnsupportedError as exc:\n"
            "        print('REFUSED', exc, flush=True)\n"
            "        raise SystemExit(3)\n"
            "    async with comm:\n"
            "        if comm.rank == 0:\n"
            "            await comm.Send(np.arange(100000, dtype=np.uint8), 1)\n"
            "        else:\n"
            "            b = np.zeros(100000, np.uint8)\n"
            "            await comm.Recv(b, 0)\n"
            "            ok = np.array_equal(b, np.arange(100000, dtype=np.uint8))\n"
            "            print('DATA', 'intact' if ok else 'corrupt', flush=True)\n"
            "asyncio.run(main())\n")
    proc = launch(2, [sys.executable, "-c", prog], timeout=30,
                  env={"UCX_MM_SEG_SIZE": "128k"})
    # (the launcher stops the other rank once one fails: it may not get to print)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "REFUSED UCX_MM_SEG_SIZE=128k (131072 bytes)" in proc.stdout, proc.stdout
    assert "DATA" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", ["ring_objects", "buffers_all_kinds"])
def test_p2p_with_transport_tcp(name):
    """transport='tcp' (via UCXCOMM_TRANSPORT): the p2p cases pass on its plan."""
    run_case(ROOT / "tests" / "spmd" / "p2p_cases.py", name, 2, env={"UCXCOMM_TRANSPORT": "tcp"})
