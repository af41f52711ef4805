"""TCP helpers shared by the bootstrap store and rank-less connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from . import settings

__all__ = ["watch_liveness"]


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
