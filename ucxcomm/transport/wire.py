"""Checks of the UCX objects a peer hands us, before UCX sees them.

UCX parses a worker address (``ucp_ep_create``) and a packed remote key
(``ucp_ep_rkey_unpack``) without a length and with assertions instead of errors: a
corrupted or forged one reads out of bounds, aborts the process (``addr version`` is an
``assert_always``) or maps memory the peer chose. Everything a peer sends that UCX will
parse goes through this module first. It only reads bytes (no UCX, no ucxx), so it can be
fuzzed on its own (tests/test_fuzz.py).

Worker addresses are walked in UCX's layouts (version 1, UCX's default, and version 2,
``UCX_ADDRESS_VERSION=v2``; both are described in UCX's ``src/ucp/wireup/address.c``)
with every length checked against the buffer, then compared with a *template*: an
address of our own, from the same UCX with the same configuration. For each transport
both know (by UCX's checksum of its name) the interface address must have the length
ours has, so UCX's transport code reads only bytes that are there. Entries of transports
we do not have are skipped by UCX and only need to be well formed.

Remote keys (for rank-less connections) must have exactly the layout of a key we pack
ourselves for the same kind of memory: the same memory domains with the same key sizes,
memory type and trailer; only the contents of non-empty per-domain keys (an RDMA key's
numbers) may differ.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = ["AddressEntry", "address_entries", "check_address", "check_rkey_layout",
           "rkey_layout"]

_V1, _V2 = 0, 1  # UCP_OBJECT_VERSION_V1, _V2
_HDR_UUID, _HDR_CLIENT_ID, _HDR_DEBUG, _HDR_AM_ONLY = 2, 4, 1, 8
_NULL_RESOURCE = 0xFF
_MD_EMPTY_DEV, _MD_MASK = 0x80, 0x7F
_DEV_LAST, _DEV_NUM_PATHS, _DEV_SYS_DEVICE, _DEV_LEN_MASK = 0x80, 0x40, 0x20, 0x1F
_IF_LAST, _IF_HAS_EP, _IF_LEN_MASK = 0x80, 0x40, 0x3F
_ATTR_LEN = {_V1: 16, _V2: 8}  # ucp_address_[v2_]packed_iface_attr_t (non-unified)
_MAX_MDS = 64  # UCP_MAX_MDS: a larger index overflows UCX's 64-bit memory-domain maps
_MAX_ENTRIES = 128  # UCP_MAX_RESOURCES
#: Longest worker address we accept (ours are a few hundred bytes; many RDMA ports add
#: about 40 bytes each).
MAX_ADDRESS = 1 << 16


class AddressEntry(NamedTuple):
    """One transport interface in a worker address."""

    md_index: int
    tl_csum: int  # UCX's checksum of the transport's name
    device: bytes  # the device address
    iface: bytes  # the interface address


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ValueError("truncated")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def extended(self, first: int, mask: int, version: int) -> int:
        """A value packed in ``first & mask``, continued in the next byte when it
        is ``mask`` in version 2 (UCX's 'byte extended' fields)."""
        value = first & mask
        return self.byte() if value == mask and version == _V2 else value


def address_entries(data: bytes) -> tuple[int, list[AddressEntry]]:
    """Walk a packed UCX worker address: ``(header flags, entries)``.

    Raises
    ------
    ValueError
        Not a well-formed version-1 or -2 worker address whose every field lies inside
        ``data`` (and nothing after it), or one UCX would mis-handle: an endpoint
        address inside (worker addresses have none), a memory-domain index of 64 or
        more, more than 128 interfaces, no interface at all.
    """
    data = bytes(data)
    if not 2 <= len(data) <= MAX_ADDRESS:
        raise ValueError(f"a worker address of {len(data)} bytes")
    try:
        return _walk(_Reader(data))
    except ValueError as exc:
        raise ValueError(f"malformed worker address: {exc}") from None


def _walk(r: _Reader) -> tuple[int, list[AddressEntry]]:
    head = r.byte()
    version = head & 0x0F
    if version not in (_V1, _V2):
        raise ValueError(f"unknown version {version}")
    flags = head >> 4 if version == _V1 else r.byte()
    if flags & ~(_HDR_UUID | _HDR_CLIENT_ID | _HDR_DEBUG):
        raise ValueError(f"header flags {flags:#x}")
    if flags & _HDR_UUID or version == _V1:  # (v1 always has it: UCX reads it so)
        r.take(8)
    if flags & _HDR_CLIENT_ID:
        r.take(8)
    if flags & _HDR_DEBUG:
        r.take(r.byte())
    if r.pos >= len(r.data) or r.data[r.pos] == _NULL_RESOURCE:
        raise ValueError("no transports")
    entries: list[AddressEntry] = []
    devices = 0
    while True:
        devices += 1
        if devices > _MAX_ENTRIES:
            raise ValueError("too many devices")
        first = r.byte()
        empty = bool(first & _MD_EMPTY_DEV)
        md = r.extended(first, _MD_MASK, version)
        first = r.byte()
        last_dev = bool(first & _DEV_LAST)
        dlen = r.extended(first, _DEV_LEN_MASK, version)
        if first & _DEV_NUM_PATHS:
            r.byte()
        if first & _DEV_SYS_DEVICE:
            r.byte()
        if not (empty and last_dev) and md >= _MAX_MDS:
            # (an empty last device carries the release version there instead)
            raise ValueError(f"memory domain index {md}")
        device = r.take(dlen)
        last_tl = empty
        while not last_tl:
            (csum,) = struct.unpack("<H", r.take(2))
            r.take(_ATTR_LEN[version])
            first = r.byte()
            last_tl = bool(first & _IF_LAST)
            if first & _IF_HAS_EP:
                raise ValueError("an endpoint address inside a worker address")
            iface = r.take(r.extended(first, _IF_LEN_MASK, version))
            entries.append(AddressEntry(md, csum, device, iface))
            if len(entries) > _MAX_ENTRIES:
                raise ValueError("too many interfaces")
        if last_dev:
            break
    if r.pos != len(r.data):
        raise ValueError(f"{len(r.data) - r.pos} bytes after the last device")
    if not entries:
        raise ValueError("no transports")
    return flags, entries


def check_address(peer: bytes, template: bytes, ours: tuple[bytes, ...] = (),
                  pid: int | None = None) -> bool:
    """Check a peer's worker address against ``template`` (an address of ours from the
    same UCX configuration); True when it *is* one of ``ours`` (our own addresses: a
    connection to this very process). ``pid``: this process's id; an interface that
    names it the way one of the template's does (CMA's: the process to copy to or
    from) is refused too.

    Raises
    ------
    ValueError
        Malformed (:func:`address_entries`), another header layout than ours, an
        interface address whose length differs from ours for the same transport, or an
        address that shares an interface with one of ``ours`` without being it (it
        would make UCX send to this process where the peer says it is elsewhere).
    """
    peer = bytes(peer)
    if any(peer == bytes(a) for a in ours):
        return True
    flags, entries = address_entries(peer)
    tflags, tentries = address_entries(template)
    if flags != tflags:
        raise ValueError(f"worker address header flags {flags:#x}, expected {tflags:#x}")
    lengths: dict[int, set[int]] = {}
    for e in tentries:
        lengths.setdefault(e.tl_csum, set()).add(len(e.iface))
    mine = {(e.tl_csum, e.device, e.iface) for a in ours
            for e in address_entries(a)[1] if e.iface}
    pid_tls = set() if pid is None else \
        {e.tl_csum for e in tentries if len(e.iface) >= 4 and _pid_of(e.iface) == pid}
    for e in entries:
        known = lengths.get(e.tl_csum)
        if known is not None and len(e.iface) not in known:
            raise ValueError(f"worker address: transport {e.tl_csum:#06x} has a "
                             f"{len(e.iface)}-byte interface address, expected "
                             f"{sorted(known)}")
        named = e.tl_csum in pid_tls and len(e.iface) >= 4 and _pid_of(e.iface) == pid
        if named or (e.iface and (e.tl_csum, e.device, e.iface) in mine):
            raise ValueError("worker address: an interface of this process inside "
                             "another process's address")
    return False


def _pid_of(iface: bytes) -> int:
    """The process id an interface address starts with (the top bit is a flag)."""
    return int.from_bytes(iface[:4], "little") & 0x7FFFFFFF


_RKEY_HEAD = struct.Struct("<QB")  # memory-domain map, memory type


def rkey_layout(packed: bytes) -> tuple[int, int, tuple[int, ...], bytes]:
    """``(md_map, mem_type, per-domain key sizes, trailer)`` of a packed UCX key.

    Raises
    ------
    ValueError
        A per-domain key runs past the end, or no domain at all.
    """
    packed = bytes(packed)
    if len(packed) < _RKEY_HEAD.size + 1:
        raise ValueError(f"a packed remote key of {len(packed)} bytes")
    md_map, mem_type = _RKEY_HEAD.unpack_from(packed)
    if not md_map:
        raise ValueError("a packed remote key for no memory domain")
    pos, sizes = _RKEY_HEAD.size, []
    for bit in range(64):
        if md_map >> bit & 1:
            if pos >= len(packed):
                raise ValueError("truncated packed remote key")
            size = packed[pos]
            pos += 1 + size
            if pos > len(packed):
                raise ValueError("truncated packed remote key")
            sizes.append(size)
    return md_map, mem_type, tuple(sizes), packed[pos:]


def check_rkey_layout(packed: bytes, template: bytes) -> None:
    """A peer's packed UCX key must have the layout of ``template`` (a key we packed for
    the same kind of memory on the same kind of RMA context).

    Raises
    ------
    ValueError
        Malformed, or another layout.
    """
    if rkey_layout(packed) != rkey_layout(template):
        raise ValueError("the remote key's memory domains, memory type or sizes are not "
                         "those of this UCX's keys")
