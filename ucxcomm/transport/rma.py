"""One-sided communication: the RMA engines, registered memory and remote memory.

RMA runs on UCX contexts of its own (*RMA engines*, csrc/rma.c), each with a
thread-safe worker progressed by a background thread, owned by a
:class:`~ucxcomm.transport.worker.Worker` (:class:`RmaEngines`) and configured exactly
like the worker's main context: the transport plan's options plus the user's
``ucx_config`` (and ``UCX_*`` variables). Why separate contexts:

* Over TCP and shared memory UCX emulates RMA and atomics with active messages that the
  **target** must process; the thread serves them while the target's Python code is busy
  computing (it sleeps on the worker's event descriptor when there is nothing to do).
* Without RDMA, UCX's protocols force a choice (UCX 1.21, measured here): with the
  default v2 protocols 64 MiB puts run at 3.4-4.7 GB/s but an 8 B fetch-add takes
  100-300 us; with ``UCX_PROTO_ENABLE=n`` (v1) atomics take ~10 us (shared-memory
  atomics) but puts drop to 1.5 GB/s. So without RDMA there are two engines: bulk
  put/get on a v2 context, atomics on a v1 one, both mapping the same memory; with RDMA
  (hardware atomics, ``plan.rdma``) or a ``PROTO_ENABLE`` chosen by the user, one engine
  does all. The tag traffic on the main context keeps UCX's defaults either way.

Each engine is a progress source (:mod:`ucxcomm.transport.progress`): its requests are
awaited like tag operations, and a sleeping waiter is woken by the completion callback
of csrc/rma.c. A :class:`MemoryRegion`'s ``rkey`` is self-describing (per engine: the
owner's engine address plus UCX's packed key), so ``RemoteMemory(rkey, address,
nbytes)`` needs nothing else.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import logging
import os
import struct
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy import ndarray as _ndarray

from .. import settings
from ..errors import ClosedError, UnsupportedError, WindowError
from . import _ucx
from .base import Region, Remote
from .progress import Progress
from .wire import check_address, check_rkey_layout

__all__ = ["MemoryRegion", "RemoteMemory", "RmaEngine", "RmaEngines"]

log = logging.getLogger(__name__)

_BLOB = struct.Struct("<4sB")  # magic, number of sections
_SECTION = struct.Struct("<BII")  # flags, address length, packed rkey length
_MAGIC = b"UCR3"
_V1 = 1  # section flag: the engine runs UCX's v1 protocols
_ALLOCATED = 2  # section flag: UCX allocated the memory (shared-memory capable)
#: Transports on which an engine reaches UCX-allocated memory directly (copies and CPU
#: atomics, no help from the target): one-sided operations need no target thread.
_DIRECT_TLS = frozenset({"self", "sysv", "posix", "xpmem", "knem", "cma"})
_ATOMIC_TLS = frozenset({"self", "sysv", "posix", "xpmem"})  # (CPU atomics on the memory)
_AMO_TYPES = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64),
              np.dtype(np.uint64)}
# dtype -> (size, signed); also keyed by the dtype-like objects callers pass
_CTYPES: dict[Any, tuple[int, bool]] = {}
for _t in (np.int32, np.uint32, np.int64, np.uint64):
    _CTYPES[_t] = _CTYPES[np.dtype(_t)] = (np.dtype(_t).itemsize, np.dtype(_t).kind == "i")
_OPS = {"add": "UCP_ATOMIC_OP_ADD", "swap": "UCP_ATOMIC_OP_SWAP",
        "cswap": "UCP_ATOMIC_OP_CSWAP", "and": "UCP_ATOMIC_OP_AND",
        "or": "UCP_ATOMIC_OP_OR", "xor": "UCP_ATOMIC_OP_XOR"}
# Engines whose threads must stop before interpreter (and UCX library) teardown, even
# when their worker was never closed.
_live: weakref.WeakSet[RmaEngine] = weakref.WeakSet()


@atexit.register
def _stop_threads() -> None:
    for eng in list(_live):
        eng.close()


class _RmaOp:
    __slots__ = ("future", "peer", "request")

    def __init__(self, request: Any, future: asyncio.Future, peer: Any) -> None:
        self.request, self.future = request, future  # (the request keeps the memory)
        self.peer = peer  # the target's owner (a label, as in Worker.fail_peer), or None


class RmaEngine:
    """A UCX context + thread-safe worker for RMA, progressed by a background thread;
    a progress source for the Python side's waits.

    Parameters
    ----------
    options : dict
        UCX context options (keys without ``UCX_``), like the main context's.
    progress : Progress
        The owning worker's progress engine.
    dead : dict, optional
        The owning worker's dead peers (``peer -> (deadline, exception)``, written by
        ``Worker.fail_peer``): an operation on a dead peer's memory fails with that
        exception once the deadline passed, instead of waiting for UCX (which, without
        error handling, may never finish it: a Lock on a killed rank waited forever).

    Raises
    ------
    UcxCommError
        UCX could not create the context, worker or thread.
    """

    watch_idle = False  # its own thread serves peers; we only poll our requests

    def __init__(self, options: dict[str, str], progress: Progress,
                 loop: asyncio.AbstractEventLoop, dead: dict[Any, Any] | None = None) -> None:
        _ucx.load()
        ucp = self._ucp = _ucx.ucp
        self.options = dict(options)
        self.proto_v1 = self.options.get("PROTO_ENABLE", "").lower() in ("n", "no", "0")
        spin_s = settings.get("UCXCOMM_RMA_SPIN_US") * 1e-6
        with _ucx.creating_context("creating the RMA engine"):
            st, handle, err = ucp.rma_create(self.options, spin_s)
        if st != 0:
            raise _ucx.status_error(st, what=f"creating the RMA engine ({err})")
        self.handle: int = handle
        self.closed = False
        _live.add(self)
        st, address = ucp.rma_address(handle)
        if st != 0:
            self.close()
            raise _ucx.status_error(st, what="RMA worker address")
        self.address: bytes = address
        self._fd = ucp.rma_notify_fd(handle)
        self._template: bytes | None = None
        self._eps: dict[bytes, int] = {}
        self._regions: list[MemoryRegion] = []
        self._rkeys: set[int] = set()  # unpacked remote keys not yet destroyed
        self.amo = {op: _ucx.const[name] for op, name in _OPS.items()}
        self._request_type = ucp.RmaRequest
        self._ops: list[_RmaOp] = []
        self._dead: dict[Any, Any] = {} if dead is None else dead
        self._graveyard: list[Any] = []  # requests given up on (their memory stays)
        self._progress = progress
        #: How long an operation waits in place before it becomes a future (the
        #: progress policy's spin time).
        self.spin_s = progress.spin_s
        self._loop = loop
        progress.add(self)

    def endpoint(self, address: bytes) -> int:
        """The (cached) endpoint handle to the engine at ``address``."""
        self.check()
        ep = self._eps.get(address)
        if ep is None:
            st, ep = self._ucp.rma_connect(self.handle, address)
            if st != 0:
                raise _ucx.status_error(st, what="RMA connect")
            self._eps[address] = ep
        return ep

    def check(self) -> None:
        if self.closed:
            raise ClosedError("the RMA engine is closed")

    def template_key(self) -> bytes:
        """A UCX key this engine packs for registered host memory (cached): the layout
        a peer's key for registered memory must have (``wire.check_rkey_layout``)."""
        self.check()
        if self._template is None:
            ucp = self._ucp
            buf = np.zeros(64, np.uint8)
            st, memh = ucp.rma_mem_map(self.handle, buf.ctypes.data, buf.nbytes)
            if st != 0:
                raise _ucx.status_error(st, what="memory registration")
            try:
                st, packed = ucp.rma_rkey_pack(self.handle, memh)
                if st != 0:
                    raise _ucx.status_error(st, what="rkey pack")
            finally:
                ucp.rma_mem_unmap(self.handle, memh)
            self._template = bytes(packed)
        return self._template

    # ------------------------------------------------------------ requests
    async def finish(self, outcome: Any, peer: Any = None) -> Any:
        """The result of a compiled ``rma_*`` call: None or a value when it completed in
        place (returned as is), else its request (awaited through the progress engine;
        the fetched value, if any, returned). ``peer``: the owner of the target memory;
        if it is declared dead the wait ends with its exception (``PeerFailure``)."""
        if type(outcome) is not self._request_type:
            return outcome
        fut = self._loop.create_future()
        self._ops.append(_RmaOp(outcome, fut, peer))
        await self._progress.wait(fut, self.poll)
        return outcome.value()

    # ------------------------------------------------------ progress source
    def pending(self) -> bool:
        return bool(self._ops)

    def poll(self) -> int:
        self._ucp.rma_progress(self.handle)
        return self._test()

    def _test(self) -> int:
        keep, done, dead = [], 0, self._dead
        for op in self._ops:
            st = op.request.test()
            if st == 1:  # UCXCOMM_INPROGRESS
                if dead and op.peer in dead and time.monotonic() >= dead[op.peer][0]:
                    self._graveyard.append(op.request)  # UCX may still write its memory
                    if not op.future.done():
                        op.future.set_exception(dead[op.peer][1])
                    done += 1
                    continue
                keep.append(op)
                continue
            done += 1
            if not op.future.done():
                if st < 0:
                    op.future.set_exception(_ucx.status_error(st, op.peer, what="RMA"))
                else:
                    op.future.set_result(None)
        self._ops = keep
        return done

    def arm(self) -> bool:
        self._ucp.rma_arm(self.handle)
        return not self._test()

    def disarm(self) -> None:
        self._ucp.rma_disarm(self.handle)

    def fileno(self) -> int:
        return int(self._fd)

    # ------------------------------------------------------------ close
    def close(self) -> None:
        """Release every region, endpoint and the engine (stops its thread). Pending
        operations fail with :class:`~ucxcomm.ClosedError`."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        self._progress.remove(self)
        for op in self._ops:
            self._graveyard.append(op.request)  # (released once the engine is gone)
            if not op.future.done():
                op.future.set_exception(ClosedError("the RMA engine was closed"))
                op.future.exception()  # nobody may await it any more
        self._ops = []
        for region in list(self._regions):
            region.close()
        for rkey in self._rkeys:  # keys of remote memory nobody closed
            self._ucp.rma_rkey_destroy(rkey)
        self._rkeys.clear()
        for ep in self._eps.values():
            self._ucp.rma_ep_close(self.handle, ep)
        self._eps.clear()
        self._ucp.rma_destroy(self.handle)
        self._graveyard.clear()


class RmaEngines:
    """A worker's RMA engines (created on first use), keyed by "uses UCX's v1
    protocols" (see the module docstring).

    Parameters
    ----------
    options : dict
        The worker's UCX context options (plan + user config).
    rdma : bool
        The plan found RDMA (hardware atomics): one engine does everything.
    """

    def __init__(self, options: dict[str, str], rdma: bool, progress: Progress,
                 loop: asyncio.AbstractEventLoop, dead: dict[Any, Any] | None = None
                 ) -> None:
        self._options = dict(options)
        self._dead = dead
        self._progress = progress
        self._loop = loop
        self._engines: dict[bool, RmaEngine] = {}
        if "PROTO_ENABLE" in self._options:
            log.info("RMA: UCX_PROTO_ENABLE=%s chosen by you: one engine",
                     self._options["PROTO_ENABLE"])
            self.split = False
        elif rdma:
            self.split = False
        else:
            log.info("RMA: no RDMA device: put/get on UCX's default protocols, atomics on "
                     "a second context with UCX_PROTO_ENABLE=n (fast shared-memory/TCP "
                     "atomics)")
            self.split = True
        self.closed = False

    def engine(self, v1: bool) -> RmaEngine:
        """The engine on UCX's v1 (``v1``) or default protocols, created on first use."""
        if self.closed:
            raise ClosedError("the worker is closed")
        eng = self._engines.get(v1)
        if eng is None:
            opts = dict(self._options)
            if v1 and self.split:
                opts["PROTO_ENABLE"] = "n"
            eng = self._engines[v1] = RmaEngine(opts, self._progress, self._loop,
                                                self._dead)
        return eng

    def local(self) -> list[RmaEngine]:
        """Every engine a registration maps memory into."""
        if self.split:
            return [self.engine(False), self.engine(True)]
        return [self.engine(self._options.get("PROTO_ENABLE", "").lower()
                            in ("n", "no", "0"))]

    def register(self, buf: Any) -> MemoryRegion:
        return MemoryRegion(self, buf)

    def allocate(self, nbytes: int) -> MemoryRegion:
        return MemoryRegion(self, None, nbytes)

    def remote(self, rkey: bytes, address: int, nbytes: int, peer: Any = None,
               strict: bool = False, ours: tuple[bytes, ...] = ()) -> RemoteMemory:
        return RemoteMemory(self, rkey, address, nbytes, peer, strict, ours)

    @staticmethod
    def process_addresses() -> list[bytes]:
        """The addresses of every RMA engine of this process (all workers)."""
        return [eng.address for eng in list(_live) if not eng.closed]

    @staticmethod
    def process_regions() -> list[MemoryRegion]:
        """Every open region of this process (all workers; each engine maps each)."""
        found: dict[int, MemoryRegion] = {}
        for eng in list(_live):
            for region in eng._regions:
                found[id(region)] = region
        return list(found.values())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


class MemoryRegion(Region):
    """Memory registered for remote access (``worker.register(buf)``), or allocated by
    UCX for it (``worker.allocate(nbytes)``: shared-memory capable, so peers on this host
    copy into it and do atomics on it directly, without this process's help; its
    ``memory`` is a numpy ``uint8`` array valid until :meth:`close`).

    Attributes
    ----------
    address : int
        Its address (what peers pass as ``address`` with the ``rkey``).
    nbytes : int
    rkey : bytes
        Everything a peer needs to reach it: the owner's RMA address and UCX's key, per
        engine.
    memory : numpy.ndarray or None
        The allocated memory (None for a registered buffer).
    """

    def __init__(self, engines: RmaEngines, buf: Any, nbytes: int = 0) -> None:
        engs = engines.local()
        ucp = _ucx.ucp
        self._maps: list[tuple[RmaEngine, int]] = []
        self.closed = False
        self.memory: Any = None
        sections = []
        try:
            if buf is None:  # allocated by the first (bulk) engine, mapped by the others
                st, memh, addr = ucp.rma_mem_alloc(engs[0].handle, max(nbytes, 1))
                if st != 0:
                    raise _ucx.status_error(st, what="memory allocation")
                self._maps.append((engs[0], memh))
                self.memory = np.ctypeslib.as_array(
                    (ctypes.c_uint8 * max(nbytes, 1)).from_address(addr))[:nbytes]
                self.memory[...] = 0
                self._keep: Any = None
            else:
                addr, nbytes, self._keep, _ = ucp.target(buf, True, True)
            self.nbytes: int = nbytes
            self.address: int = addr
            # Every engine registers the memory (allocated memory once more: shared-memory
            # copies through an allocated key are fast for small puts, slow for large
            # transfers, where the registered key's single-copy path wins).
            for eng in engs:
                st, memh = ucp.rma_mem_map(eng.handle, addr, max(nbytes, 1))
                if st != 0:
                    raise _ucx.status_error(st, what="memory registration")
                self._maps.append((eng, memh))
            for i, (eng, memh) in enumerate(self._maps):
                st, packed = ucp.rma_rkey_pack(eng.handle, memh)
                if st != 0:
                    raise _ucx.status_error(st, what="rkey pack")
                flags = int(eng.proto_v1) | (_ALLOCATED if buf is None and i == 0 else 0)
                sections.append(_SECTION.pack(flags, len(eng.address), len(packed))
                                + eng.address + packed)
        except BaseException:
            self.close()
            raise
        self.rkey = _BLOB.pack(_MAGIC, len(sections)) + b"".join(sections)
        for eng in engs:
            eng._regions.append(self)

    def close(self) -> None:
        """Unregister (peers' remote keys to it become invalid; allocated memory is freed:
        do not use ``memory`` afterwards). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.memory = None
        listed = set()  # engines that still list this region (even a closing one does)
        for eng, _ in self._maps:
            if self in eng._regions:
                eng._regions.remove(self)
                listed.add(eng)
        for eng, memh in reversed(self._maps):  # the allocating engine's map last
            if not eng.closed or eng in listed:  # a closing engine closes its regions first
                _ucx.ucp.rma_mem_unmap(eng.handle, memh)
        self._maps = []


def _parse_rkey(rkey: bytes) -> list[tuple[bool, bool, bytes, bytes]]:
    """The sections of a :class:`MemoryRegion` key: ``(v1, allocated, owner engine
    address, packed UCX key)`` each."""
    if len(rkey) < _BLOB.size or rkey[:4] != _MAGIC:
        raise ValueError("not a ucxcomm remote key (from MemoryRegion.rkey)")
    _, count = _BLOB.unpack_from(rkey)
    pos, found = _BLOB.size, []
    for _ in range(count):
        if pos + _SECTION.size > len(rkey):
            raise ValueError("truncated remote key")
        flags, alen, klen = _SECTION.unpack_from(rkey, pos)
        pos += _SECTION.size
        found.append((bool(flags & _V1), bool(flags & _ALLOCATED), rkey[pos:pos + alen],
                      rkey[pos + alen:pos + alen + klen]))
        pos += alen + klen
    if pos != len(rkey) or not any(not allocated for _, allocated, _, _ in found):
        raise ValueError("malformed remote key")
    return found


class RemoteMemory(Remote):
    """A peer's registered memory (``worker.remote_memory(rkey, address, nbytes)``).

    Offsets are in bytes from ``address``. Every access is checked against ``nbytes``
    before anything moves (:class:`~ucxcomm.WindowError`). ``put``/``get`` return when
    the local buffer may be reused / holds the data; ``flush`` waits until every
    operation issued to this peer is complete at the target. ``peer`` (the owner's
    label, as in ``Worker.fail_peer``): once it is declared dead, operations waiting on
    its memory raise ``PeerFailure``.

    ``strict`` (keys from a rank-less connection's peer): only the key's sections for
    registered memory are used (UCX maps memory it allocated into this process, and
    copies into that mapping at whatever address the key names: a false one wrote into
    this process's own memory), each with the layout of a key this UCX packs and an
    owner address that is well formed and not one of ``ours`` (this process's UCX
    addresses) unless the range lies inside a region of this process.
    """

    def __init__(self, engines: RmaEngines, rkey: bytes, address: int, nbytes: int,
                 peer: Any = None, strict: bool = False, ours: tuple[bytes, ...] = ()
                 ) -> None:
        self.peer = peer
        found = _parse_rkey(bytes(rkey))
        if type(address) is not int or type(nbytes) is not int or address < 0 \
                or nbytes < 0 or address + nbytes >= 1 << 64:
            raise ValueError(f"a remote region of {nbytes!r} bytes at {address!r}")
        if strict:
            found = [sect for sect in found if not sect[1]]
            self._check_strict(engines, found, address, nbytes, ours)
        self._targets: list[tuple[RmaEngine, int, int]] = []  # every unpacked key
        self.closed = False
        registered: dict[bool, tuple[RmaEngine, int, int]] = {}
        shared = None
        try:
            for v1, allocated, owner, packed in found:
                eng = engines.engine(v1)
                ep = eng.endpoint(owner)
                st, key = _ucx.ucp.rma_rkey_unpack(ep, packed)
                if st != 0:
                    raise _ucx.status_error(st, what="rkey unpack")
                self._targets.append((eng, ep, key))
                eng._rkeys.add(key)
                if not allocated:
                    registered[v1] = (eng, ep, key)
                elif not v1:
                    lanes = {tl for tl, _ in _ucx.endpoint_transports(ep)}
                    if lanes <= _DIRECT_TLS and lanes & _ATOMIC_TLS:
                        shared = (eng, ep, key)
        except BaseException:
            self.close()
            raise
        # Puts and gets on the v2 engine with the registered key (single-copy paths);
        # atomics on the v1 engine when the owner has both. Memory that UCX allocated and
        # this peer reaches over shared memory is mapped here (ucp_rkey_ptr): puts and
        # gets are copies (no UCX request; complete at once, so flush has nothing to
        # wait for) and atomics go through the allocated key, CPU atomics on the memory,
        # with no target thread (measured 0.3 us instead of 8 us for a fetch-add; 8 B Put
        # 1.2 us instead of 5; 1 MiB Get 47 us instead of 95). UCX's emulated atomics,
        # which other peers may use on the same words, are atomic operations too.
        self._eng, self._ep, self._rkey = registered.get(False) or registered[True]
        self._local = 0  # where the owner's memory is mapped here (shared memory), or 0
        if shared is not None:
            self._aeng, self._aep, self._arkey = shared
            st, ptr = _ucx.ucp.rma_rkey_ptr(shared[2], int(address))
            if st == 0:
                self._local = ptr
        else:
            self._aeng, self._aep, self._arkey = registered.get(True) or registered[False]
        # the endpoints that operations use, once each (flush)
        self._eps = [] if self._local else [(self._eng, self._ep)]
        if (self._aeng, self._aep) not in self._eps:
            self._eps.append((self._aeng, self._aep))
        #: puts, gets and atomics act on the owner's memory directly (shared memory)
        self.direct: bool = shared is not None
        self.address, self.nbytes = int(address), int(nbytes)

    @staticmethod
    def _check_strict(engines: RmaEngines, found: list[tuple[bool, bool, bytes, bytes]],
                      address: int, nbytes: int, ours: tuple[bytes, ...]) -> None:
        """See the class docstring (``strict``). Raises ValueError."""
        for v1, _, owner, packed in found:
            eng = engines.engine(v1)
            mine = (*ours, *engines.process_addresses())
            is_self = check_address(owner, eng.address, mine, os.getpid())
            check_rkey_layout(packed, eng.template_key())
            if is_self and not any(r.address <= address and address + nbytes
                                   <= r.address + r.nbytes
                                   for r in engines.process_regions()):
                raise ValueError("a key for this process's own memory outside its "
                                 "registered regions")

    def _check(self, offset: int, n: int, what: str) -> int:
        if self.closed or self._eng.closed or self._aeng.closed:
            raise ClosedError("this remote memory was closed")
        if type(offset) is not int:
            offset = int(offset)
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise WindowError(f"{what}: bytes [{offset}, {offset + n}) are outside the "
                              f"{self.nbytes}-byte remote region")
        return self.address + offset

    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) lanes of the endpoints that reach this memory (bulk
        transfers, then atomics when they use another engine)."""
        lanes: list[tuple[str, str]] = []
        for _, ep in self._eps:
            lanes.extend(lane for lane in _ucx.endpoint_transports(ep) if lane not in lanes)
        return lanes

    def _origin(self, buf: Any, writable: bool, what: str) -> Any:
        """A host buffer as a target (the slow path: F order, bytes-like objects; GPU
        memory is refused, before anything waits on its stream)."""
        gpu = getattr(buf, "__cuda_array_interface__", None) is not None
        t = None if gpu else _ucx.ucp.target(buf, writable, True)
        if t is None or t[3]:  # (t[3]: a CUDA DLPack tensor)
            raise UnsupportedError(f"{what}: GPU origin buffers are not supported for RMA "
                                   "yet; pass host memory")
        return t

    async def put(self, buf: Any, offset: int = 0) -> None:
        """Write ``buf`` at ``offset``; returns when ``buf`` may be reused."""
        eng = self._eng
        ucp = eng._ucp
        if type(buf) is _ndarray and buf.flags.c_contiguous:  # one call into UCX
            n = buf.nbytes
            raddr = self._check(offset, n, "put")
            if self._local:  # a copy into the owner's memory, mapped here
                ucp.copy_in(self._local + raddr - self.address, buf)
                return
            out = ucp.rma_put(eng.handle, self._ep, buf, raddr, self._rkey, eng.spin_s)
        else:
            t = self._origin(buf, False, "put")
            raddr = self._check(offset, t[1], "put")
            if self._local:
                ucp.copy_at(self._local + raddr - self.address, t[0], t[1])
                return
            out = ucp.rma_put_at(eng.handle, self._ep, t, raddr, self._rkey, eng.spin_s)
        if out is not None:
            await eng.finish(out, self.peer)

    async def get(self, buf: Any, offset: int = 0) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``."""
        eng = self._eng
        ucp = eng._ucp
        if type(buf) is _ndarray and buf.flags.c_contiguous and buf.flags.writeable:
            n = buf.nbytes
            raddr = self._check(offset, n, "get")
            if self._local:  # a copy from the owner's memory, mapped here
                ucp.copy_out(buf, self._local + raddr - self.address)
                return
            out = ucp.rma_get(eng.handle, self._ep, buf, raddr, self._rkey, eng.spin_s)
        else:
            t = self._origin(buf, True, "get")
            raddr = self._check(offset, t[1], "get")
            if self._local:
                ucp.copy_at(t[0], self._local + raddr - self.address, t[1])
                return
            out = ucp.rma_get_at(eng.handle, self._ep, t, raddr, self._rkey, eng.spin_s)
        if out is not None:
            await eng.finish(out, self.peer)

    async def flush(self) -> None:
        """Complete, at the target, every operation issued to this peer."""
        if self.closed:
            raise ClosedError("this remote memory was closed")
        for eng, ep in self._eps:
            out = eng._ucp.rma_flush(eng.handle, ep, eng.spin_s)
            if out is not None:
                await eng.finish(out, self.peer)

    async def wireup(self) -> None:
        """Finish connecting every endpoint this key may use (a flush on each forces
        UCX's connection setup to completion). Windows do this, then a barrier, when
        they are created: UCX aborts the process when a peer dies while an endpoint
        to it is still being set up ("endpoint reconfiguration not supported yet")."""
        if self.closed:
            raise ClosedError("this remote memory was closed")
        done = set()
        for eng, ep, _ in self._targets:
            if (eng, ep) in done or eng.closed:
                continue
            done.add((eng, ep))
            out = eng._ucp.rma_flush(eng.handle, ep, eng.spin_s)
            if out is not None:
                await eng.finish(out, self.peer)

    def _amo_args(self, op: str, offset: int, dtype: Any, count: int
                  ) -> tuple[int, bool, int, int]:
        """Checked ``(size, signed, opcode, remote address)`` for ``count`` elements at
        ``offset``."""
        ctype = _CTYPES.get(dtype)
        if ctype is None:
            dt = np.dtype(dtype)
            if dt not in _AMO_TYPES:
                raise TypeError(f"remote atomics work on 32/64-bit integers, not {dt}")
            ctype = _CTYPES[dtype] = _CTYPES[dt]
        size, signed = ctype
        opcode = self._aeng.amo.get(op)
        if opcode is None:
            raise ValueError(f"unknown atomic op {op!r}")
        if offset % size:
            raise WindowError(f"atomic at offset {offset} is not {size}-byte aligned")
        return size, signed, opcode, self._check(offset, size * count, f"atomic {op}")

    async def atomic_many(self, op: str, values: Iterable[Any], offset: int,
                          dtype: Any = np.uint64, fetch: bool = False) -> list[int] | None:
        """``op`` (add, swap, and, or, xor) of ``values[i]`` on the consecutive integers
        from ``offset``: one remote atomic per element, all in flight together (each is
        atomic; the batch is not). Returns the previous values when ``fetch``."""
        if op == "cswap":
            raise ValueError("atomic_many does not do compare-and-swap")
        vals = [int(v) for v in values]
        size, signed, opcode, raddr = self._amo_args(op, offset, dtype, len(vals))
        eng = self._aeng
        atomic = eng._ucp.rma_atomic
        # Posted without waiting in place (spin 0): all in flight, then collected; the
        # requests (which own their reply words) are awaited even if a later post fails.
        outs: list[Any] = []
        try:
            for i, v in enumerate(vals):
                outs.append(atomic(eng.handle, self._aep, opcode, size, signed, v, None,
                                   fetch, raddr + i * size, self._arkey, 0.0))
        finally:
            results = await asyncio.gather(*(eng.finish(o, self.peer) for o in outs),
                                           return_exceptions=True)
        olds: list[int] = []
        for res in results:
            if isinstance(res, BaseException):
                raise res
            olds.append(res)
        return olds if fetch else None

    async def atomic(self, op: str, value: Any, offset: int, dtype: Any = np.uint64,
                     fetch: bool = True, compare: Any = None) -> Any:
        """Remote atomic ``op`` (add, swap, cswap, and, or, xor) on a 32- or 64-bit
        integer at ``offset``; returns the previous value when ``fetch`` (always for
        cswap, whose ``compare`` is the expected value). Values wrap like the hardware's
        (two's complement at the element's width)."""
        size, signed, opcode, raddr = self._amo_args(op, offset, dtype, 1)
        eng = self._aeng
        out = eng._ucp.rma_atomic(eng.handle, self._aep, opcode, size, signed, int(value),
                                  None if op != "cswap" else int(compare), fetch, raddr,
                                  self._arkey, eng.spin_s)
        if type(out) is eng._request_type:
            return await eng.finish(out, self.peer)
        return out

    def close(self) -> None:
        """Release the key (idempotent)."""
        if not self.closed:
            self.closed = True
            for eng, _, rkey in self._targets:
                if not eng.closed and rkey in eng._rkeys:
                    eng._rkeys.discard(rkey)
                    _ucx.ucp.rma_rkey_destroy(rkey)

    def __del__(self) -> None:
        # A key dropped without close() is released here; the engine releases the
        # others when it closes (UCX warns about keys left behind at its teardown).
        if not getattr(self, "closed", True):
            self.close()
