"""The transport's contract with the layers above: what a communicator may ask of it.

:mod:`ucxcomm.comm` imports these abstract classes, never the UCX-backed ones; the
concrete :class:`~ucxcomm.transport.worker.Worker`, :class:`~ucxcomm.transport.endpoint.
Endpoint`, :class:`~ucxcomm.transport.rma.MemoryRegion` and
:class:`~ucxcomm.transport.rma.RemoteMemory` implement them, and ``ucxcomm.init`` hands
a ``Worker`` to the world (dask's ``distributed/comm/core.py`` is the model).

Conventions shared by every method:

* *tags* are raw 64-bit UCX tags; the communicator owns their layout
  (:mod:`ucxcomm.tags`), the transport only matches ``(tag, mask)``;
* *peers* is the set of opaque peer labels (world ranks) an operation depends on: when
  one of them is declared dead (:meth:`Transport.fail_peer`) the operation fails with
  :class:`~ucxcomm.PeerFailure` instead of waiting forever;
* operations that may finish at once return their result (or ``None``) instead of a
  future, so the common case allocates nothing; otherwise they return an
  :class:`asyncio.Future` that the caller awaits through :meth:`Transport.complete`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

__all__ = ["FULL_MASK", "Link", "Peers", "RecvResult", "Region", "Remote", "Target",
           "Transport"]

#: A tag mask that matches every bit (a receive for exactly one tag).
FULL_MASK = (1 << 64) - 1

#: A validated buffer ready for UCX: ``(pointer, nbytes, keepalive, device)``, made by
#: :meth:`Transport.send_ptr` / :meth:`Transport.recv_ptr` (a plain tuple: it is made
#: on every message).
Target: TypeAlias = tuple[Any, int, Any, bool]
#: The peers an operation depends on (None: no peer can fail it).
Peers: TypeAlias = "frozenset[Any] | None"
#: A receive's outcome when it finished at once: ``(sender tag, nbytes, capacity or
#: buffer)`` (see :meth:`Transport.recv_into` and :meth:`Transport.recv_alloc`).
RecvResult: TypeAlias = tuple[int, int, Any]


class Link(ABC):
    """A connection to one peer worker (a UCX endpoint)."""

    __slots__ = ()

    peer: Any

    #: ``isend(buf, tag)``: post a tag send of buffer ``buf``; ``None`` when it completed
    #: at once, else a future. Raises ``TypeError``/``ValueError`` for a bad buffer
    #: before anything is sent, :class:`~ucxcomm.ClosedError`,
    #: :class:`~ucxcomm.PeerFailure`. (An attribute, not a method: an implementation
    #: may bind a compiled callable per link, as ``Endpoint`` does.)
    isend: Callable[[Any, int], asyncio.Future | None]

    #: The engine's state of this endpoint for compiled callers (``_ucp.EpSend``, declared
    #: in ``ucxcomm/transport/_ucp.pxd``: ``handle``, ``peers``, ``fast``, ``closed``;
    #: its ``send`` is :attr:`isend`), kept current by the link.
    sender: Any

    @abstractmethod
    def isend_raw(self, target: Target, tag: int) -> asyncio.Future | None:
        """Like :meth:`isend` for a target made by :meth:`Transport.send_ptr`."""

    @abstractmethod
    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes UCX chose, e.g. ``[("posix", "memory")]``."""

    @abstractmethod
    def abort(self) -> None:
        """Close at once (idempotent); pending operations on it fail."""

    @abstractmethod
    async def close(self) -> None:
        """Close (idempotent)."""


class Region(ABC):
    """Local memory registered for one-sided access by peers."""

    __slots__ = ()

    rkey: bytes  # everything a peer needs to reach it (with address and nbytes)
    address: int
    nbytes: int
    memory: Any  # the memory of an allocated region (None for a registered buffer)

    @abstractmethod
    def close(self) -> None:
        """Unregister (peers' keys to it become invalid). Idempotent."""


class Remote(ABC):
    """A peer's registered memory; offsets in bytes, checked before anything moves."""

    __slots__ = ()

    address: int
    nbytes: int

    @abstractmethod
    async def put(self, buf: Any, offset: int = 0) -> None:
        """Write ``buf`` at ``offset``; returns when ``buf`` may be reused."""

    @abstractmethod
    async def get(self, buf: Any, offset: int = 0) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``."""

    @abstractmethod
    async def flush(self) -> None:
        """Complete, at the target, every operation issued to it."""

    async def wireup(self) -> None:
        """Finish connecting to the owner (every endpoint this key may use), so that
        no connection setup is still under way later (see RemoteMemory.wireup)."""
        await self.flush()

    @abstractmethod
    async def atomic(self, op: str, value: Any, offset: int, dtype: Any,
                     fetch: bool = True, compare: Any = None) -> Any:
        """Remote atomic ``op`` (add, swap, cswap, and, or, xor) on one 32/64-bit
        integer; the previous value when ``fetch``."""

    @abstractmethod
    async def atomic_many(self, op: str, values: Iterable[Any], offset: int, dtype: Any,
                          fetch: bool = False) -> list[int] | None:
        """``op`` on consecutive integers from ``offset``, all in flight together."""

    # Conveniences over atomic() (DESIGN: ``old = await remote.fetch_add(v, offset)``).
    async def fetch_add(self, value: Any, offset: int = 0, dtype: Any = "uint64") -> Any:
        """Add ``value``; returns the previous value."""
        return await self.atomic("add", value, offset, dtype)

    async def add(self, value: Any, offset: int = 0, dtype: Any = "uint64") -> None:
        """Add ``value`` (no result)."""
        await self.atomic("add", value, offset, dtype, fetch=False)

    async def swap(self, value: Any, offset: int = 0, dtype: Any = "uint64") -> Any:
        """Store ``value``; returns the previous value."""
        return await self.atomic("swap", value, offset, dtype)

    async def compare_swap(self, compare: Any, value: Any, offset: int = 0,
                           dtype: Any = "uint64") -> Any:
        """Store ``value`` if the target holds ``compare``; returns the previous value."""
        return await self.atomic("cswap", value, offset, dtype, compare=compare)

    @abstractmethod
    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes that reach this memory."""

    @abstractmethod
    def close(self) -> None:
        """Release the key (idempotent)."""


class Transport(ABC):
    """One process's UCX worker as the communicator layer sees it."""

    __slots__ = ()

    @property
    @abstractmethod
    def address(self) -> bytes:
        """This worker's address (peers :meth:`connect` to it)."""

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def carry(self, layout: str) -> None:
        """Declare the tag layout this worker carries (``"communicator"`` or
        ``"connections"``, :mod:`ucxcomm.tags`); ``ValueError`` if it carries the other
        (UCX matches tags across a worker: the two must not share one)."""

    @property
    @abstractmethod
    def engine(self) -> Any:
        """The compiled tag engine (``_ucp.TagEngine``): the communicator's compiled
        paths (``ucxcomm/comm/_fast.pyx``) use it at C level through its declarations
        (``ucxcomm/transport/_ucp.pxd``)."""

    # ----------------------------------------------------------- endpoints
    @abstractmethod
    def connect(self, address: bytes, peer: Any = None, *, other_host: bool = False) -> Link:
        """A :class:`Link` to the worker at ``address``; ``peer`` labels it for
        :meth:`fail_peer`. Enforces the transport policy on the lanes UCX chose
        (``transport="rdma"``: a peer reachable only without RDMA raises
        :class:`~ucxcomm.PeerFailure`). ``other_host``: the peer is known to run on
        another host (no shared memory to lose by UCX peer error handling)."""

    # ------------------------------------------------------------- buffers
    @abstractmethod
    def send_ptr(self, obj: Any) -> Target:
        """Validate a send buffer (``TypeError``/``ValueError``; GPU memory without CUDA:
        :class:`~ucxcomm.UnsupportedError`)."""

    @abstractmethod
    def recv_ptr(self, obj: Any) -> Target:
        """Validate a receive buffer (also writable)."""

    @abstractmethod
    def subtarget(self, target: Target, offset: int, nbytes: int) -> Target:
        """Bytes ``[offset, offset + nbytes)`` of ``target`` (same memory)."""

    # ------------------------------------------------------------ receives
    @abstractmethod
    def recv_into(self, target: Target, tag: int, mask: int, peers: Peers,
                  finish: Callable[[RecvResult], Any] | None = None,
                  spin: bool = False, post: bool = False) -> RecvResult | asyncio.Future:
        """Receive the first message matching ``(tag, mask)`` into ``target``, in
        matching order; ``(sender_tag, nbytes, capacity)`` when done at once, else a
        future. ``nbytes > capacity``: consumed, the buffer holds its prefix (with
        ``post``, only if the message was already there).
        ``finish`` maps a *future's* result; ``spin`` waits here first while the event
        loop is idle; ``post`` lets a receive that must wait go to UCX's own matching
        (faster, see Worker.recv_into)."""

    @abstractmethod
    def irecv(self, obj: Any, tag: int, mask: int, peers: Peers,
              finish: Callable[[RecvResult], Any], spin: bool = False,
              post: bool = True) -> Any:
        """``Comm.Irecv`` and ``Recv`` in one call: :meth:`recv_ptr` then
        :meth:`recv_into` (``spin``, ``post``), mapped by ``finish`` also when done at
        once and the message fitted; ``(sender_tag, nbytes, capacity)`` when it outgrew
        ``obj``; else a future of ``finish(result)``."""

    @abstractmethod
    def recv_alloc(self, tag: int, mask: int, peers: Peers,
                   spin: bool = False) -> RecvResult | asyncio.Future:
        """Like :meth:`recv_into` into new memory of the message's size:
        ``(sender_tag, nbytes, buffer)``."""

    @abstractmethod
    def tag_recv(self, target: Target, tag: int, mask: int,
                 peers: Peers = None) -> asyncio.Future | None:
        """A posted receive (no size or sender reported); ``None`` when done at once."""

    @abstractmethod
    def probe(self, tag: int, mask: int) -> tuple[int, int] | None:
        """``(sender_tag, nbytes)`` of a matching message already here, else None."""

    @abstractmethod
    def probe_wait(self, tag: int, mask: int, peers: Peers) -> asyncio.Future:
        """Resolves to ``(sender_tag, nbytes)`` once a matching message is here."""

    # ------------------------------------------------------- waiting, peers
    @abstractmethod
    async def complete(self, fut: asyncio.Future) -> Any:
        """Await ``fut``, progressing UCX meanwhile (the fast way to wait)."""

    @abstractmethod
    def wake(self) -> None:
        """Call after posting operations that are not awaited via :meth:`complete`."""

    def set_idle_watch(self, on: bool) -> None:
        """Whether incoming traffic wakes the event loop while no operation is pending
        (the default). Off: the transport is progressed then only by the next
        operation and by a periodic wake-up (ucxcomm.torch, whose calls drive it
        from the caller's thread, wants its loop thread left asleep). Optional."""
        return None

    def spin_policy(self) -> tuple[float, bool]:
        """``(seconds, yield)``: how long a waiter that polls something other than this
        transport (``comm/shm.py``) may spin, and whether it gives its core away on
        every turn (``UCXCOMM_SPIN_US``, ``UCXCOMM_SPIN_YIELD``)."""
        return 0.0, True

    @abstractmethod
    def is_dead(self, peer: Any) -> bool:
        """Whether ``peer`` was declared gone (its operations fail with PeerFailure)."""

    @abstractmethod
    def cancel(self, fut: asyncio.Future) -> bool:
        """Withdraw the receive behind ``fut``; True when nothing was or will be
        received for it (else await :meth:`settle`). A withdrawn receive's future
        ends cancelled (at once, or once UCX confirms it)."""

    @abstractmethod
    async def settle(self, fut: asyncio.Future) -> None:
        """Return once UCX no longer touches the memory of ``fut``'s operation."""

    @abstractmethod
    def fail_peer(self, peer: Any, exc: BaseException | None = None,
                  grace: float | None = None) -> None:
        """Declare ``peer`` gone: its pending and later operations fail."""

    @abstractmethod
    def forget_peer(self, peer: Any) -> None:
        """Drop what :meth:`fail_peer` recorded about ``peer`` (a replacement now holds
        its label, or nothing will name it again)."""

    @abstractmethod
    def revoke_tags(self, value: int, mask: int, make_err: Callable[[], BaseException]
                    ) -> int:
        """Fail every pending operation whose tag holds ``value`` under ``mask`` (a
        communicator's context, :func:`ucxcomm.tags.context_of`) with a fresh
        ``make_err()`` each; returns how many."""

    # ------------------------------------------------------------ counters
    def count_senders(self, shift: int, prefixes: Iterable[int], peer: Any) -> None:
        """Count received messages whose sender tag ``>> shift`` is one of
        ``prefixes`` as from ``peer`` (:meth:`traffic`; the communicator says which
        tags are whose). Optional."""
        return None

    def traffic(self, peer: Any) -> dict[str, Any] | None:
        """Messages and bytes sent to and received from ``peer`` by this process, by
        protocol and lane (``ucxcomm.transport.counters.Counters.peer``); None when the
        transport counts nothing. Optional."""
        return None

    # ---------------------------------------------------------- one-sided
    @abstractmethod
    def register(self, buf: Any) -> Region:
        """Register ``buf`` for one-sided access by peers."""

    @abstractmethod
    def allocate(self, nbytes: int) -> Region:
        """``nbytes`` of zeroed memory for one-sided access (``region.memory``), which
        peers on this host reach directly (no help from this process)."""

    @abstractmethod
    def remote_memory(self, rkey: bytes, address: int, nbytes: int,
                      peer: Any = None) -> Remote:
        """A peer's :class:`Region` (its ``rkey``, ``address``, ``nbytes``); ``peer``
        labels the owner as in :meth:`fail_peer` (waits on its memory then fail)."""

    # -------------------------------------------------------------- close
    @abstractmethod
    async def close(self) -> None:
        """Let in-flight operations finish briefly, then release. Idempotent."""

    @abstractmethod
    def abort(self) -> None:
        """Release at once; pending operations fail with ClosedError. Idempotent."""
