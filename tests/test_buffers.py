"""Buffer adaptation: kinds, contiguity, writability, DLPack, GPU-interface adaptation."""

from __future__ import annotations

import numpy as np
import pytest

from ucxcomm._buffers import as_recv_buffer, as_send_buffer


@pytest.mark.parametrize("obj, nbytes", [
    (b"abc", 3), (bytearray(10), 10), (memoryview(b"xy"), 2),
    (np.zeros(5, np.float64), 40), (np.zeros((3, 4), np.int16), 24),
    (np.zeros((3, 4), np.int16, order="F"), 24), (np.zeros(0), 0),
])
def test_send_buffers(obj, nbytes):
    spec = as_send_buffer(obj)
    assert spec.nbytes == nbytes and not spec.device


def test_fortran_receive_is_a_view():
    a = np.zeros((3, 4), order="F")
    spec = as_recv_buffer(a)
    spec.obj[:8] = np.frombuffer(np.float64(2.5).tobytes(), np.uint8)  # flat bytes
    assert a[0, 0] == 2.5


@pytest.mark.parametrize("bad, err", [
    (np.zeros((4, 4))[:, ::2], ValueError), (np.arange(5)[::-1], ValueError),
    (12, TypeError), (None, TypeError), ("text", TypeError),
])
def test_bad_send_buffers(bad, err):
    with pytest.raises(err):
        as_send_buffer(bad)


def test_read_only_receive_buffers():
    ro = np.zeros(3)
    ro.flags.writeable = False
    for bad in (b"bytes", ro, memoryview(b"x")):
        with pytest.raises(ValueError, match="read-only"):
            as_recv_buffer(bad)


class DLPackOnly:
    """Exposes memory only through DLPack (no buffer protocol)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_dlpack_host_tensor():
    src = np.arange(6, dtype=np.int32)
    spec = as_recv_buffer(DLPackOnly(src))
    assert spec.nbytes == 24
    spec.obj[:4] = 255
    assert src[0] == -1 and src[1] == 1


class FakeGpuArray:
    """A host array that *claims* to be a GPU array: exercises the adaptation code only
    (it never stands in for a GPU run)."""

    def __init__(self, shape, strides=None, readonly=False):
        self.__cuda_array_interface__ = {"data": (0x1000, readonly), "shape": shape,
                                         "typestr": "<f4", "strides": strides, "version": 3}


def test_cuda_array_interface_adaptation():
    spec = as_send_buffer(FakeGpuArray((4, 5)))
    assert spec.device and spec.nbytes == 80
    assert as_send_buffer(FakeGpuArray((4, 5), strides=(20, 4))).nbytes == 80
    assert as_send_buffer(FakeGpuArray((4, 5), strides=(4, 16))).nbytes == 80  # F order
    with pytest.raises(ValueError, match="not contiguous"):
        as_send_buffer(FakeGpuArray((4, 5), strides=(40, 4)))
    with pytest.raises(ValueError, match="read-only"):
        as_recv_buffer(FakeGpuArray((3,), readonly=True))
