"""What UCX this process would use, and why: version, library, verbs support, RDMA
devices, the transport plan (tag offload included), CUDA support and an endpoint's lanes."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from . import _ucx, library
from . import config as tconfig

__all__ = ["collect", "ibverbs_path", "ucx_info_devices"]


def ibverbs_path() -> str | None:
    """Where ``libibverbs.so.1`` (rdma-core, needed by UCX's verbs modules) loads from,
    or ``None`` when it does not load."""
    import ctypes

    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return None
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if os.path.basename(path).startswith("libibverbs.so"):
                return path
    return "libibverbs.so.1"  # pragma: no cover - loaded but not mapped from a file


def ucx_info_devices(libucp: str) -> list[str] | None:
    """``transport/device (type)`` of every resource ``ucx_info -d`` lists for the UCX at
    ``libucp`` (its ``bin/ucx_info``, else the one on PATH); None when not available."""
    exe = os.path.join(os.path.dirname(os.path.dirname(libucp)), "bin", "ucx_info")
    if not os.path.exists(exe):
        exe = shutil.which("ucx_info") or ""
    wheel = library.wheel_libucp()
    if not exe and wheel:
        # UCX copies inside other packages (mpich's) ship no ucx_info: the wheel's runs
        # on theirs through LD_LIBRARY_PATH (its 1.21 binary listed 1.20.1's resources).
        exe = os.path.join(os.path.dirname(os.path.dirname(wheel)), "bin", "ucx_info")
        if not os.path.exists(exe):
            return None
    if not exe:
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(libucp))
    try:
        proc = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=30,
                              env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [f"{tl}/{dev}" + (f" ({kind})" if kind else "")
            for tl, dev, kind in tconfig.parse_ucx_info_devices(proc.stdout)]


async def collect(policy: tconfig.Policy | None = None) -> dict[str, Any]:
    """A report for ``ucxcomm info``: detection, the plan for ``policy`` (default: from
    ``UCXCOMM_*`` variables), then a worker under that plan and an endpoint to itself.

    Raises
    ------
    UnsupportedError
        The policy cannot be satisfied here (``transport="rdma"`` without RDMA...).
    """
    from .worker import Worker

    policy = policy or tconfig.policy_from()
    libucp = _ucx.libucp_path()
    det = tconfig.detect(libucp)
    plan = tconfig.prepare(policy)
    worker = Worker(plan=plan)
    try:
        ep = worker.connect(worker.address)
        lanes = [f"{tl}/{dev}" for tl, dev in ep.transports()]
        ports = [f"{p.name} {p.kind} {p.state or '?'} {p.hca_type or p.driver}"
                 for p in det.ports]
        choice = _ucx.library
        assert choice is not None  # set by loading UCX
        ibverbs = ibverbs_path()
        return {
            "ucx_version": _ucx.ucx_version(),
            "libucp": libucp,
            "ucx_source": library.source_of(choice, libucp),
            "ucx_source_why": choice.reason,
            "verbs": "yes" if det.verbs else "no: " + tconfig._NO_VERBS_HINT.format(
                libucp=libucp),
            "rdmacm": "yes" if det.rdmacm else "no",
            "libibverbs": ibverbs or "not found (Debian: apt-get install libibverbs1 "
                          "ibverbs-providers)",
            "rdma_devices": ports,
            "rdma": "yes" if plan.rdma else "no (" + "; ".join(plan.no_rdma) + ")",
            "transport": policy.transport,
            "UCX_TLS": plan.config.get("TLS") or os.environ.get(
                "UCX_TLS", "(UCX default: every available transport)"),
            "tag_offload": "on" if plan.tag_offload else "off",
            "tag_offload_why": next((r for r in plan.reasons if r.startswith("tag offload")),
                                    ""),
            "cuda_support": worker.cuda_support,
            "cuda_device": det.cuda_device,
            "ucx_resources": ucx_info_devices(libucp) or [],
            "self_endpoint_lanes": lanes,
            "reasons": plan.reasons,
        }
    finally:
        await worker.close()
