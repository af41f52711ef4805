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
import logging
import struct
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import settings
from ..errors import ClosedError, WindowError
from . import _ucx
from ._target import host_target, target
from .base import Region, Remote
from .progress import Progress

__all__ = ["MemoryRegion", "RemoteMemory", "RmaEngine", "RmaEngines"]

log = logging.getLogger(__name__)

_BLOB = struct.Struct("<4sB")  # magic, number of sections
_SECTION = struct.Struct("<BII")  # v1 protocols?, address length, packed rkey length
_MAGIC = b"UCR2"
_AMO_TYPES = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64),
              np.dtype(np.uint64)}
# dtype -> (cffi type, size, signed); also keyed by the dtype-like objects callers pass
_CTYPES: dict[Any, tuple[str, int, bool]] = {}
for _t, _c in ((np.int32, "int32_t *"), (np.uint32, "uint32_t *"), (np.int64, "int64_t *"),
               (np.uint64, "uint64_t *")):
    _CTYPES[_t] = _CTYPES[np.dtype(_t)] = (_c, np.dtype(_t).itemsize,
                                           np.dtype(_t).kind == "i")
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


def _wrap(value: Any, size: int, signed: bool) -> int:
    """``value`` as the ``size``-byte integer the hardware would see (two's complement)."""
    bits = size * 8
    v = int(value) & ((1 << bits) - 1)
    if signed and v >> (bits - 1):
        v -= 1 << bits
    return v


class _RmaOp:
    __slots__ = ("future", "keep", "req")

    def __init__(self, req: Any, future: asyncio.Future, keep: Any) -> None:
        self.req, self.future, self.keep = req, future, keep


class RmaEngine:
    """A UCX context + thread-safe worker for RMA, progressed by a background thread;
    a progress source for the Python side's waits.

    Parameters
    ----------
    options : dict
        UCX context options (keys without ``UCX_``), like the main context's.
    progress : Progress
        The owning worker's progress engine.

    Raises
    ------
    UcxCommError
        UCX could not create the context, worker or thread.
    """

    watch_idle = False  # its own thread serves peers; we only poll our requests

    def __init__(self, options: dict[str, str], progress: Progress,
                 loop: asyncio.AbstractEventLoop) -> None:
        _ucx.load()
        ffi, lib = self._ffi, self._lib = _ucx.ffi, _ucx.lib
        self.options = dict(options)
        self.proto_v1 = self.options.get("PROTO_ENABLE", "").lower() in ("n", "no", "0")
        keys = [ffi.new("char[]", k.encode()) for k in self.options]
        values = [ffi.new("char[]", v.encode()) for v in self.options.values()]
        out = ffi.new("void *[1]")
        err = ffi.new("char[256]")
        spin_s = settings.get("UCXCOMM_RMA_SPIN_US") * 1e-6
        st = lib.ucxcomm_rma_create(ffi.new("char *[]", keys), ffi.new("char *[]", values),
                                    len(keys), spin_s, out, err, 256)
        if st != 0:
            raise _ucx.status_error(st, what="creating the RMA engine "
                                    f"({ffi.string(err).decode()})")
        self.handle = out[0]
        self.closed = False
        _live.add(self)
        buf = ffi.new("char[4096]")
        n = ffi.new("size_t[1]")
        st = lib.ucxcomm_rma_address(self.handle, buf, 4096, n)
        if st != 0:
            self.close()
            raise _ucx.status_error(st, what="RMA worker address")
        self.address = bytes(ffi.buffer(buf, n[0]))
        self._fd = lib.ucxcomm_rma_notify_fd(self.handle)
        self._eps: dict[bytes, int] = {}
        self._regions: list[MemoryRegion] = []
        self.req_out = ffi.new("void *[1]")
        self.amo = {op: _ucx.const[name] for op, name in _OPS.items()}
        self._ops: list[_RmaOp] = []
        self._progress = progress
        self._loop = loop
        progress.add(self)

    def endpoint(self, address: bytes) -> int:
        """The (cached) endpoint handle to the engine at ``address``."""
        self.check()
        ep = self._eps.get(address)
        if ep is None:
            out = self._ffi.new("uintptr_t[1]")
            st = self._lib.ucxcomm_rma_connect(self.handle, address, out)
            if st != 0:
                raise _ucx.status_error(st, what="RMA connect")
            ep = self._eps[address] = int(out[0])
        return ep

    def check(self) -> None:
        if self.closed:
            raise ClosedError("the RMA engine is closed")

    # ------------------------------------------------------------ requests
    async def wait(self, st: int, keep: Any = None, req: Any = None) -> None:
        """Await the operation just posted with status ``st`` (its request in
        ``req_out``, unless given as ``req``); ``keep`` stays alive until UCX is done
        with it.

        A small operation usually completes within microseconds: it is first waited for
        in place (:meth:`Progress.spin`, while the event loop is idle), like a blocking
        receive; only then does it become a future for :meth:`Progress.wait`.
        """
        if st == 0:
            return
        if st < 0:
            raise _ucx.status_error(st, what="RMA")
        if req is None:
            req = self.req_out[0]
        lib = self._lib
        st = self._progress.spin_request(lib.ucxcomm_rma_progress, self.handle,
                                         lib.ucxcomm_rma_test, req, 1)  # UCXCOMM_INPROGRESS
        if st != 1:
            if st < 0:
                raise _ucx.status_error(st, what="RMA")
            return
        fut = self._loop.create_future()
        self._ops.append(_RmaOp(req, fut, keep))
        await self._progress.wait(fut, self.poll)

    # ------------------------------------------------------ progress source
    def pending(self) -> bool:
        return bool(self._ops)

    def poll(self) -> int:
        self._lib.ucxcomm_rma_progress(self.handle)
        return self._test()

    def _test(self) -> int:
        test = self._lib.ucxcomm_rma_test
        keep, done = [], 0
        for op in self._ops:
            st = test(op.req)
            if st == 1:
                keep.append(op)
                continue
            done += 1
            if not op.future.done():
                if st < 0:
                    op.future.set_exception(_ucx.status_error(st, what="RMA"))
                else:
                    op.future.set_result(None)
        self._ops = keep
        return done

    def arm(self) -> bool:
        self._lib.ucxcomm_rma_arm(self.handle)
        return not self._test()

    def disarm(self) -> None:
        self._lib.ucxcomm_rma_disarm(self.handle)

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
            if not op.future.done():
                op.future.set_exception(ClosedError("the RMA engine was closed"))
                op.future.exception()  # nobody may await it any more
        self._ops = []
        for region in list(self._regions):
            region.close()
        for ep in self._eps.values():
            self._lib.ucxcomm_rma_ep_close(self.handle, ep)
        self._eps.clear()
        self._lib.ucxcomm_rma_destroy(self.handle)


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
                 loop: asyncio.AbstractEventLoop) -> None:
        self._options = dict(options)
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
            eng = self._engines[v1] = RmaEngine(opts, self._progress, self._loop)
        return eng

    def local(self) -> list[RmaEngine]:
        """Every engine a registration maps memory into."""
        if self.split:
            return [self.engine(False), self.engine(True)]
        return [self.engine(self._options.get("PROTO_ENABLE", "").lower()
                            in ("n", "no", "0"))]

    def register(self, buf: Any) -> MemoryRegion:
        return MemoryRegion(self, buf)

    def remote(self, rkey: bytes, address: int, nbytes: int) -> RemoteMemory:
        return RemoteMemory(self, rkey, address, nbytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


class MemoryRegion(Region):
    """Memory registered for remote access (``worker.register(buf)``).

    Attributes
    ----------
    address : int
        Its address (what peers pass as ``address`` with the ``rkey``).
    nbytes : int
    rkey : bytes
        Everything a peer needs to reach it: the owner's RMA address and UCX's key, per
        engine.
    """

    def __init__(self, engines: RmaEngines, buf: Any) -> None:
        engs = engines.local()
        ffi = _ucx.ffi
        ptr, nbytes, self._keep, _ = target(buf, writable=True, cuda=True)
        self.nbytes = nbytes
        self.address = int(ffi.cast("uintptr_t", ptr))
        self._maps: list[tuple[RmaEngine, Any]] = []
        self.closed = False
        sections = []
        try:
            for eng in engs:
                lib = eng._lib
                memh = ffi.new("void *[1]")
                st = lib.ucxcomm_rma_mem_map(eng.handle, ptr, max(nbytes, 1), memh)
                if st != 0:
                    raise _ucx.status_error(st, what="memory registration")
                self._maps.append((eng, memh[0]))
                kbuf = ffi.new("char[8192]")
                n = ffi.new("size_t[1]")
                st = lib.ucxcomm_rma_rkey_pack(eng.handle, memh[0], kbuf, 8192, n)
                if st != 0:
                    raise _ucx.status_error(st, what="rkey pack")
                packed = bytes(ffi.buffer(kbuf, n[0]))
                sections.append(_SECTION.pack(int(eng.proto_v1), len(eng.address),
                                              len(packed)) + eng.address + packed)
        except BaseException:
            self.close()
            raise
        self.rkey = _BLOB.pack(_MAGIC, len(sections)) + b"".join(sections)
        for eng, _ in self._maps:
            eng._regions.append(self)

    def close(self) -> None:
        """Unregister (peers' remote keys to it become invalid). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for eng, memh in self._maps:
            listed = self in eng._regions
            if listed:
                eng._regions.remove(self)
            if not eng.closed or listed:  # a closing engine closes its regions first
                eng._lib.ucxcomm_rma_mem_unmap(eng.handle, memh)
        self._maps = []


def _parse_rkey(rkey: bytes) -> dict[bool, tuple[bytes, bytes]]:
    """``{v1: (owner engine address, packed UCX key)}`` of a :class:`MemoryRegion` key."""
    if len(rkey) < _BLOB.size or rkey[:4] != _MAGIC:
        raise ValueError("not a ucxcomm remote key (from MemoryRegion.rkey)")
    _, count = _BLOB.unpack_from(rkey)
    pos, found = _BLOB.size, {}
    for _ in range(count):
        if pos + _SECTION.size > len(rkey):
            raise ValueError("truncated remote key")
        v1, alen, klen = _SECTION.unpack_from(rkey, pos)
        pos += _SECTION.size
        found[bool(v1)] = (rkey[pos:pos + alen], rkey[pos + alen:pos + alen + klen])
        pos += alen + klen
    if pos != len(rkey) or not found:
        raise ValueError("malformed remote key")
    return found


class RemoteMemory(Remote):
    """A peer's registered memory (``worker.remote_memory(rkey, address, nbytes)``).

    Offsets are in bytes from ``address``. Every access is checked against ``nbytes``
    before anything moves (:class:`~ucxcomm.WindowError`). ``put``/``get`` return when
    the local buffer may be reused / holds the data; ``flush`` waits until every
    operation issued to this peer is complete at the target.
    """

    def __init__(self, engines: RmaEngines, rkey: bytes, address: int, nbytes: int) -> None:
        found = _parse_rkey(bytes(rkey))
        self._targets: list[tuple[RmaEngine, int, Any]] = []
        by_kind = {}
        for v1, (peer, packed) in found.items():
            eng = engines.engine(v1)
            ep = eng.endpoint(peer)
            out = eng._ffi.new("void *[1]")
            st = eng._lib.ucxcomm_rma_rkey_unpack(ep, packed, out)
            if st != 0:
                raise _ucx.status_error(st, what="rkey unpack")
            by_kind[v1] = (eng, ep, out[0])
            self._targets.append(by_kind[v1])
        # bulk transfers on the v2 engine, atomics on the v1 one (when the owner has both)
        self._eng, self._ep, self._rkey = by_kind.get(False) or by_kind[True]
        self._aeng, self._aep, self._arkey = by_kind.get(True) or by_kind[False]
        self.address, self.nbytes = int(address), int(nbytes)
        self.closed = False

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
        for _, ep, _ in self._targets:
            lanes.extend(lane for lane in _ucx.endpoint_transports(ep) if lane not in lanes)
        return lanes

    async def put(self, buf: Any, offset: int = 0) -> None:
        """Write ``buf`` at ``offset``; returns when ``buf`` may be reused."""
        eng = self._eng
        src, n, keep, _ = host_target(buf, False, "put")
        raddr = self._check(offset, n, "put")
        st = eng._lib.ucxcomm_rma_put(eng.handle, self._ep, src, n, raddr, self._rkey,
                                      eng.req_out)
        await eng.wait(st, keep)

    async def get(self, buf: Any, offset: int = 0) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``."""
        eng = self._eng
        dst, n, keep, _ = host_target(buf, True, "get")
        raddr = self._check(offset, n, "get")
        st = eng._lib.ucxcomm_rma_get(eng.handle, self._ep, dst, n, raddr, self._rkey,
                                      eng.req_out)
        await eng.wait(st, keep)

    async def flush(self) -> None:
        """Complete, at the target, every operation issued to this peer."""
        if self.closed:
            raise ClosedError("this remote memory was closed")
        for eng, ep, _ in self._targets:
            await eng.wait(eng._lib.ucxcomm_rma_flush(eng.handle, ep, eng.req_out))

    def _amo_args(self, op: str, offset: int, dtype: Any, count: int
                  ) -> tuple[tuple[str, int, bool], int, int]:
        """Checked ``(ctype, opcode, remote address)`` for ``count`` elements at ``offset``."""
        ctype = _CTYPES.get(dtype)
        if ctype is None:
            dt = np.dtype(dtype)
            if dt not in _AMO_TYPES:
                raise TypeError(f"remote atomics work on 32/64-bit integers, not {dt}")
            ctype = _CTYPES[dtype] = _CTYPES[dt]
        size = ctype[1]
        opcode = self._aeng.amo.get(op)
        if opcode is None:
            raise ValueError(f"unknown atomic op {op!r}")
        if offset % size:
            raise WindowError(f"atomic at offset {offset} is not {size}-byte aligned")
        return ctype, opcode, self._check(offset, size * count, f"atomic {op}")

    async def atomic_many(self, op: str, values: Iterable[Any], offset: int,
                          dtype: Any = np.uint64, fetch: bool = False) -> list[int] | None:
        """``op`` (add, swap, and, or, xor) of ``values[i]`` on the consecutive integers
        from ``offset``: one remote atomic per element, all in flight together (each is
        atomic; the batch is not). Returns the previous values when ``fetch``."""
        if op == "cswap":
            raise ValueError("atomic_many does not do compare-and-swap")
        vals = list(values)
        (cname, size, signed), opcode, raddr = self._amo_args(op, offset, dtype, len(vals))
        if not vals:
            return [] if fetch else None
        eng = self._aeng
        ffi, lib = eng._ffi, eng._lib
        arr = ffi.new(cname[:-1] + "[]", [_wrap(v, size, signed) for v in vals])
        reply = ffi.new(cname[:-1] + "[]", len(vals)) if fetch else ffi.NULL
        waits = []
        try:
            for i in range(len(vals)):
                st = lib.ucxcomm_rma_atomic(eng.handle, self._aep, opcode, arr + i,
                                            reply + i if fetch else ffi.NULL, size,
                                            raddr + i * size, self._arkey, eng.req_out)
                if st:
                    waits.append(eng.wait(st, (arr, reply)))
        finally:
            # (buffers stay alive until every request is done; the first error wins)
            results = await asyncio.gather(*waits, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return list(reply) if fetch else None

    async def atomic(self, op: str, value: Any, offset: int, dtype: Any = np.uint64,
                     fetch: bool = True, compare: Any = None) -> Any:
        """Remote atomic ``op`` (add, swap, cswap, and, or, xor) on a 32- or 64-bit
        integer at ``offset``; returns the previous value when ``fetch``."""
        (cname, size, signed), opcode, raddr = self._amo_args(op, offset, dtype, 1)
        eng = self._aeng
        ffi = eng._ffi
        val = ffi.new(cname, _wrap(value, size, signed))  # wraps like the hardware does
        reply = ffi.NULL
        if op == "cswap":  # UCP: the operand is the compare value, the reply buffer
            val, reply = ffi.new(cname, _wrap(compare, size, signed)), val  # brings the new
        elif fetch:                                                        # value in
            reply = ffi.new(cname)
        st = eng._lib.ucxcomm_rma_atomic(eng.handle, self._aep, opcode, val, reply, size,
                                         raddr, self._arkey, eng.req_out)
        if st:
            await eng.wait(st, (val, reply))
        return None if reply == ffi.NULL else reply[0]

    def close(self) -> None:
        """Release the key (idempotent)."""
        if not self.closed:
            self.closed = True
            for eng, _, rkey in self._targets:
                if not eng.closed:
                    eng._lib.ucxcomm_rma_rkey_destroy(rkey)
