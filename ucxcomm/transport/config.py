"""Transport policy: RDMA when present, hardware tag matching when capable, TCP otherwise.

Detection reads sysfs and the loaded UCX's module directory; :func:`plan` (pure, tested on
recorded listings) turns a :class:`Policy` and a :class:`Detection` into the UCX context
options and environment variables to use, with a reason for every choice; only
:func:`prepare` loads UCX (to learn which libucp is in use). A
:class:`~ucxcomm.transport.worker.Worker` builds both of its UCX contexts (tag messages
and RMA) from the plan's options, and enforces it on every new endpoint
(:func:`check_lanes`); ``ucxcomm info`` prints it.

Precedence: explicit ``init(transport=..., tag_offload=..., devices=...)`` arguments,
then ``UCXCOMM_TRANSPORT`` / ``UCXCOMM_TAG_OFFLOAD`` / ``UCXCOMM_DEVICES``, then
``"auto"``. A ``UCX_*`` variable the user set always wins over what the plan would set.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import settings
from ..errors import PeerFailure, UnsupportedError

__all__ = ["Detection", "Plan", "Policy", "RdmaPort", "check_lanes", "detect", "lane_kind",
           "parse_ucx_info_devices", "plan", "policy_from", "prepare", "scan_sysfs",
           "tag_matching", "ucx_modules"]

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "rdma", "tcp")
RDMA_TLS = frozenset({"rc", "rc_verbs", "rc_mlx5", "ud", "ud_verbs", "ud_mlx5", "dc",
                      "dc_mlx5", "srd", "rc_x", "ud_x", "dc_x"})
SHM_TLS = frozenset({"self", "sysv", "posix", "cma", "xpmem", "knem", "mm", "sm", "shm"})
GPU_TLS = frozenset({"cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc"})

# PCI device ids of mlx5 HCAs (sysfs ``hca_type``) that have hardware tag matching:
# ConnectX-5 and later, and the BlueField DPUs built on them. ConnectX-4 (MT4115-4118)
# and ConnectX-3 (mlx4) do not.
_TM_HCA = frozenset({"MT4119", "MT4120", "MT4121", "MT4122", "MT4123", "MT4124", "MT4125",
                     "MT4126", "MT4127", "MT4128", "MT4129", "MT4130", "MT4131",
                     "MT41682", "MT41683", "MT41686", "MT41687", "MT41692", "MT41693"})
_NO_TM_HCA = {"MT4113": "Connect-IB", "MT4114": "Connect-IB VF", "MT4115": "ConnectX-4",
              "MT4116": "ConnectX-4 VF", "MT4117": "ConnectX-4 Lx",
              "MT4118": "ConnectX-4 Lx VF"}

_NO_VERBS_HINT = ("the loaded UCX has no verbs support (no libuct_ib module next to "
                  "{libucp}); the PyPI libucx wheels are built without verbs/rdmacm. Load "
                  "a UCX built with verbs instead: pip install 'ucxcomm[rdma]' (then "
                  "UCXCOMM_UCX=auto picks its UCX where an RDMA port is active; "
                  "UCXCOMM_UCX=mpich forces it), or UCXCOMM_UCX=system or a path for a "
                  "distribution, conda-forge or HPC-X UCX (docs/transports.md)")


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device, from ``/sys/class/infiniband``."""

    device: str  # mlx5_0, rxe0, ...
    port: int
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    state: str  # "ACTIVE", "DOWN", ...
    hca_type: str  # "MT4123" for mlx5, often "" for others
    driver: str  # mlx5, mlx4, rxe, siw, irdma, ...

    @property
    def name(self) -> str:
        """UCX's device name (``UCX_NET_DEVICES`` syntax)."""
        return f"{self.device}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state.upper().endswith("ACTIVE")

    @property
    def kind(self) -> str:
        if self.driver in ("rxe", "siw"):
            return f"soft-{'RoCE' if self.driver == 'rxe' else 'iWARP'}"
        return "InfiniBand" if self.link_layer == "InfiniBand" else "RoCE"


@dataclass
class Detection:
    """What this machine and the loaded UCX offer."""

    ports: list[RdmaPort] = field(default_factory=list)
    libucp: str = ""
    modules: set[str] = field(default_factory=set)  # uct_ib, uct_rdmacm, uct_cuda, ...
    cuda_device: bool = False

    @property
    def verbs(self) -> bool:
        return "uct_ib" in self.modules

    @property
    def rdmacm(self) -> bool:
        return "uct_rdmacm" in self.modules

    @property
    def active_ports(self) -> list[RdmaPort]:
        return [p for p in self.ports if p.active]


@dataclass
class Policy:
    transport: str = "auto"  # auto | rdma | tcp
    tag_offload: Any = "auto"  # "auto" | True | False
    devices: list[str] | None = None
    tm_thresh: int | None = None
    tm_max_bb_size: int | None = None


@dataclass
class Plan:
    """What to apply before the UCX context exists, and why."""

    policy: Policy
    config: dict[str, str] = field(default_factory=dict)  # UCX context options
    env: dict[str, str] = field(default_factory=dict)  # UCX_* variables to export
    rdma: bool = False
    tag_offload: bool = False
    reasons: list[str] = field(default_factory=list)
    user_overrides: dict[str, str] = field(default_factory=dict)
    no_rdma: list[str] = field(default_factory=list)  # why RDMA is unavailable

    def as_dict(self) -> dict[str, Any]:
        return {"transport": self.policy.transport, "rdma": self.rdma,
                "no_rdma": list(self.no_rdma),
                "tag_offload": self.tag_offload, "ucx_config": dict(self.config),
                "ucx_env": dict(self.env), "user_ucx_vars": dict(self.user_overrides),
                "reasons": list(self.reasons)}


# ------------------------------------------------------------------ detection
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def scan_sysfs(root: str = "/sys/class/infiniband") -> list[RdmaPort]:
    """Every port of every RDMA device under ``root`` (a sysfs tree or a copy of one)."""
    ports = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    for dev in devices:
        base = os.path.join(root, dev)
        driver = os.path.basename(os.path.realpath(os.path.join(base, "device", "driver")))
        if not driver or driver == "driver":
            driver = _read(os.path.join(base, "driver")) or re.sub(r"[_\d]+$", "", dev)
        driver = {"mlx5_core": "mlx5", "mlx4_core": "mlx4", "rdma_rxe": "rxe"}.get(driver,
                                                                                   driver)
        hca = _read(os.path.join(base, "hca_type"))
        try:
            port_ids = sorted(int(p) for p in os.listdir(os.path.join(base, "ports")))
        except (OSError, ValueError):
            port_ids = []
        for pid in port_ids:
            pdir = os.path.join(base, "ports", str(pid))
            state = _read(os.path.join(pdir, "state"))  # "4: ACTIVE"
            ports.append(RdmaPort(dev, pid, _read(os.path.join(pdir, "link_layer")),
                                  state.split(":")[-1].strip(), hca, driver))
    return ports


def ucx_modules(libucp: str) -> set[str]:
    """Names of the loadable UCX modules (``uct_ib``, ``uct_cuda``...) next to ``libucp``
    (UCX looks for them in ``<libdir>/ucx``; ``UCX_MODULE_DIR`` overrides)."""
    moddir = os.environ.get("UCX_MODULE_DIR") or os.path.join(os.path.dirname(libucp), "ucx")
    names = set()
    for path in glob.glob(os.path.join(moddir, "lib*.so*")):
        names.add(re.sub(r"^lib|\.so.*$", "", os.path.basename(path)))
    return names


def ucx_has_cuda(libucp: str) -> bool:
    """Whether the UCX at ``libucp`` has its CUDA transports (the ``uct_cuda`` module):
    mpich's private UCX, for one, has none."""
    return "uct_cuda" in ucx_modules(libucp)


def parse_ucx_info_devices(text: str) -> list[tuple[str, str, str]]:
    """``(transport, device, type)`` for each resource of a ``ucx_info -d`` listing."""
    out = []
    transport = None
    device = None
    for line in text.splitlines():
        line = line.lstrip("# ").rstrip()
        if line.startswith("Transport:"):
            transport, device = line.split(":", 1)[1].strip(), None
        elif line.startswith("Device:") and transport:
            device = line.split(":", 1)[1].strip()
            out.append((transport, device, ""))
        elif line.startswith("Type:") and transport and device:
            out[-1] = (transport, device, line.split(":", 1)[1].strip())
    return out


def tag_matching(port: RdmaPort) -> tuple[bool, str]:
    """Whether ``port`` has hardware tag matching, and why (not)."""
    if port.driver in ("rxe", "siw"):
        return False, f"{port.name} is {port.kind}: no hardware tag matching"
    if port.driver != "mlx5":
        return False, f"{port.name} ({port.driver}) is not an mlx5 device"
    if port.hca_type in _TM_HCA:
        return True, f"{port.name} ({port.hca_type}) is ConnectX-5 or later"
    if port.hca_type in _NO_TM_HCA:
        return False, f"{port.name} is a {_NO_TM_HCA[port.hca_type]}: no tag matching"
    return False, f"{port.name}: unknown mlx5 HCA type {port.hca_type or '?'}"


def detect(libucp: str, sysfs: str = "/sys/class/infiniband") -> Detection:
    """This machine: RDMA ports, the modules of the UCX at ``libucp``, a CUDA device."""
    return Detection(ports=scan_sysfs(sysfs), libucp=libucp, modules=ucx_modules(libucp),
                     cuda_device=os.path.exists("/dev/nvidiactl"))


# ------------------------------------------------------------------ policy
def policy_from(transport: str | None = None, tag_offload: Any = None,
                devices: Any = None, env: Mapping[str, str] | None = None) -> Policy:
    """The policy from explicit arguments, else ``UCXCOMM_*`` variables
    (:mod:`ucxcomm.settings`), else auto.

    Raises
    ------
    ValueError
        An unknown transport or a malformed value (argument or variable).
    """
    if transport is None:
        t = settings.get("UCXCOMM_TRANSPORT", env)
    else:
        t = str(transport).strip().lower()
        if t not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, "
                             f"got {transport!r}")
    if tag_offload is None:
        tm = settings.get("UCXCOMM_TAG_OFFLOAD", env)
    elif isinstance(tag_offload, bool) or tag_offload == "auto":
        tm = tag_offload
    else:
        try:
            tm = settings.SETTINGS["UCXCOMM_TAG_OFFLOAD"].parse(str(tag_offload))
        except ValueError:
            raise ValueError(f"tag_offload must be 'auto', True or False, got "
                             f"{tag_offload!r}") from None
    if devices is None:
        devs = settings.get("UCXCOMM_DEVICES", env)
    elif isinstance(devices, str):
        devs = [d.strip() for d in devices.split(",") if d.strip()] or None
    else:
        devs = [str(d) for d in devices] or None
    return Policy(t, tm, devs, settings.get("UCXCOMM_TM_THRESH", env),
                  settings.get("UCXCOMM_TM_MAX_BB_SIZE", env))


#: UCX's shared-memory segment size (``UCX_MM_SEG_SIZE``, or per transport). UCX 1.21 lets
#: one fragment fill a segment but writes a fragment's length into a 16-bit field of the
#: FIFO element (``uct_mm_fifo_element_t.length``): from 64 KiB a message of a segment's
#: size or more is lost (65536: the receive never completes) or arrives with zeros
#: (131072: the first 64 KiB of a 100 000-byte message). Refused at init instead.
_SEG_SIZE_VARS = ("UCX_MM_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_POSIX_SEG_SIZE",
                  "UCX_XPMEM_SEG_SIZE")
_SEG_SIZE_MAX = 65535
_MEMUNITS = re.compile(r"\s*(\d+)\s*([kmgt]?)b?\s*", re.IGNORECASE)


def check_user_variables(env: Mapping[str, str]) -> None:
    """Refuse ``UCX_*`` values that make this UCX lose or corrupt messages.

    Raises
    ------
    UnsupportedError
        A shared-memory segment size (``UCX_MM_SEG_SIZE`` and its per-transport forms)
        over 65535 bytes.
    """
    for var in _SEG_SIZE_VARS:
        m = _MEMUNITS.fullmatch(env.get(var, ""))
        if m is None:  # unset, or a form UCX itself judges (auto, inf, garbage)
            continue
        size = int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))
        if size > _SEG_SIZE_MAX:
            raise UnsupportedError(
                f"{var}={env[var]} ({size} bytes): UCX's shared-memory transport records "
                f"a fragment's length in 16 bits, so segments over {_SEG_SIZE_MAX} bytes "
                f"lose or corrupt messages of that size (a 64 KiB message never arrives "
                f"at 65536); set at most {_SEG_SIZE_MAX} or unset it")


def plan(policy: Policy, det: Detection, env: Mapping[str, str] | None = None) -> Plan:
    """Decide the UCX configuration for ``policy`` on ``det``; pure, testable.

    Raises
    ------
    UnsupportedError
        ``transport="rdma"`` without an active RDMA port or without a verbs-capable UCX,
        unknown ``devices`` in rdma mode, ``tag_offload=True`` without a capable
        device, or a ``UCX_*`` value this UCX mishandles (:func:`check_user_variables`)
        (raised before any UCX context is created).
    """
    env = os.environ if env is None else env
    check_user_variables(env)
    out = Plan(policy)
    out.user_overrides = {k: v for k, v in env.items()
                          if k in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_RC_MLX5_TM_ENABLE",
                                   "UCX_DC_MLX5_TM_ENABLE", "UCX_TM_THRESH",
                                   "UCX_TM_MAX_BB_SIZE")}
    active = det.active_ports
    if policy.devices:
        names = {p.name for p in det.ports} | {p.device for p in det.ports}
        wanted = [d for d in policy.devices if d.split(":")[0] in names or d in names]
        if policy.transport == "rdma" and len(wanted) < len(policy.devices):
            missing = sorted(set(policy.devices) - set(wanted))
            raise UnsupportedError(f"transport='rdma': device(s) {', '.join(missing)} not "
                                   f"found (RDMA ports here: "
                                   f"{', '.join(p.name for p in det.ports) or 'none'})")
        active = [p for p in active if p.name in policy.devices or p.device in policy.devices]
    why_no_rdma = []
    if not det.ports:
        why_no_rdma.append("no RDMA device under /sys/class/infiniband")
    elif not active:
        why_no_rdma.append("no active RDMA port (" + ", ".join(
            f"{p.name} {p.state or '?'}" for p in det.ports) + ")")
    if not det.verbs:
        why_no_rdma.append("the loaded UCX has no verbs support")
    out.rdma = not why_no_rdma
    out.no_rdma = why_no_rdma
    if policy.transport == "rdma" and not out.rdma:
        hint = "" if det.verbs else " (" + _NO_VERBS_HINT.format(
            libucp=det.libucp or "libucp") + ")"
        raise UnsupportedError("transport='rdma' is not available: " +
                               "; ".join(why_no_rdma) + hint)

    def put(key: str, value: str, reason: str) -> None:
        var = "UCX_" + key
        if var in env:
            out.reasons.append(f"{var}={env[var]} set by you (ucxcomm would use {value})")
        else:
            out.config[key] = value
            out.reasons.append(f"{var}={value}: {reason}")

    cuda = ",cuda" if det.cuda_device and "uct_cuda" in det.modules else ""
    if policy.transport == "tcp":
        put("TLS", "tcp,sm,self" + cuda, "transport='tcp' (shared memory between ranks "
            "on one host, TCP between hosts, no RDMA)")
    elif policy.transport == "rdma":
        dc = ",dc" if any(p.driver == "mlx5" and p.link_layer == "InfiniBand"
                          for p in active) else ""
        put("TLS", "rc,ud" + dc + ",sm,self" + cuda,
            "transport='rdma' (" + ", ".join(f"{p.name} {p.kind}" for p in active) + ")")
    elif out.rdma:
        out.reasons.append("transport='auto': RDMA available (" + ", ".join(
            f"{p.name} {p.kind}" for p in active) + "); UCX picks RDMA, shared memory "
            "and TCP per peer")
    else:
        out.reasons.append("transport='auto': TCP and shared memory (" +
                           "; ".join(why_no_rdma) + ")")
    if policy.devices:
        put("NET_DEVICES", ",".join(policy.devices), "devices=...")
    # UCX's default resolves an endpoint's remote id lazily, at the first message that
    # needs it (a rendezvous): the peer then writes a reply into this process's
    # shared-memory FIFO, and a peer killed in that write leaves the FIFO stuck for good
    # (UCX's mm transport cannot skip a slot its writer claimed but never finished):
    # nothing more reaches this process over shared memory. Resolved when the endpoint
    # is made (at init), no such write comes later (tests/test_elastic.py).
    put("RESOLVE_REMOTE_EP_ID", "y", "endpoints finish their handshake when made, so "
        "no peer writes a late handshake reply (a peer killed mid-write wedges a "
        "shared-memory FIFO)")

    # Hardware tag matching.
    capable = [(p, *tag_matching(p)) for p in active] if out.rdma else []
    good = [p for p, ok, _ in capable if ok]
    if policy.tag_offload is False:
        out.reasons.append("tag offload off: tag_offload=False")
    elif policy.transport == "tcp":
        out.reasons.append("tag offload off: transport='tcp'")
    elif not good:
        why = ("; ".join(r for _, _, r in capable) if capable
               else "needs RDMA (" + "; ".join(why_no_rdma) + ")")
        if policy.tag_offload is True:
            raise UnsupportedError(f"tag_offload=True but no device can do it: {why}")
        out.reasons.append(f"tag offload off: {why}")
    else:
        out.tag_offload = True
        reason = "; ".join(r for p, ok, r in capable if ok)
        ib = any(p.link_layer == "InfiniBand" for p in good)  # DC needs InfiniBand
        for var, value in (("UCX_RC_MLX5_TM_ENABLE", "y"),
                           ("UCX_DC_MLX5_TM_ENABLE", "y" if ib else None),
                           ("UCX_TM_THRESH", policy.tm_thresh),
                           ("UCX_TM_MAX_BB_SIZE", policy.tm_max_bb_size)):
            if value is None:
                continue
            if var in env:
                out.reasons.append(f"{var}={env[var]} set by you")
                if var == "UCX_RC_MLX5_TM_ENABLE" and env[var].lower() in ("n", "no", "0"):
                    out.tag_offload = False
            else:
                out.env[var] = str(value)
        out.reasons.append(f"tag offload {'on' if out.tag_offload else 'off'}: {reason}")
    return out


def lane_kind(transport: str) -> str:
    """``rdma``, ``shm``, ``gpu``, ``tcp`` or ``other`` for a UCX transport name."""
    if transport in RDMA_TLS:
        return "rdma"
    if transport in SHM_TLS:
        return "shm"
    if transport in GPU_TLS:
        return "gpu"
    return "tcp" if transport == "tcp" else "other"


def check_lanes(plan: Plan, peer: Any, lanes: list[tuple[str, str]]) -> None:
    """Enforce ``plan`` on the lanes UCX chose for a new endpoint to ``peer``: with
    ``transport="rdma"`` a peer reachable only without RDMA (e.g. over TCP) is a
    :class:`~ucxcomm.PeerFailure`; with ``"auto"`` and RDMA present it is logged. Peers
    on this host (shared memory, GPU copies) and RDMA lanes are always fine.
    """
    kinds = {lane_kind(tl) for tl, _ in lanes}
    if "rdma" in kinds or not kinds or kinds <= {"shm", "gpu"}:
        return
    text = ", ".join(f"{tl}/{dev}" for tl, dev in lanes)
    if plan.policy.transport == "rdma":
        raise PeerFailure(f"peer {peer} is not reachable over RDMA (UCX chose {text}) and "
                          "transport='rdma' forbids a fallback", peer=peer)
    if plan.rdma:
        log.warning("peer %s is reached without RDMA (%s): TCP fallback", peer, text)


def prepare(policy: Policy) -> Plan:
    """Detect, plan and export the plan's ``UCX_*`` variables (those the user has not
    set) for the UCX context about to be created. Loads UCX (to know which one).

    Raises
    ------
    UnsupportedError
        See :func:`plan`.
    """
    from . import _ucx

    det = detect(_ucx.libucp_path())
    out = plan(policy, det)
    for var, value in out.env.items():
        os.environ.setdefault(var, value)
    for reason in out.reasons:
        log.info("transport: %s", reason)
    return out
