"""Buffers as UCX targets: ``(pointer, nbytes, keepalive, device)`` for every buffer kind.

The one adapter from a user's buffer to what UCX is handed (tag messages, RMA origins,
registrations). Validation and its error messages live in :mod:`ucxcomm._buffers`; this
module only turns the validated memory into a cffi pointer that keeps it alive.
"""

from __future__ import annotations

from typing import Any

from .._buffers import as_recv_buffer, as_send_buffer
from ..errors import UnsupportedError
from . import _ucx
from .base import Target

__all__ = ["host_target", "subtarget", "target"]


def target(obj: Any, writable: bool, cuda: bool) -> Target:
    """``obj`` as a :data:`~ucxcomm.transport.base.Target`.

    Raises
    ------
    TypeError, ValueError
        Not a buffer, not contiguous, or read-only while ``writable``.
    UnsupportedError
        GPU memory while ``cuda`` (the loaded UCX's CUDA support) is False.
    """
    ffi = _ucx.ffi
    try:  # fast path: C-contiguous host buffers (cffi checks contiguity and writability)
        ptr = ffi.from_buffer(obj, require_writable=writable)
        return ptr, len(ptr), ptr, False
    except (TypeError, ValueError, BufferError):
        spec = as_recv_buffer(obj) if writable else as_send_buffer(obj)  # clear errors
    if spec.device:
        if not cuda:
            raise UnsupportedError("a GPU buffer was given but this UCX has no CUDA support "
                                   "(install ucxcomm[gpu] on a CUDA machine)")
        ptr = ffi.cast("void *", spec.obj.__cuda_array_interface__["data"][0])
        return ptr, spec.nbytes, spec.obj, True
    ptr = ffi.from_buffer(spec.obj, require_writable=writable)
    return ptr, spec.nbytes, (ptr, spec.obj), False


def host_target(obj: Any, writable: bool, what: str) -> Target:
    """Like :func:`target` for operations that take host memory only (RMA origins).

    Raises
    ------
    UnsupportedError
        ``obj`` is GPU memory.
    """
    got = target(obj, writable, cuda=True)
    if got[3]:
        raise UnsupportedError(f"{what}: GPU origin buffers are not supported for RMA yet; "
                               "pass host memory")
    return got


def subtarget(t: Target, offset: int, nbytes: int) -> Target:
    """Bytes ``[offset, offset + nbytes)`` of ``t`` (same memory, no copy)."""
    ptr, size, keep, device = t
    if offset == 0 and nbytes == size:
        return t
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside a {size}-byte "
                         "buffer")
    return _ucx.ffi.cast("char *", ptr) + offset, nbytes, keep, device
