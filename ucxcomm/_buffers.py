"""Buffer adaptation: numpy / cupy / bytes-like / DLPack objects -> one validated view."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from numpy import ndarray as _ndarray

__all__ = ["BufferSpec", "as_recv_buffer", "as_send_buffer", "typed_flat"]

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
        What the transport wraps: a flat ``numpy.uint8`` view for host memory, or the
        object exposing ``__cuda_array_interface__`` for device memory.
    nbytes : int
        Size in bytes.
    device : bool
        True when the memory lives on a CUDA device.
    iface : dict or None
        Device memory: ``obj.__cuda_array_interface__`` as read for this spec (cupy
        builds the dict anew on every read).
    """

    obj: Any
    nbytes: int
    device: bool
    iface: dict | None = None


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


def _resolve(obj: Any, writable: bool, what: str) -> Any:
    """``obj`` validated as a contiguous array: a ``numpy.ndarray`` for host memory, or
    the object itself when it exposes ``__cuda_array_interface__`` (device memory).
    Bytes-like objects and DLPack tensors are wrapped without copying."""
    if type(obj) is not _ndarray:
        if obj is None:
            raise TypeError(f"{what}: expected a buffer (numpy/cupy array, bytearray, "
                            "memoryview, ...), got None")
        iface = getattr(obj, "__cuda_array_interface__", None)
        if iface is not None:
            if writable and iface["data"][1]:
                raise ValueError(f"{what}: the GPU buffer is read-only")
            _cuda_iface_nbytes(iface, what)  # contiguity
            return obj
        import numpy as np

        if not isinstance(obj, np.ndarray):
            if hasattr(obj, "__dlpack__") and not _has_buffer(obj):
                return _resolve(_from_dlpack(obj, what), writable, what)
            try:
                obj = np.asarray(memoryview(obj))
            except TypeError:
                raise TypeError(f"{what}: expected an object with the buffer protocol, "
                                f"__cuda_array_interface__ or DLPack, got "
                                f"{type(obj).__name__}") from None
    if obj.dtype.hasobject:
        raise TypeError(f"{what}: the buffer holds Python object references (dtype "
                        f"{obj.dtype}), which mean nothing in another process; send "
                        "objects with the lower-case API (comm.send/recv/bcast...), which "
                        "pickles them")
    flags = obj.flags
    if not (flags.c_contiguous or flags.f_contiguous):
        raise ValueError(f"{what}: the buffer is not contiguous; pass a contiguous copy "
                         "(numpy.ascontiguousarray)")
    if writable and not flags.writeable:
        raise ValueError(f"{what}: the buffer is read-only; pass a writable buffer")
    return obj


def _spec(arr: Any) -> BufferSpec:
    if type(arr) is _ndarray:
        import numpy as np

        flat = arr.ravel(order="K").view(np.uint8)  # same memory, C or F order
        return BufferSpec(flat, flat.nbytes, False)
    iface = arr.__cuda_array_interface__
    return BufferSpec(arr, _cuda_iface_nbytes(iface, ""), True, iface)


def as_send_buffer(obj: Any) -> BufferSpec:
    """Validate ``obj`` as a send buffer (contiguous; may be read-only).

    Raises
    ------
    TypeError
        ``obj`` is not a buffer, or holds Python object references (``dtype=object``).
    ValueError
        ``obj`` is not contiguous.
    """
    return _spec(_resolve(obj, False, "send buffer"))


def as_recv_buffer(obj: Any) -> BufferSpec:
    """Validate ``obj`` as a receive buffer (contiguous and writable).

    Raises
    ------
    TypeError
        ``obj`` is not a buffer, or holds Python object references (``dtype=object``).
    ValueError
        ``obj`` is not contiguous or is read-only.
    """
    return _spec(_resolve(obj, True, "receive buffer"))


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
    arr = _resolve(obj, writable, what)
    if type(arr) is not _ndarray:
        import cupy

        return cupy.asarray(arr).ravel(order="K")
    return arr.ravel(order="K")


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True
