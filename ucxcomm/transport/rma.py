"""One-sided communication: registered memory, remote keys, put/get/flush and atomics.

RMA runs on its own UCX context and thread-safe worker (the *RMA engine*, one per
process, created on first use), progressed by a background thread. Two reasons:

* Over TCP and shared memory UCX emulates RMA and atomics with active messages that the
  **target** must process; the thread serves them while the target's Python code is busy
  computing (it sleeps on the worker's event descriptor when there is nothing to do).
* Without RDMA, UCX's protocols force a choice (UCX 1.21, measured here): with the
  default v2 protocols 64 MiB puts run at 3.4-4.7 GB/s but an 8 B fetch-add takes
  100-300 us; with ``UCX_PROTO_ENABLE=n`` (v1) atomics take ~10 us (shared-memory
  atomics) but puts drop to 1.5 GB/s. So without RDMA there are two engines: bulk
  put/get on a v2 context, atomics on a v1 one, both mapping the same memory; with an
  RDMA device (hardware atomics) or a user-set ``UCX_PROTO_ENABLE``, one engine does all.
  The tag traffic on the main worker keeps UCX's defaults either way.

A :class:`MemoryRegion`'s ``rkey`` is self-describing (per engine: the owner's engine
address plus UCX's packed key), so ``RemoteMemory(rkey, address, nbytes)`` needs nothing
else.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import struct
import time
from typing import Any

import numpy as np

from ..errors import ClosedError, UnsupportedError, WindowError
from . import _ucx
from .base import Region, Remote

__all__ = ["MemoryRegion", "RemoteMemory", "RmaEngine", "engine", "engines", "register",
           "shutdown"]

log = logging.getLogger(__name__)

_engines: dict[bool, RmaEngine] = {}  # keyed by "uses UCX's v1 protocols"
_split: bool | None = None  # two engines (bulk on v2, atomics on v1)?
_atexit_registered = False
_SPIN_S = 200e-6
# How long the engine's thread keeps polling after activity before it sleeps on the
# worker's event descriptor (UCXCOMM_RMA_SPIN_US).
DEFAULT_RMA_SPIN_US = 200.0
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


def _host_view(ffi: Any, buf: Any, writable: bool, what: str) -> Any:
    """A cffi view of a contiguous host buffer (validated; GPU memory is refused)."""
    try:
        return ffi.from_buffer(buf, require_writable=writable)
    except (TypeError, ValueError, BufferError):
        from .._buffers import as_recv_buffer, as_send_buffer

        spec = (as_recv_buffer if writable else as_send_buffer)(buf)  # clear errors
        if spec.device:
            raise UnsupportedError(f"{what}: GPU origin buffers are not supported for "
                                   "RMA yet; pass host memory") from None
        return ffi.from_buffer(spec.obj, require_writable=writable)


def _wrap(value: Any, size: int, signed: bool) -> int:
    """``value`` as the ``size``-byte integer the hardware would see (two's complement)."""
    bits = size * 8
    v = int(value) & ((1 << bits) - 1)
    if signed and v >> (bits - 1):
        v -= 1 << bits
    return v


def _rdma_atomics_available() -> bool:
    from . import config

    det = config.detect(_ucx.libucp_path())
    return det.verbs and bool(det.active_ports)


def _decide() -> bool:
    """Whether bulk transfers and atomics get separate engines (see the module doc)."""
    global _split
    if _split is None:
        if "UCX_PROTO_ENABLE" in os.environ:
            log.info("RMA: UCX_PROTO_ENABLE=%s set by you: one engine",
                     os.environ["UCX_PROTO_ENABLE"])
            _split = False
        elif _rdma_atomics_available():
            _split = False
        else:
            log.info("RMA: no RDMA device: put/get on UCX's default protocols, atomics on "
                     "a second context with UCX_PROTO_ENABLE=n (fast shared-memory/TCP "
                     "atomics)")
            _split = True
    return _split


def _engine(v1: bool) -> RmaEngine:
    eng = _engines.get(v1)
    if eng is None or eng.closed:
        global _atexit_registered
        if not _atexit_registered:
            # Stop the progress threads before interpreter (and UCX library) teardown.
            atexit.register(shutdown)
            _atexit_registered = True
        eng = _engines[v1] = RmaEngine(proto_v1=v1)
    return eng


def engine(atomics: bool = False) -> RmaEngine:
    """This process's engine for bulk transfers (or for ``atomics``); created on first use."""
    return _engine(atomics and _decide())


def engines() -> list[RmaEngine]:
    """Every engine a registration must map memory into."""
    return [engine(False), engine(True)] if _decide() else [engine(False)]


def register(buf: Any) -> MemoryRegion:
    """Register ``buf`` for remote access with every engine (see :class:`MemoryRegion`)."""
    return MemoryRegion(buf)


def shutdown() -> None:
    """Close this process's RMA engines, if any were created (at finalize)."""
    global _split
    for eng in list(_engines.values()):
        eng.close()
    _engines.clear()
    _split = None


class RmaEngine:
    """A UCX context + thread-safe worker for RMA, progressed by a background thread.

    Raises
    ------
    UnsupportedError
        UCX could not create the context or worker.
    """

    def __init__(self, proto_v1: bool = False) -> None:
        _ucx.load()
        self._ffi, self._lib = _ucx.ffi, _ucx.lib
        self.proto_v1 = proto_v1
        out = self._ffi.new("void *[1]")
        err = self._ffi.new("char[128]")
        spin_s = float(os.environ.get("UCXCOMM_RMA_SPIN_US", DEFAULT_RMA_SPIN_US)) * 1e-6
        st = self._lib.ucxcomm_rma_create(int(proto_v1), spin_s, out, err, 128)
        if st != 0:
            raise UnsupportedError(f"cannot create the RMA engine: "
                                   f"{self._ffi.string(err).decode()} failed "
                                   f"({_ucx.status_error(st)})")
        self._eng = out[0]
        buf = self._ffi.new("char[4096]")
        n = self._ffi.new("size_t[1]")
        st = self._lib.ucxcomm_rma_address(self._eng, buf, 4096, n)
        if st != 0:
            raise _ucx.status_error(st, what="RMA worker address")
        self.address = bytes(self._ffi.buffer(buf, n[0]))
        self._eps: dict[bytes, int] = {}
        self._regions: list[MemoryRegion] = []
        self._req_out = self._ffi.new("void *[1]")
        self._amo = {op: getattr(self._lib, name) for op, name in _OPS.items()}
        self.closed = False

    def endpoint(self, address: bytes) -> int:
        """The (cached) endpoint handle to the engine at ``address``."""
        self._check()
        ep = self._eps.get(address)
        if ep is None:
            out = self._ffi.new("uintptr_t[1]")
            st = self._lib.ucxcomm_rma_connect(self._eng, address, out)
            if st != 0:
                raise _ucx.status_error(st, what="RMA connect")
            ep = self._eps[address] = int(out[0])
        return ep

    def _check(self) -> None:
        if self.closed:
            raise ClosedError("the RMA engine is closed")

    # ------------------------------------------------------------ requests
    def post(self, st: int) -> Any:
        """The request of an operation just posted (None when already complete)."""
        if st == 0:
            return None
        if st < 0:
            raise _ucx.status_error(st, what="RMA")
        return self._req_out[0]

    async def wait(self, req: Any) -> None:
        """Await a request: spin briefly (progressing the worker ourselves), then hand
        progress to the engine's thread and check back with growing pauses."""
        if req is None:
            return
        lib, eng = self._lib, self._eng
        test, progress = lib.ucxcomm_rma_test, lib.ucxcomm_rma_progress
        inprogress = lib.UCXCOMM_INPROGRESS
        end = time.perf_counter() + _SPIN_S
        st = test(req)
        while st == inprogress and time.perf_counter() < end:
            progress(eng)
            st = test(req)
        pause = 20e-6
        while st == inprogress:
            lib.ucxcomm_rma_wake(eng)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2e-4)
            st = test(req)
        if st < 0:
            raise _ucx.status_error(st, what="RMA")

    def close(self) -> None:
        """Release every region, endpoint and the engine (stops its thread)."""
        if self.closed:
            return
        self.closed = True
        for region in list(self._regions):
            region.close()
        for ep in self._eps.values():
            self._lib.ucxcomm_rma_ep_close(self._eng, ep)
        self._eps.clear()
        self._lib.ucxcomm_rma_destroy(self._eng)


class MemoryRegion(Region):
    """Memory registered for remote access.

    Attributes
    ----------
    address : int
        Its address (what peers pass as ``address`` with the ``rkey``).
    nbytes : int
    rkey : bytes
        Everything a peer needs to reach it: the owner's RMA address and UCX's key.
    """

    def __init__(self, buf: Any) -> None:
        engs = engines()
        ffi = engs[0]._ffi
        iface = getattr(buf, "__cuda_array_interface__", None)
        if iface is not None:
            ptr = ffi.cast("void *", iface["data"][0])
            from .._buffers import as_recv_buffer

            nbytes = as_recv_buffer(buf).nbytes
            self._keep: Any = buf
        else:
            cbuf = _host_view(ffi, buf, True, "register")
            ptr, nbytes, self._keep = cbuf, len(cbuf), (cbuf, buf)
        self.nbytes = nbytes
        self.address = int(ffi.cast("uintptr_t", ptr))
        self._maps: list[tuple[RmaEngine, Any]] = []
        sections = []
        try:
            for eng in engs:
                lib = eng._lib
                memh = ffi.new("void *[1]")
                st = lib.ucxcomm_rma_mem_map(eng._eng, ptr, max(nbytes, 1), memh)
                if st != 0:
                    raise _ucx.status_error(st, what="memory registration")
                self._maps.append((eng, memh[0]))
                kbuf = ffi.new("char[8192]")
                n = ffi.new("size_t[1]")
                st = lib.ucxcomm_rma_rkey_pack(eng._eng, memh[0], kbuf, 8192, n)
                if st != 0:
                    raise _ucx.status_error(st, what="rkey pack")
                packed = bytes(ffi.buffer(kbuf, n[0]))
                sections.append(_SECTION.pack(int(eng.proto_v1), len(eng.address),
                                              len(packed)) + eng.address + packed)
        except BaseException:
            self.released = False
            self.close()
            raise
        self.rkey = _BLOB.pack(_MAGIC, len(sections)) + b"".join(sections)
        self.released = False
        for eng, _ in self._maps:
            eng._regions.append(self)

    def close(self) -> None:
        """Unregister (peers' remote keys to it become invalid). Idempotent."""
        if self.released:
            return
        self.released = True
        for eng, memh in self._maps:
            if not eng.closed or self in eng._regions:  # close() releases regions first
                eng._lib.ucxcomm_rma_mem_unmap(eng._eng, memh)
            if self in eng._regions:
                eng._regions.remove(self)
        self._maps = []


_OPS = {"add": "UCXCOMM_AMO_ADD", "swap": "UCXCOMM_AMO_SWAP", "cswap": "UCXCOMM_AMO_CSWAP",
        "and": "UCXCOMM_AMO_AND", "or": "UCXCOMM_AMO_OR", "xor": "UCXCOMM_AMO_XOR"}


class RemoteMemory(Remote):
    """A peer's registered memory: ``RemoteMemory(rkey, address, nbytes)``.

    Offsets are in bytes from ``address``. Every access is checked against ``nbytes``
    before anything moves (:class:`~ucxcomm.WindowError`). ``put``/``get`` return when
    the local buffer may be reused / holds the data; ``flush`` waits until every
    operation issued to this peer is complete at the target.
    """

    def __init__(self, rkey: bytes, address: int, nbytes: int) -> None:
        rkey = bytes(rkey)
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
        self._targets: list[tuple[RmaEngine, int, Any]] = []
        by_kind = {}
        for v1, (peer, packed) in found.items():
            eng = _engine(v1)
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
        self._released = False

    def _check(self, offset: int, n: int, what: str) -> int:
        if self._released or self._eng.closed or self._aeng.closed:
            raise ClosedError("this remote memory was released")
        if type(offset) is not int:
            offset = int(offset)
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise WindowError(f"{what}: bytes [{offset}, {offset + n}) are outside the "
                              f"{self.nbytes}-byte remote region")
        return self.address + offset

    async def put(self, buf: Any, offset: int = 0) -> None:
        """Write ``buf`` at ``offset``; returns when ``buf`` may be reused."""
        ffi = self._eng._ffi
        src = _host_view(ffi, buf, False, "put")
        raddr = self._check(offset, len(src), "put")
        eng = self._eng
        st = eng._lib.ucxcomm_rma_put(self._ep, src, len(src), raddr, self._rkey,
                                      eng._req_out)
        await eng.wait(eng.post(st))

    async def get(self, buf: Any, offset: int = 0) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``."""
        ffi = self._eng._ffi
        dst = _host_view(ffi, buf, True, "get")
        raddr = self._check(offset, len(dst), "get")
        eng = self._eng
        st = eng._lib.ucxcomm_rma_get(self._ep, dst, len(dst), raddr, self._rkey,
                                      eng._req_out)
        await eng.wait(eng.post(st))

    async def flush(self) -> None:
        """Complete, at the target, every operation issued to this peer."""
        for eng, ep, _ in self._targets:
            st = eng._lib.ucxcomm_rma_flush(ep, eng._req_out)
            await eng.wait(eng.post(st))

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
        opcode = self._aeng._amo.get(op)
        if opcode is None:
            raise ValueError(f"unknown atomic op {op!r}")
        if offset % size:
            raise WindowError(f"atomic at offset {offset} is not {size}-byte aligned")
        return ctype, opcode, self._check(offset, size * count, f"atomic {op}")

    async def atomic_many(self, op: str, values: Any, offset: int, dtype: Any = np.uint64,
                          fetch: bool = False) -> list[int] | None:
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
        reqs = []
        try:
            for i in range(len(vals)):
                st = lib.ucxcomm_rma_atomic(self._aep, opcode, arr + i,
                                            reply + i if fetch else ffi.NULL, size,
                                            raddr + i * size, self._arkey, eng._req_out)
                if st:
                    reqs.append(eng.post(st))
        finally:
            for req in reqs:  # (buffers stay alive until every request is done)
                await eng.wait(req)
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
        st = eng._lib.ucxcomm_rma_atomic(self._aep, opcode, val, reply, size, raddr,
                                         self._arkey, eng._req_out)
        if st:
            await eng.wait(eng.post(st))
        return None if reply == ffi.NULL else reply[0]

    async def fetch_add(self, value: Any, offset: int = 0, dtype: Any = np.uint64) -> Any:
        return await self.atomic("add", value, offset, dtype)

    async def add(self, value: Any, offset: int = 0, dtype: Any = np.uint64) -> None:
        await self.atomic("add", value, offset, dtype, fetch=False)

    async def swap(self, value: Any, offset: int = 0, dtype: Any = np.uint64) -> Any:
        return await self.atomic("swap", value, offset, dtype)

    async def compare_swap(self, compare: Any, value: Any, offset: int = 0,
                           dtype: Any = np.uint64) -> Any:
        """Write ``value`` if the target holds ``compare``; returns the old value."""
        return await self.atomic("cswap", value, offset, dtype, compare=compare)

    def close(self) -> None:
        """Release the key (idempotent)."""
        if not self._released:
            self._released = True
            for eng, _, rkey in self._targets:
                if not eng.closed:
                    eng._lib.ucxcomm_rma_rkey_destroy(rkey)
