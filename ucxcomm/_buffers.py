"""Buffer adaptation: numpy / cupy / bytes-like / DLPack objects -> one validated view."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from numpy import ndarray as _ndarray

__all__ = ["BufferSpec", "as_recv_buffer", "as_send_buffer", "host_bytes", "prefix", "scratch_like",
           "typed_flat"]

_KDLCPU = 1
_KDLCUDA = 2
_KDLCUDAHOST = 3
_KDLCUDAMANAGED = 13


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """A validated, contiguous buffer ready to hand to the transport.

    Attributes
    ----------
    obj : object
        What the transport wraps: a ``memoryview`` for host memory, or the object
        exposing ``__cuda_array_interface__`` for device memory.
    nbytes : int
        Size in bytes.
    device : bool
        True when the memory lives on a CUDA device.
    """

    obj: Any
    nbytes: int
    device: bool


def _cuda_iface_nbytes(iface: dict, what: str) -> int:
    shape = tuple(iface["shape"])
    typestr = iface["typestr"]
    itemsize = int(typestr[2:])
    strides = iface.get("strides")
    if strides is not None and math.prod(shape) > 1:
        expected = []
        acc = itemsize
        for dim in reversed(shape):
            expected.append(acc)
            acc *= dim
        c_strides = tuple(reversed(expected))
        f_strides, acc = [], itemsize
        for dim in shape:
            f_strides.append(acc)
            acc *= dim
        nontrivial = [i for i, d in enumerate(shape) if d > 1]
        ok_c = all(strides[i] == c_strides[i] for i in nontrivial)
        ok_f = all(strides[i] == f_strides[i] for i in nontrivial)
        if not (ok_c or ok_f):
            raise ValueError(f"{what}: the GPU array is not contiguous (strides {strides}); "
                             "pass a contiguous copy (cupy.ascontiguousarray)")
    if iface.get("mask") is not None:
        raise ValueError(f"{what}: masked GPU arrays are not supported")
    return math.prod(shape) * itemsize


def _from_dlpack(obj: Any, what: str) -> Any:
    device_type, _ = obj.__dlpack_device__()
    if device_type in (_KDLCPU, _KDLCUDAHOST):
        import numpy as np

        return np.from_dlpack(obj)
    if device_type in (_KDLCUDA, _KDLCUDAMANAGED):
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - depends on the machine
            from .errors import UnsupportedError

            raise UnsupportedError(
                f"{what}: a CUDA DLPack tensor needs cupy (pip install 'ucxcomm[gpu]')"
            ) from exc
        return cupy.from_dlpack(obj)
    raise TypeError(f"{what}: DLPack device type {device_type} is not supported")


def _adapt(obj: Any, *, writable: bool, what: str) -> BufferSpec:
    # Fast paths first: these are on every message's critical path.
    t = type(obj)
    if t is bytearray or (t is bytes and not writable):
        return BufferSpec(obj, len(obj), False)
    if t is _ndarray:
        flags = obj.flags
        if flags.c_contiguous and (flags.writeable or not writable):
            return BufferSpec(obj, obj.nbytes, False)
    if obj is None:
        raise TypeError(f"{what}: expected a buffer (numpy/cupy array, bytearray, "
                        "memoryview, ...), got None")
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        _, readonly = iface["data"]
        if writable and readonly:
            raise ValueError(f"{what}: the GPU receive buffer is read-only")
        nbytes = _cuda_iface_nbytes(iface, what)
        return BufferSpec(obj, nbytes, True)
    import numpy as np

    if not isinstance(obj, np.ndarray):
        try:
            obj = np.asarray(memoryview(obj))
        except TypeError:
            if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
                return _adapt(_from_dlpack(obj, what), writable=writable, what=what)
            raise TypeError(
                f"{what}: expected an object with the buffer protocol, "
                f"__cuda_array_interface__ or DLPack, got {type(obj).__name__}"
            ) from None
    if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
        raise ValueError(f"{what}: the buffer is not contiguous; pass a contiguous copy "
                         "(numpy.ascontiguousarray)")
    if writable and not obj.flags.writeable:
        raise ValueError(f"{what}: the receive buffer is read-only; pass a writable buffer")
    # A flat byte view of the same memory (no copy for C or F order).
    flat = obj.ravel(order="K").view(np.uint8)
    return BufferSpec(memoryview(flat), flat.nbytes, False)


def as_send_buffer(obj: Any) -> BufferSpec:
    """Validate ``obj`` as a send buffer (contiguous; may be read-only).

    Raises
    ------
    TypeError
        ``obj`` is not a buffer.
    ValueError
        ``obj`` is not contiguous.
    """
    return _adapt(obj, writable=False, what="send buffer")


def as_recv_buffer(obj: Any) -> BufferSpec:
    """Validate ``obj`` as a receive buffer (contiguous and writable).

    Raises
    ------
    TypeError
        ``obj`` is not a buffer.
    ValueError
        ``obj`` is not contiguous or is read-only.
    """
    return _adapt(obj, writable=True, what="receive buffer")


class _DeviceBytes:
    """A 1-D uint8 view of device memory, described by ``__cuda_array_interface__``."""

    __slots__ = ("__cuda_array_interface__", "_owner")

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3,
            "strides": None,
        }


def prefix(spec: BufferSpec, nbytes: int) -> BufferSpec:
    """The first ``nbytes`` of ``spec`` (same memory)."""
    if nbytes == spec.nbytes:
        return spec
    if spec.device:
        ptr = spec.obj.__cuda_array_interface__["data"][0]
        return BufferSpec(_DeviceBytes(ptr, nbytes, spec.obj), nbytes, True)
    return BufferSpec(host_bytes(spec)[:nbytes], nbytes, False)


def host_bytes(spec: BufferSpec) -> Any:
    """A flat, byte-indexed view of a host buffer (no copy)."""
    obj = spec.obj
    if isinstance(obj, _ndarray):
        import numpy as np

        return obj.reshape(-1).view(np.uint8)
    return memoryview(obj).cast("B")


def scratch_like(spec: BufferSpec, nbytes: int) -> BufferSpec:
    """A fresh buffer of ``nbytes`` in the same kind of memory as ``spec``."""
    if spec.device:
        import cupy

        return BufferSpec(cupy.empty(nbytes, dtype=cupy.uint8), nbytes, True)
    import numpy as np

    return BufferSpec(np.empty(nbytes, dtype=np.uint8).data, nbytes, False)


def typed_flat(obj: Any, *, writable: bool, what: str) -> Any:
    """A flat, typed, contiguous view of ``obj`` without copying: a 1-D numpy array
    for host memory, a 1-D cupy array for GPU memory (collectives need the dtype).

    Raises
    ------
    TypeError
        ``obj`` is not a buffer.
    ValueError
        ``obj`` is not contiguous, or is read-only while ``writable``.
    """
    import numpy as np

    if type(obj) is not _ndarray:
        if obj is None:
            raise TypeError(f"{what}: expected a buffer (numpy/cupy array, bytearray, "
                            "memoryview, ...), got None")
        iface = getattr(obj, "__cuda_array_interface__", None)
        if iface is not None:
            import cupy

            if writable and iface["data"][1]:
                raise ValueError(f"{what}: the GPU buffer is read-only")
            _cuda_iface_nbytes(iface, what)  # contiguity
            return cupy.asarray(obj).ravel(order="K")
        if isinstance(obj, np.ndarray):
            pass
        elif hasattr(obj, "__dlpack__") and not _has_buffer(obj):
            return typed_flat(_from_dlpack(obj, what), writable=writable, what=what)
        else:
            try:
                obj = np.asarray(memoryview(obj))
            except TypeError:
                raise TypeError(f"{what}: expected an object with the buffer protocol, "
                                f"__cuda_array_interface__ or DLPack, got "
                                f"{type(obj).__name__}") from None
    if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
        raise ValueError(f"{what}: the buffer is not contiguous; pass a contiguous copy "
                         "(numpy.ascontiguousarray)")
    if writable and not obj.flags.writeable:
        raise ValueError(f"{what}: the buffer is read-only; pass a writable buffer")
    return obj.ravel(order="K")


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True
