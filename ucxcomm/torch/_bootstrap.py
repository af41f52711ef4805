"""Forming a ucxcomm world for a torch process group through the c10d store torch hands
the backend (no port of our own to agree on).

Every rank publishes its UCX worker address under ``ucxcomm/<gen>/addr/<rank>`` in the
group's (prefixed) store and reads the others'. Liveness, which a c10d store cannot
report, rides on ucxcomm's own store protocol (:mod:`ucxcomm.launch.store`): the group's
rank 0 serves it on an ephemeral port and publishes where, with a fresh token, through
the c10d store. When a rank dies, its connection drops and the others' pending
operations fail with ``PeerFailure`` naming it; UCX endpoints stay free of peer error
handling, so ranks on one host keep shared memory.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
from datetime import timedelta
from typing import Any

from ..comm import World
from ..launch.bootstrap import watch_peers
from ..launch.store import StoreClient, StoreServer
from ._work import LoopThread

__all__ = ["form_world"]

log = logging.getLogger(__name__)


def _tcp_store_host(store: Any) -> str | None:
    """The host of the TCPStore under ``store`` (PrefixStores unwrapped), if there is one."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def _is_loopback(host: str) -> bool:
    """A loopback literal or ``localhost`` (a host *name* that resolves to loopback, as
    Debian's own hostname does to 127.0.1.1, may still name a multi-node job's rank 0)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _route_address(dest: str) -> str | None:
    """The local address this host uses towards ``dest`` (no packet is sent)."""
    try:
        family = socket.getaddrinfo(dest, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def liveness_address(store: Any) -> tuple[str, str]:
    """``(bind, advertise)``: where rank 0 serves its liveness store and the address the
    other ranks use to reach it.

    One host (the c10d store on a loopback literal or ``localhost``, or no TCPStore and
    no ``MASTER_ADDR``): loopback. Otherwise every interface, advertised as the local
    address this host uses to reach the c10d store's host (the ranks reach that host, so
    they reach this one the same way); where that is a loopback address (``MASTER_ADDR``
    is this host's own name, mapped to 127.0.1.1), the address of the default route,
    else the host name.
    """
    master = _tcp_store_host(store) or os.environ.get("MASTER_ADDR")
    if not master or _is_loopback(master):
        return "127.0.0.1", "127.0.0.1"
    local = _route_address(master)
    if local is None or _is_loopback(local):
        local = _route_address("10.255.255.255")  # the default route's interface
        if local is None or _is_loopback(local):
            local = socket.gethostname()
    return ("::" if ":" in local else "0.0.0.0"), local


def form_world(lt: LoopThread, store: Any, rank: int, size: int, timeout: float) -> World:
    """Form the world of a process group of ``size`` ranks (blocking; torch's thread).

    Raises
    ------
    ucxcomm.BootstrapError, ucxcomm.CommTimeoutError
        The liveness store could not be served or reached.
    torch.distributed.DistStoreError
        A rank did not publish its address within ``timeout``.
    """
    from ..transport import Worker
    from ..transport.config import policy_from, prepare

    # Generation: torch may destroy a group and create one of the same name on the same
    # store; every rank adds once per creation, in step (the exchange below needs all).
    gen = (int(store.add("ucxcomm/count", 1)) - 1) // size
    prefix = f"ucxcomm/{gen}/"
    bind, advertise = liveness_address(store) if rank == 0 else ("", "")

    async def start() -> tuple[Any, StoreServer | None]:
        worker = Worker(None, plan=prepare(policy_from()))
        server = None
        if rank == 0 and size > 1:
            try:
                server = await StoreServer(token, bind, 0, fence=True).start()
            except BaseException:
                worker.abort()
                raise
        return worker, server

    token = secrets.token_hex(16)
    worker, server = lt.run(start(), timeout)
    try:
        store.set(f"{prefix}addr/{rank}", worker.address)
        if server is not None:
            store.set(f"{prefix}live", json.dumps(
                {"host": advertise, "port": server.port, "token": token,
                 "trace": secrets.token_hex(6)}))
        keys = [f"{prefix}addr/{r}" for r in range(size)]
        store.wait(keys, timedelta(seconds=timeout))
        addresses = [bytes(store.get(k)) for k in keys]
        live = json.loads(bytes(store.get(f"{prefix}live"))) if size > 1 else None
    except BaseException:
        lt.run(_abort(worker, server), 10.0)
        raise

    # The group's flight recorders: a job directory of their own (its ranks are not the
    # job's), named alike on every member.
    part = f"torch-{live['trace']}" if live is not None else f"torch-{os.getpid()}-{gen}"

    async def join() -> World:
        world = World(worker, rank, size, addresses, trace_part=part)
        if live is None:
            return world
        client = None
        try:
            client = await StoreClient.connect(live["host"], int(live["port"]),
                                               live["token"], timeout)
            await watch_peers(world, client, server, host_rank=0, timeout=timeout)
        except BaseException:
            # Nothing of the failed group stays: the liveness connection, the worker,
            # the liveness store this rank served (before, the first two leaked).
            world.closed = True  # (the connection's loss is no peer's failure now)
            if client is not None:
                await client.close()
            await _abort(worker, server)
            raise
        return world

    world = lt.run(join(), timeout + 5.0)
    log.debug("rank %d/%d: ucxcomm world formed through the c10d store", rank, size)
    return world


async def _abort(worker: Any, server: StoreServer | None) -> None:
    worker.abort()
    if server is not None:
        await server.close()
