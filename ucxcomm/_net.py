"""TCP helpers shared by the bootstrap store and rank-less connections."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket

from . import settings

__all__ = ["host_identity", "is_loopback", "watch_liveness"]


def watch_liveness(writer: asyncio.StreamWriter) -> None:
    """Make the connection drop within ``UCXCOMM_LIVENESS_S`` when the other end stops
    answering. A killed process's kernel resets its connections at once, but a host cut
    off the network sends nothing: TCP alone noticed only at its retransmission timeout
    (minutes; ci/cluster-netns.sh cuts a host's link). Keepalive probes cover an idle
    connection, ``TCP_USER_TIMEOUT`` unacknowledged data."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    limit = settings.get("UCXCOMM_LIVENESS_S")
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", limit / 2), ("TCP_KEEPINTVL", limit / 6),
                        ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", limit * 1000)):
        if hasattr(socket, name):  # (Linux; elsewhere the system's keepalive defaults)
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), max(1, int(value))))
    for level, opt, value in opts:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, opt, value)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_identity() -> bytes:
    """What two processes share when they can reach each other's shared memory: the
    kernel's boot id and the network and IPC namespaces (empty when unknown: never
    treated as the same host), then ``UCXCOMM_HOST_LABEL`` if set (ranks whose labels
    differ count as different hosts; a label never makes two hosts one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        net, ipc = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("net", "ipc"))
    except OSError:
        return b""
    label = settings.get("UCXCOMM_HOST_LABEL")
    return boot + f":{net}:{ipc}".encode() + (b":" + os.fsencode(label) if label else b"")
