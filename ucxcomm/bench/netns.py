"""A cluster of hosts on one machine: network namespaces joined by a bridge.

Each host ``i`` is a namespace with one veth (``eth0``, address ``10.213.0.<i+1>``) into
a bridge that lives in a namespace of its own (the *head*, address ``10.213.0.254``),
so nothing is created in, or addressed from, the caller's namespace. A process on a
host runs under ``ip netns exec`` (:meth:`Cluster.exec`); :meth:`Cluster.cut` takes a
host's link down at the bridge (its peers then hear nothing from it: no reset, no end
of stream, as when a cable or a switch port fails) and :meth:`Cluster.heal` brings it
back. Needs root and iproute2 (:func:`unavailable` says what is missing). Used by the
elastic fuzzer's link cuts (``tools/elastic_fuzz.py --netns``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

__all__ = ["Cluster", "unavailable"]

SUBNET = "10.213.0"
HEAD = f"{SUBNET}.254"
MAX_HOSTS = 200
_count = itertools.count()


def unavailable() -> str | None:
    """Why a cluster cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns does not work here ({exc})"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class Cluster:
    """``hosts`` namespaces and the head's bridge; a context manager (built on entry,
    every namespace deleted on exit, failures included)."""

    def __init__(self, hosts: int) -> None:
        if type(hosts) is not int or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"a cluster has 1 to {MAX_HOSTS} hosts, not {hosts!r}")
        tag = f"{os.getpid() % 0x10000:04x}{next(_count) % 0x100:02x}"
        self.head = f"ucxq{tag}br"
        self.hosts = [f"ucxq{tag}h{i}" for i in range(hosts)]
        self._made: list[str] = []

    def addr(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{SUBNET}.{i + 1}"

    def exec(self, i: int) -> list[str]:
        """The argv prefix that runs a command on host ``i`` (``-1``: the head)."""
        return ["ip", "netns", "exec", self.head if i == -1 else self.hosts[i]]

    def link_command(self, i: int, up: bool) -> list[str]:
        """The command that takes host ``i``'s link down (or up) at the bridge."""
        return ["ip", "-n", self.head, "link", "set", f"vb{i}", "up" if up else "down"]

    def cut(self, i: int) -> None:
        _ip(*self.link_command(i, False)[1:])

    def heal(self, i: int) -> None:
        _ip(*self.link_command(i, True)[1:])

    def __enter__(self) -> Cluster:
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"cannot build a network-namespace cluster: {why}")
        try:
            self._add(self.head)
            _ip("-n", self.head, "link", "set", "lo", "up")
            _ip("-n", self.head, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.head, "addr", "add", f"{HEAD}/24", "dev", "br0")
            _ip("-n", self.head, "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                self._add(h)
                _ip("-n", h, "link", "set", "lo", "up")
                _ip("-n", self.head, "link", "add", f"vb{i}", "type", "veth", "peer",
                    "name", "eth0", "netns", h)
                _ip("-n", self.head, "link", "set", f"vb{i}", "master", "br0", "up")
                _ip("-n", h, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", h, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Delete every namespace made (their veths go with them)."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()
