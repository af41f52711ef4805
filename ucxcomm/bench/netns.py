"""A cluster of hosts on one machine: network namespaces joined by a bridge.

Each host ``i`` is a namespace with one veth (``eth0``, address ``10.213.0.<i+1>``) into
a bridge that lives in a namespace of its own (the *head*, address ``10.213.0.254``),
so nothing is created in, or addressed from, the caller's namespace. A process on a
host runs under ``ip netns exec`` (:meth:`Cluster.exec`); :meth:`Cluster.cut` takes a
host's link down at the bridge (its peers then hear nothing from it: no reset, no end
of stream, as when a cable or a switch port fails) and :meth:`Cluster.heal` brings it
back. Needs root and iproute2 (:func:`unavailable` says what is missing). Used by the
elastic fuzzer's link cuts (``tools/elastic_fuzz.py --netns``) and by ``ucxcomm bench
collectives --hosts N --link RATE`` (:mod:`ucxcomm.bench.hosts`).

``Cluster(n, rate=BITS_PER_S)`` shapes every host's link to that rate in both directions
with a token bucket (``tc`` ``tbf``): on the egress of the host's ``eth0`` (what the host
sends) and on the egress of the bridge's ``vb<i>`` (what it receives), as a switch port of
that speed would. This kernel has ``tbf`` and ``htb`` but no ``netem``: rates, not delays.
The bucket holds :func:`tbf_burst` bytes (at least 128 KiB: veth hands over segmentation-
offloaded packets of up to 64 KiB, and a bucket smaller than a packet stalls the link), and
a queue of :data:`QUEUE_MS` ms at the rate before it drops.

``python -m ucxcomm.bench.netns store TOKEN ADDRESS`` serves a rendezvous store
(``ucxcomm.launch.store``) on a free port of ADDRESS and prints ``STORE-UP <port>``:
:func:`start_store` runs it on the head, where every host reaches it.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping

__all__ = ["Cluster", "format_rate", "parse_rate", "start_store", "tbf_burst", "unavailable"]

SUBNET = "10.213.0"
HEAD = f"{SUBNET}.254"
MAX_HOSTS = 200
#: How long a shaped link's queue is, in milliseconds at its rate (``tbf latency``).
QUEUE_MS = 50
_count = itertools.count()

#: tc's bit-rate units (decimal, as tc reads them): ``200mbit`` is 200e6 bits/s.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """``"200mbit"`` -> 200_000_000 bits/s. Units as tc's: bit, kbit, mbit, gbit, tbit
    (powers of 1000); a fraction is fine (``2.5gbit``). Between 1 kbit/s and 100 gbit/s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if m is None or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"bad rate {text!r}: a number and one of "
                         f"{', '.join(_RATE_UNITS)}, e.g. 200mbit or 1gbit")
    bps = round(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if not 1000 <= bps <= 100 * 10**9:
        raise ValueError(f"rate {text!r} out of range (1kbit to 100gbit)")
    return bps


def format_rate(bps: int) -> str:
    """200_000_000 -> ``"200mbit"`` (the largest unit that divides it, else bits)."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps % _RATE_UNITS[unit] == 0:
            return f"{bps // _RATE_UNITS[unit]}{unit}"
    return f"{bps}bit"


def tbf_burst(bps: int) -> int:
    """The token bucket's size in bytes for a link of ``bps`` bits/s: 2 ms at the rate,
    at least 128 KiB (two segmentation-offloaded veth packets)."""
    return max(128 << 10, bps // 8 // 500)


def unavailable(shaped: bool = False) -> str | None:
    """Why a cluster (``shaped``: with rate-limited links) cannot be built here (None:
    it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    if shaped and shutil.which("tc") is None:
        return "iproute2's tc is not installed (rate-limited links need it)"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns does not work here ({exc})"
    return None


def _ip(*args: str, tool: str = "ip") -> None:
    proc = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)}: {proc.stderr.strip()}")


class Cluster:
    """``hosts`` namespaces and the head's bridge; a context manager (built on entry,
    every namespace deleted on exit, failures included). ``rate``: every host's link
    shaped to that many bits/s each way (module doc); None: unshaped."""

    def __init__(self, hosts: int, rate: int | None = None) -> None:
        if type(hosts) is not int or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"a cluster has 1 to {MAX_HOSTS} hosts, not {hosts!r}")
        if rate is not None and (type(rate) is not int or rate < 1000):
            raise ValueError(f"a link rate is an int >= 1000 bits/s, not {rate!r}")
        self.rate = rate
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

    def shaping(self, i: int) -> list[list[str]]:
        """The ``tc`` commands that shape host ``i``'s link both ways (none unshaped)."""
        if self.rate is None:
            return []
        tbf = ["root", "tbf", "rate", f"{self.rate}bit", "burst", str(tbf_burst(self.rate)),
               "latency", f"{QUEUE_MS}ms"]
        return [["tc", "-n", self.hosts[i], "qdisc", "add", "dev", "eth0", *tbf],
                ["tc", "-n", self.head, "qdisc", "add", "dev", f"vb{i}", *tbf]]

    def cut(self, i: int) -> None:
        _ip(*self.link_command(i, False)[1:])

    def heal(self, i: int) -> None:
        _ip(*self.link_command(i, True)[1:])

    def __enter__(self) -> Cluster:
        why = unavailable(shaped=self.rate is not None)
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
                for cmd in self.shaping(i):
                    _ip(*cmd[1:], tool=cmd[0])
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Delete every namespace made (their veths go with them), after killing any
        process still running in one (a namespace outlives its name while a process
        holds it)."""
        for name in reversed(self._made):
            self._kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()

    @staticmethod
    def _kill_inside(name: str) -> None:
        proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                              timeout=30)
        for pid in proc.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ValueError, ProcessLookupError, PermissionError):
                pass

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_store(cluster: Cluster, token: str, env: Mapping[str, str],
                timeout: float = 60.0) -> tuple[subprocess.Popen, int]:
    """A rendezvous store on the head (``HEAD``, a free port), for ranks started with
    ``UCXCOMM_STORE=HEAD:port``: ``(its process, the port)``. The caller kills it."""
    proc = subprocess.Popen(
        [*cluster.exec(-1), sys.executable, "-m", "ucxcomm.bench.netns", "store", token, HEAD],
        env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        # (readline returns at the line or at end of file: a store that died says why)
        line = _readline(proc, timeout)
        if not line.startswith("STORE-UP "):
            raise RuntimeError(f"the store did not start: {line}{proc.stdout.read()[-2000:]}")
        return proc, int(line.split()[1])
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of ``proc``'s output, or raise after ``timeout`` seconds."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no line from the store in {timeout:.0f} s")
    return proc.stdout.readline()


async def _serve_store(token: str, host: str) -> None:
    import asyncio

    from ..launch.store import StoreServer

    server = StoreServer(token, host, 0)
    await server.start()
    print(f"STORE-UP {server.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "store":
        raise SystemExit("usage: python -m ucxcomm.bench.netns store TOKEN ADDRESS")
    import asyncio

    asyncio.run(_serve_store(sys.argv[2], sys.argv[3]))
