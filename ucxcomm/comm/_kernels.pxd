# cython: language_level=3
"""The compiled reductions the communicator's C paths share (``_fast.pyx``'s small
collectives and ``_shm.pyx``'s engine): inline, so each module compiles them with its
own flags."""

from libc.stdint cimport uint32_t, uint64_t


cdef inline void sum_into(int kind, const char *a, const char *b, char *out,
                          Py_ssize_t nbytes) noexcept nogil:
    """``out = a + b`` element-wise with kernel ``kind`` (1: float32, 2: float64,
    3: 32-bit integers, 4: 64-bit integers; integers wrap like numpy's). ``out`` may be
    ``a``."""
    cdef Py_ssize_t i
    if kind == 1:
        for i in range(nbytes // 4):
            (<float *>out)[i] = (<const float *>a)[i] + (<const float *>b)[i]
    elif kind == 2:
        for i in range(nbytes // 8):
            (<double *>out)[i] = (<const double *>a)[i] + (<const double *>b)[i]
    elif kind == 3:
        for i in range(nbytes // 4):
            (<uint32_t *>out)[i] = (<const uint32_t *>a)[i] + (<const uint32_t *>b)[i]
    elif kind == 4:
        for i in range(nbytes // 8):
            (<uint64_t *>out)[i] = (<const uint64_t *>a)[i] + (<const uint64_t *>b)[i]
