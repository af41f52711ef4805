"""One-sided communication: registered memory, remote keys, put/get/flush and atomics.

RMA runs on its own UCX context and thread-safe worker (the *RMA engine*, one per
process, created on first use), progressed by a background thread. Two reasons:

* Over TCP and shared memory UCX emulates RMA and atomics with active messages that the
  **target** must process; the thread serves them while the target's Python code is busy
  computing (it sleeps on the worker's event descriptor when there is nothing to do).
* UCX's default (v2) protocols fail emulated atomics over TCP/shared memory
  (DESIGN.md §2); ``UCX_PROTO_ENABLE=n`` makes them work. The engine's context gets it
  only when no RDMA device will carry the atomics in hardware, and never when the user
  set ``UCX_PROTO_ENABLE``; the tag traffic on the main worker keeps UCX's defaults.

A :class:`MemoryRegion`'s ``rkey`` is self-describing (the owner's engine address plus
UCX's packed key), so ``RemoteMemory(rkey, address, nbytes)`` needs nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from typing import Any

import numpy as np

from ..errors import ClosedError, UnsupportedError, WindowError
from . import _ucx

__all__ = ["MemoryRegion", "RemoteMemory", "RmaEngine", "engine", "shutdown"]

log = logging.getLogger(__name__)

_engine: RmaEngine | None = None
_SPIN_S = 200e-6
# How long the engine's thread keeps polling after activity before it sleeps on the
# worker's event descriptor (UCXCOMM_RMA_SPIN_US).
DEFAULT_RMA_SPIN_US = 200.0
_BLOB = struct.Struct("<4sII")  # magic, address length, packed rkey length
_MAGIC = b"UCR1"
_AMO_TYPES = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64),
              np.dtype(np.uint64)}
# dtype -> (cffi type, size, signed); also keyed by the dtype-like objects callers pass
_CTYPES: dict[Any, tuple[str, int, bool]] = {}
for _t, _c in ((np.int32, "int32_t *"), (np.uint32, "uint32_t *"), (np.int64, "int64_t *"),
               (np.uint64, "uint64_t *")):
    _CTYPES[_t] = _CTYPES[np.dtype(_t)] = (_c, np.dtype(_t).itemsize,
                                           np.dtype(_t).kind == "i")


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


def engine() -> RmaEngine:
    """This process's RMA engine (created on first use)."""
    global _engine
    if _engine is None or _engine.closed:
        _engine = RmaEngine()
    return _engine


def shutdown() -> None:
    """Close this process's RMA engine, if one was created (at finalize)."""
    global _engine
    if _engine is not None:
        _engine.close()
        _engine = None


class RmaEngine:
    """A UCX context + thread-safe worker for RMA, progressed by a background thread.

    Raises
    ------
    UnsupportedError
        UCX could not create the context or worker.
    """

    def __init__(self) -> None:
        _ucx.load()
        self._ffi, self._lib = _ucx.ffi, _ucx.lib
        if "UCX_PROTO_ENABLE" in os.environ:
            proto_v1 = False
            log.info("RMA: UCX_PROTO_ENABLE=%s set by you", os.environ["UCX_PROTO_ENABLE"])
        else:
            proto_v1 = not _rdma_atomics_available()
            if proto_v1:
                log.info("RMA: no RDMA device: UCX_PROTO_ENABLE=n on the RMA context "
                         "(emulated atomics over TCP/shared memory need UCX's v1 protocols)")
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

    def register(self, buf: Any) -> MemoryRegion:
        """Register ``buf`` (writable host buffer, or GPU memory where UCX has CUDA) for
        remote access; keep the region (and ``buf``) alive while peers use it."""
        self._check()
        return MemoryRegion(self, buf)

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
            region.release()
        for ep in self._eps.values():
            self._lib.ucxcomm_rma_ep_close(self._eng, ep)
        self._eps.clear()
        self._lib.ucxcomm_rma_destroy(self._eng)


class MemoryRegion:
    """Memory registered for remote access.

    Attributes
    ----------
    address : int
        Its address (what peers pass as ``address`` with the ``rkey``).
    nbytes : int
    rkey : bytes
        Everything a peer needs to reach it: the owner's RMA address and UCX's key.
    """

    def __init__(self, eng: RmaEngine, buf: Any) -> None:
        ffi, lib = eng._ffi, eng._lib
        iface = getattr(buf, "__cuda_array_interface__", None)
        if iface is not None:
            ptr = ffi.cast("void *", iface["data"][0])
            from .._buffers import as_recv_buffer

            nbytes = as_recv_buffer(buf).nbytes
            self._keep: Any = buf
        else:
            try:
                cbuf = ffi.from_buffer(buf, require_writable=True)
            except (TypeError, ValueError, BufferError):
                from .._buffers import as_recv_buffer

                cbuf = ffi.from_buffer(as_recv_buffer(buf).obj, require_writable=True)
            ptr, nbytes, self._keep = cbuf, len(cbuf), (cbuf, buf)
        self._eng = eng
        self.nbytes = nbytes
        self.address = int(ffi.cast("uintptr_t", ptr))
        memh = ffi.new("void *[1]")
        st = lib.ucxcomm_rma_mem_map(eng._eng, ptr, max(nbytes, 1), memh)
        if st != 0:
            raise _ucx.status_error(st, what="memory registration")
        self._memh = memh[0]
        kbuf = ffi.new("char[8192]")
        n = ffi.new("size_t[1]")
        st = lib.ucxcomm_rma_rkey_pack(eng._eng, self._memh, kbuf, 8192, n)
        if st != 0:
            lib.ucxcomm_rma_mem_unmap(eng._eng, self._memh)
            raise _ucx.status_error(st, what="rkey pack")
        packed = bytes(ffi.buffer(kbuf, n[0]))
        self.rkey = _BLOB.pack(_MAGIC, len(eng.address), len(packed)) + eng.address + packed
        self.released = False
        eng._regions.append(self)

    def release(self) -> None:
        """Unregister (peers' remote keys to it become invalid). Idempotent."""
        if self.released:
            return
        self.released = True
        eng = self._eng
        if self in eng._regions:  # (engine still open: close() releases regions first)
            eng._lib.ucxcomm_rma_mem_unmap(eng._eng, self._memh)
            eng._regions.remove(self)


_OPS = {"add": "UCXCOMM_AMO_ADD", "swap": "UCXCOMM_AMO_SWAP", "cswap": "UCXCOMM_AMO_CSWAP",
        "and": "UCXCOMM_AMO_AND", "or": "UCXCOMM_AMO_OR", "xor": "UCXCOMM_AMO_XOR"}


class RemoteMemory:
    """A peer's registered memory: ``RemoteMemory(rkey, address, nbytes)``.

    Offsets are in bytes from ``address``. Every access is checked against ``nbytes``
    before anything moves (:class:`~ucxcomm.WindowError`). ``put``/``get`` return when
    the local buffer may be reused / holds the data; ``flush`` waits until every
    operation issued to this peer is complete at the target.
    """

    def __init__(self, rkey: bytes, address: int, nbytes: int,
                 eng: RmaEngine | None = None) -> None:
        eng = eng or engine()
        rkey = bytes(rkey)
        if len(rkey) < _BLOB.size or rkey[:4] != _MAGIC:
            raise ValueError("not a ucxcomm remote key (from MemoryRegion.rkey)")
        _, alen, klen = _BLOB.unpack_from(rkey)
        if len(rkey) != _BLOB.size + alen + klen:
            raise ValueError("truncated remote key")
        peer = rkey[_BLOB.size:_BLOB.size + alen]
        packed = rkey[_BLOB.size + alen:]
        self._eng = eng
        self._ep = eng.endpoint(peer)
        out = eng._ffi.new("void *[1]")
        st = eng._lib.ucxcomm_rma_rkey_unpack(self._ep, packed, out)
        if st != 0:
            raise _ucx.status_error(st, what="rkey unpack")
        self._rkey = out[0]
        self.address, self.nbytes = int(address), int(nbytes)
        self._released = False

    def _check(self, offset: int, n: int, what: str) -> int:
        if self._released or self._eng.closed:
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
        try:
            src = ffi.from_buffer(buf)
        except (TypeError, ValueError, BufferError):
            from .._buffers import as_send_buffer

            src = ffi.from_buffer(as_send_buffer(buf).obj)
        raddr = self._check(offset, len(src), "put")
        eng = self._eng
        st = eng._lib.ucxcomm_rma_put(self._ep, src, len(src), raddr, self._rkey,
                                      eng._req_out)
        await eng.wait(eng.post(st))

    async def get(self, buf: Any, offset: int = 0) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``."""
        ffi = self._eng._ffi
        try:
            dst = ffi.from_buffer(buf, require_writable=True)
        except (TypeError, ValueError, BufferError):
            from .._buffers import as_recv_buffer

            dst = ffi.from_buffer(as_recv_buffer(buf).obj, require_writable=True)
        raddr = self._check(offset, len(dst), "get")
        eng = self._eng
        st = eng._lib.ucxcomm_rma_get(self._ep, dst, len(dst), raddr, self._rkey,
                                      eng._req_out)
        await eng.wait(eng.post(st))

    async def flush(self) -> None:
        """Complete, at the target, every operation issued to this peer."""
        eng = self._eng
        st = eng._lib.ucxcomm_rma_flush(self._ep, eng._req_out)
        await eng.wait(eng.post(st))

    async def atomic(self, op: str, value: Any, offset: int, dtype: Any = np.uint64,
                     fetch: bool = True, compare: Any = None) -> Any:
        """Remote atomic ``op`` (add, swap, cswap, and, or, xor) on a 32- or 64-bit
        integer at ``offset``; returns the previous value when ``fetch``."""
        ctype = _CTYPES.get(dtype)
        if ctype is None:
            dt = np.dtype(dtype)
            if dt not in _AMO_TYPES:
                raise TypeError(f"remote atomics work on 32/64-bit integers, not {dt}")
            ctype = _CTYPES[dtype] = _CTYPES[dt]
        cname, size, signed = ctype
        opcode = self._eng._amo.get(op)
        if opcode is None:
            raise ValueError(f"unknown atomic op {op!r}")
        if offset % size:
            raise WindowError(f"atomic at offset {offset} is not {size}-byte aligned")
        raddr = self._check(offset, size, f"atomic {op}")
        eng = self._eng
        ffi = eng._ffi
        val = ffi.new(cname, _wrap(value, size, signed))  # wraps like the hardware does
        reply = ffi.NULL
        if op == "cswap":  # UCP: the operand is the compare value, the reply buffer
            val, reply = ffi.new(cname, _wrap(compare, size, signed)), val  # brings the new
        elif fetch:                                                        # value in
            reply = ffi.new(cname)
        st = eng._lib.ucxcomm_rma_atomic(self._ep, opcode, val, reply, size, raddr,
                                         self._rkey, eng._req_out)
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

    def release(self) -> None:
        if not self._released:
            self._released = True
            if not self._eng.closed:
                self._eng._lib.ucxcomm_rma_rkey_destroy(self._rkey)
