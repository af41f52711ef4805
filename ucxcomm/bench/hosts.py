"""``ucxcomm bench collectives --hosts N [--ranks-per-host K] [--link RATE]``: the
collectives suite across N hosts of a network-namespace cluster (:mod:`ucxcomm.bench.netns`)
whose links are shaped to RATE in both directions, so that the algorithms, not this
machine's cores, set the figures.

The driver builds one :class:`~ucxcomm.bench.netns.Cluster` for the whole run (torn down
after it, on an error or Ctrl-C too) and starts every job's ranks inside it, K per host,
rank *r* on host ``r // K``; each implementation as its users start it across hosts:

* ucxcomm: one process per rank under ``ip netns exec <host>`` with ``UCXCOMM_RANK``,
  ``UCXCOMM_SIZE`` and ``UCXCOMM_STORE``: a rendezvous store on the bridge's namespace
  (the head), as ``tools/elastic_fuzz.py --netns`` starts its arbiter;
* gloo (torch.distributed): torchrun's variables, ``MASTER_ADDR`` host 0, the store there;
* mpi4py + MPICH: ``mpiexec`` runs on the head; its ``ssh`` launcher is pointed
  (``-launcher-exec``) at a small script that starts each host's ``hydra_pmi_proxy`` in
  that host's namespace (``ip netns exec``) instead of over ssh, and ``-localhost`` gives
  the proxies the head's address to call back. Each proxy is a node of its own to MPICH.

Every library talks TCP, between hosts and within one (UCX ``UCX_TLS=tcp,self``, MPICH
with ``MPIR_CVAR_NOLOCAL=1``, gloo always): the hosts are namespaces of one machine, so
shared memory would reach across them and skip the shaped links. Ranks of one host reach
each other through that host's own stack, unshaped.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import launchers as _launch
from .netns import HEAD, QUEUE_MS, Cluster, format_rate, start_store, tbf_burst

__all__ = ["IMPLS", "Layout", "Terminated", "annotate", "cluster", "env", "settings"]

#: The host-side interface of every namespace host (netns.py).
IFACE = "eth0"


@dataclass(frozen=True)
class Layout:
    """``hosts`` hosts of ``per_host`` ranks each; links of ``rate`` bits/s (None:
    unshaped)."""

    hosts: int
    per_host: int = 1
    rate: int | None = None

    @property
    def nranks(self) -> int:
        return self.hosts * self.per_host

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    @property
    def link(self) -> str:
        return format_rate(self.rate) if self.rate else "unshaped"


class Terminated(KeyboardInterrupt):
    """SIGTERM during a --hosts run (raised like Ctrl-C's KeyboardInterrupt, so that the
    cluster is torn down on the way out)."""

    signum = signal.SIGTERM


@contextmanager
def cluster(layout: Layout) -> Iterator[Cluster]:
    """The run's cluster; SIGTERM (like Ctrl-C) tears it down before the driver exits."""
    def on_term(sig: int, frame: Any) -> None:
        raise Terminated(f"signal {sig}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with Cluster(layout.hosts, rate=layout.rate) as c:
            yield c
    finally:
        signal.signal(signal.SIGTERM, old)


def env(base: dict[str, str]) -> dict[str, str]:
    """Every job's environment in the cluster: TCP only, on the hosts' interface."""
    out = {k: v for k, v in base.items() if not k.startswith(("UCX_TLS", "UCX_NET_DEVICES"))}
    out.update(UCX_TLS="tcp,self", UCX_NET_DEVICES=IFACE, UCXCOMM_TRANSPORT="auto",
               MPIR_CVAR_NOLOCAL="1", GLOO_SOCKET_IFNAME=IFACE)
    return out


def settings(layout: Layout, bind: bool) -> dict[str, str]:
    """The settings a reader needs to trust a --hosts comparison (also in every record)."""
    shaped = (f"each host's link shaped to {layout.link} in both directions (tc tbf on the "
              f"host's {IFACE} and on the bridge's port; bucket {tbf_burst(layout.rate)} B, "
              f"queue {QUEUE_MS} ms)" if layout.rate else "links unshaped")
    cores = len(os.sched_getaffinity(0))
    bound = _launch.bound_cores(layout.nranks, bind) is not None
    return {
        "transport": "tcp between network-namespace hosts",
        "cluster": f"{layout.hosts} hosts x {layout.per_host} rank(s), network namespaces "
                   f"on one bridge; {shaped}; ranks of one host talk TCP through its own "
                   "stack (unshaped); every host shares this machine's "
                   f"{cores} core(s)",
        "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFACE,
        "ucxcomm": "one process per rank (ip netns exec), rendezvous store on the bridge's "
                   f"namespace; UCXCOMM_LOCAL_SIZE={layout.nranks} (the ranks share this "
                   "machine's cores)",
        "mpich": "mpiexec on the bridge's namespace, one hydra proxy per host started in its "
                 "namespace (-launcher ssh -launcher-exec: ip netns exec); "
                 "MPIR_CVAR_NOLOCAL=1 (no shared memory, within a host too); its UCX over "
                 f"tcp on {IFACE}",
        "gloo": f"torchrun-style variables, store on host 0; TCP on {IFACE} "
                "(GLOO_SOCKET_IFNAME)",
        "binding": ("one core per rank for every peer (MPICH: each host's proxy bound to "
                    "its ranks' cores)" if bound else
                    f"none ({layout.nranks} ranks on {cores} core(s))" if bind
                    else "none (--no-bind)"),
    }


# --------------------------------------------------------------------------- processes
def _cores(layout: Layout, bind: bool) -> list[int] | None:
    return _launch.bound_cores(layout.nranks, bind)


def _gather(procs: Sequence[subprocess.Popen], timeout: float) -> tuple[list[tuple[str, str]],
                                                                        bool]:
    """Every process's ``(stdout, stderr)``, all within ``timeout`` seconds; those still
    running then are killed. ``(outputs, timed out)``. Whatever happens (Ctrl-C
    included), no process is left running."""
    deadline = time.monotonic() + timeout
    outs: list[tuple[str, str]] = []
    late = False
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                late = True
                p.kill()
                outs.append(p.communicate())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs, late


def _popen(argv: list[str], env: dict[str, str], cores: list[int] | None = None,
           rank: int = 0) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_launch.pin(cores, rank))


def _finish(procs: list[subprocess.Popen], outs: list[tuple[str, str]], late: bool,
            timeout: float, note: Callable[[str], None]) -> list[dict]:
    if late:
        note(f"timed out after {timeout:.0f} s")
        return []
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if bad:
        r, code = bad[0]
        tail = " | ".join(outs[r][1].strip().splitlines()[-3:])
        note(f"rank {r} exit {code}: {tail[-400:]}")
    for line in outs[0][1].splitlines():
        if "unsupported" in line:
            note(line.strip())
    return _launch.parse_records(outs[0][0])


def _job_argv(module: str, suite: str, ops: list[str], size: int, quick: bool) -> list[str]:
    return [sys.executable, "-m", f"ucxcomm.bench.{module}", suite, "--ops", ",".join(ops),
            "--size", str(size), *(["--quick"] if quick else [])]


# --------------------------------------------------------------------------- the peers
def start_ucxcomm(c: Cluster, layout: Layout, suite: str, ops: list[str], size: int,
                  n: int, opts: Any, env: dict[str, str], note: Callable[[str], None]
                  ) -> list[dict]:
    token = secrets.token_hex(16)
    cores = _cores(layout, opts.bind)
    store, port = start_store(c, token, env)
    try:
        base = dict(env, UCXCOMM_STORE=f"{HEAD}:{port}", UCXCOMM_SIZE=str(n),
                    UCXCOMM_TOKEN=token, UCXCOMM_LOCAL_SIZE=str(n))
        if cores is not None:
            base["UCXCOMM_RANKS_PER_CORE"] = "1"
        argv = _job_argv("ranks_ucxcomm", suite, ops, size, opts.quick)
        procs: list[subprocess.Popen] = []
        try:
            for r in range(n):
                procs.append(_popen([*c.exec(layout.host_of(r)), *argv],
                                    dict(base, UCXCOMM_RANK=str(r),
                                         UCXCOMM_LOCAL_RANK=str(r % layout.per_host)),
                                    cores, r))
        finally:
            outs, late = _gather(procs, opts.timeout)
    finally:
        store.kill()
        store.wait()
    return _finish(procs, outs, late, opts.timeout, note)


_port = iter(range(29500, 29500 + 10000, 2))


def start_gloo(c: Cluster, layout: Layout, suite: str, ops: list[str], size: int,
               n: int, opts: Any, env: dict[str, str], note: Callable[[str], None]
               ) -> list[dict]:
    k = layout.per_host
    cores = _cores(layout, opts.bind)
    port = str(next(_port))  # (host 0 is a fresh namespace: nothing else listens there)
    argv = _job_argv("ranks_gloo", suite, ops, size, opts.quick)
    procs: list[subprocess.Popen] = []
    try:
        for r in range(n):
            renv = dict(env, MASTER_ADDR=c.addr(0), MASTER_PORT=port, RANK=str(r),
                        WORLD_SIZE=str(n), LOCAL_RANK=str(r % k), LOCAL_WORLD_SIZE=str(k))
            procs.append(_popen([*c.exec(layout.host_of(r)), *argv], renv, cores, r))
    finally:
        outs, late = _gather(procs, opts.timeout)
    return _finish(procs, outs, late, opts.timeout, note)


#: The -launcher-exec script: hydra's ssh launcher calls it as ``SCRIPT -x HOST CMD...``
#: (CMD quoted for a remote shell); it runs CMD in HOST's namespace instead.
_NSEXEC = """#!/bin/sh
# ucxcomm bench --hosts: hydra's ssh launcher calls this as "$0 -x HOST COMMAND..."; the
# command runs in HOST's network namespace (and on HOST's cores) instead of over ssh.
[ "$1" = -x ] && shift
host=$1
shift
case "$host" in
{cases}
  *) echo "nsexec: unknown host $host" >&2; exit 1;;
esac
"""


def nsexec_script(c: Cluster, layout: Layout, cores: list[int] | None) -> str:
    """The launcher script's text for cluster ``c`` (:data:`_NSEXEC`)."""
    cases = []
    for h in range(layout.hosts):
        pin = ""
        if cores is not None and shutil.which("taskset"):
            mine = cores[h * layout.per_host:(h + 1) * layout.per_host]
            pin = "taskset -c " + ",".join(map(str, mine)) + " "
        cases.append(f'  {c.addr(h)}) exec {shlex.join(c.exec(h))} {pin}sh -c "$*";;')
    return _NSEXEC.format(cases="\n".join(cases))


def start_mpi(c: Cluster, layout: Layout, suite: str, ops: list[str], size: int,
              n: int, opts: Any, env: dict[str, str], note: Callable[[str], None]
              ) -> list[dict]:
    cores = _cores(layout, opts.bind)
    with tempfile.TemporaryDirectory(prefix="ucxcomm-hosts-") as tmp:
        script = os.path.join(tmp, "nsexec")
        with open(script, "w") as f:
            f.write(nsexec_script(c, layout, cores))
        os.chmod(script, 0o700)
        hosts = ",".join(f"{c.addr(h)}:{layout.per_host}" for h in range(layout.hosts))
        cmd = [*c.exec(-1), _launch.mpiexec() or "mpiexec", "-launcher", "ssh",
               "-launcher-exec", script, "-localhost", HEAD, "-hosts", hosts,
               "-n", str(layout.nranks), *_job_argv("ranks_mpi", suite, ops, size, opts.quick)]
        proc = _popen(cmd, env)
        outs, late = _gather([proc], opts.timeout)
    return _finish([proc], outs, late, opts.timeout, note)


#: ``--compare`` name -> how its collectives job starts in the cluster.
IMPLS: dict[str, Callable[..., list[dict]]] = {
    "ucxcomm": start_ucxcomm, "mpi4py": start_mpi, "gloo": start_gloo}


# --------------------------------------------------------------------------- the report
def annotate(records: list[dict], layout: Layout) -> None:
    """Add the cluster to every record, and busbw as a share of the link rate."""
    for rec in records:
        rec.update(hosts=layout.hosts, ranks_per_host=layout.per_host, link=layout.link,
                   link_bps=layout.rate)
        if layout.rate and "busbw_GBps" in rec:
            rec["busbw_pct_link"] = 100.0 * rec["busbw_GBps"] * 8e9 / layout.rate
