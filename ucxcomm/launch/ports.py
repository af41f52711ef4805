"""Ports to hand to a process that binds them later (torch's store, a test's listener)."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

#: Where the kernel's range cannot be read (not Linux): Linux's default.
_DEFAULT_EPHEMERAL = (32768, 60999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(host: str, port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, port))
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1", span: int = 1, tries: int = 200) -> int:
    """A port ``P`` with ``P .. P + span - 1`` free now on ``host``, outside the kernel's
    ephemeral range.

    A port free now is only a promise until its user binds it, and a port the kernel took
    for ``bind(0)`` lies in the ephemeral range, where the kernel also picks the local
    port of every outgoing connection and of every other ``bind(0)``: on a busy machine
    one of those takes it first (CI: torch's store on rank 0 failed with EADDRINUSE on
    the launcher's MASTER_PORT). Outside that range only an explicit bind can take it.
    """
    if not 1 <= span <= 16:
        raise ValueError(f"span must be 1..16, got {span}")
    lo, hi = _ephemeral_range()
    ranges = [(a, b) for a, b in ((10000, lo - 1), (hi + 1, 65535)) if b - a >= span]
    if not ranges:  # (the whole space is ephemeral: the kernel's pick is all there is)
        ranges = [(1024, 65535)]
    rng = random.SystemRandom()
    for _ in range(tries):
        a, b = rng.choice(ranges)
        port = rng.randint(a, b - span + 1)
        if all(_bindable(host, p) for p in range(port, port + span)):
            return port
    raise OSError(f"no {span} free port(s) in a row on {host} after {tries} tries")
