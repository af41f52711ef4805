# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled core of the transport (Cython over the C helpers in ``csrc/``).

Everything that runs per message or per one-sided operation lives here, so that a
send, a receive or a fetch-and-op crosses from Python into compiled code once:

* :func:`target`: a buffer -> ``(address, nbytes, keepalive, device)`` (the buffer
  protocol, no copy; other kinds go through :mod:`ucxcomm._buffers`);
* :class:`TagEngine`: the table of pending tag operations of one UCX worker: posting
  sends and receives, matched-probe receives in MPI matching order, the in-place wait
  for a prompt message, and :meth:`TagEngine.poll`, which progresses UCX and completes
  every finished operation in one call (futures resolved per batch); and the split
  rendezvous of large point-to-point messages between ranks of one host (the sender
  writes a share of the receive buffer with ``process_vm_writev`` while the receiver
  reads the rest; docs/design.md, "Large messages on one host");
* the RMA engine's operations (``rma_*``): a put, get, atomic or flush posted and, when
  it finishes within the spin budget, completed in the same call;
* library facts (constants, version, library path, an endpoint's lanes).

Only :mod:`ucxcomm.transport._ucx` imports this module (after ucxx loaded libucp: the
extension links ``libucp`` by soname). The declarations below mirror ``csrc/ucxcomm_ucp.h``;
the C compiler checks them against it.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memmove

cdef extern from "<sched.h>" nogil:
    int sched_yield()
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from "ucxcomm_ucp.h" nogil:
    int UCXCOMM_INPROGRESS
    ctypedef struct ucxcomm_const_t:
        const char *name
        long value
    const ucxcomm_const_t *ucxcomm_constants(size_t *count)
    const char *ucxcomm_status_string(int status)
    const char *ucxcomm_version_string()
    const char *ucxcomm_libucp_path()
    void ucxcomm_log_quiet_push()
    unsigned ucxcomm_log_quiet_pop()
    const char *ucxcomm_log_quieted(unsigned i)
    void ucxcomm_log_drop_ucxx_ep_errors()
    unsigned long ucxcomm_log_ucxx_ep_errors()
    void ucxcomm_log_drop_lost_requests()
    unsigned long ucxcomm_log_lost_requests()
    int ucxcomm_ep_transports(uintptr_t ep, char *out, size_t outlen)
    long ucxcomm_ep_info(uintptr_t ep, char *out, size_t outlen)
    int ucxcomm_ep_catch_errors(uintptr_t ep)
    unsigned long ucxcomm_ep_failures()
    int ucxcomm_ep_failed(uintptr_t ep, int forget)

    int ucxcomm_tag_send(uintptr_t ep, const void *buf, size_t n, uint64_t tag, int fast,
                         void **req)
    int ucxcomm_tag_recv(uintptr_t worker, void *buf, size_t n, uint64_t tag,
                         uint64_t mask, void **req, uint64_t *sender_tag, size_t *length)
    int ucxcomm_tag_probe(uintptr_t worker, uint64_t tag, uint64_t mask, int remove,
                          void **msg, uint64_t *sender_tag, size_t *length)
    int ucxcomm_msg_recv(uintptr_t worker, void *buf, size_t n, void *msg, void **req,
                         uint64_t *sender_tag, size_t *length)
    int ucxcomm_test(void *req, int is_recv, uint64_t *sender_tag, size_t *length)
    unsigned ucxcomm_progress(uintptr_t worker)
    int ucxcomm_arm(uintptr_t worker)
    void ucxcomm_cancel(uintptr_t worker, void *req)
    int ucxcomm_fast_send(int fast_lanes, size_t n)

    int UCXCOMM_STATS_ROWS
    int UCXCOMM_STATS_UNCLASSIFIED
    ctypedef struct ucxcomm_tally_t:
        uint64_t messages
        uint64_t bytes
    ctypedef struct ucxcomm_peer_stats_t:
        ucxcomm_tally_t *sent
        ucxcomm_tally_t *recv
        ucxcomm_tally_t unexpected
        unsigned *rows
    ctypedef struct ucxcomm_stats_t:
        pass
    ucxcomm_stats_t *ucxcomm_stats_new()
    void ucxcomm_stats_free(ucxcomm_stats_t *s)
    int ucxcomm_stats_peer(ucxcomm_stats_t *s)
    const ucxcomm_peer_stats_t *ucxcomm_stats_get(const ucxcomm_stats_t *s, int slot)
    int ucxcomm_stats_route_ep(ucxcomm_stats_t *s, uintptr_t ep, int slot, int fast)
    int ucxcomm_stats_route_src(ucxcomm_stats_t *s, unsigned shift, uint64_t prefix,
                                int slot)
    int ucxcomm_stats_set_rows(ucxcomm_stats_t *s, int slot, int variant,
                               const size_t *first, unsigned rows)
    void ucxcomm_count_send(ucxcomm_stats_t *s, uintptr_t ep, size_t n, int variant)
    void ucxcomm_count_recv(ucxcomm_stats_t *s, uint64_t sender_tag, size_t n,
                            int unexpected, int device)

    int ucxcomm_rma_create(const char *const *keys, const char *const *values, size_t nopts,
                           double spin_s, void **out, char *err, size_t errlen)
    void ucxcomm_rma_destroy(void *eng)
    int ucxcomm_rma_address(void *eng, char *buf, size_t buflen, size_t *length)
    int ucxcomm_rma_connect(void *eng, const void *addr, uintptr_t *ep)
    void ucxcomm_rma_ep_close(void *eng, uintptr_t ep)
    int ucxcomm_rma_mem_map(void *eng, void *addr, size_t length, void **memh)
    int ucxcomm_rma_mem_alloc(void *eng, size_t length, void **memh, void **addr)
    int ucxcomm_rma_mem_unmap(void *eng, void *memh)
    int ucxcomm_rma_rkey_pack(void *eng, void *memh, char *buf, size_t buflen,
                              size_t *length)
    int ucxcomm_rma_rkey_unpack(uintptr_t ep, const void *buf, void **rkey)
    int ucxcomm_rma_rkey_ptr(void *rkey, uint64_t raddr, uintptr_t *ptr)
    void ucxcomm_rma_rkey_destroy(void *rkey)
    int ucxcomm_rma_put(void *eng, uintptr_t ep, const void *buf, size_t n, uint64_t raddr,
                        void *rkey, void **req)
    int ucxcomm_rma_get(void *eng, uintptr_t ep, void *buf, size_t n, uint64_t raddr,
                        void *rkey, void **req)
    int ucxcomm_rma_atomic(void *eng, uintptr_t ep, int op, const void *value, void *reply,
                           size_t size, uint64_t raddr, void *rkey, void **req)
    int ucxcomm_rma_flush(void *eng, uintptr_t ep, void **req)
    unsigned ucxcomm_rma_progress(void *eng)
    int ucxcomm_rma_test(void *req)
    int ucxcomm_rma_notify_fd(void *eng)
    void ucxcomm_rma_arm(void *eng)
    void ucxcomm_rma_disarm(void *eng)


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long liovcnt,
                             const iovec *remote, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(int pid, const iovec *local, unsigned long liovcnt,
                              const iovec *remote, unsigned long riovcnt, unsigned long flags)
cdef extern from "<unistd.h>" nogil:
    int getpid()
from libc.errno cimport EFAULT, EINTR, ESRCH, errno

# The split rendezvous's wire: requests (RTS) and control messages (CTS, FIN, DONE), 40
# bytes each, in this host's byte order (both ends run on one host). In CTS, ``k`` is
# the sender's share of the message: its first ``k`` bytes; in FIN, ``addr`` is nonzero
# when the sender could not write them (the receiver then reads them too).
cdef struct split_rts:
    uint32_t magic
    uint32_t world     # the sender's world rank
    uint64_t rid       # the sender's id of the message
    uint64_t addr      # the message in the sender's memory
    uint64_t length
    uint32_t pid       # the sender's process
    uint32_t check     # _rts_check of the fields above

cdef struct split_ctl:
    uint32_t magic
    uint32_t kind      # CTL_CTS, CTL_FIN, CTL_DONE
    uint64_t rid
    uint64_t addr      # CTS: the receive buffer; FIN: nonzero when the share failed
    uint64_t k         # CTS: the sender's share [0, k)
    uint32_t pid       # CTS: the receiver's process
    uint32_t world     # the writer's world rank

DEF SPLIT_SIZE = 40
cdef uint32_t RTS_MAGIC = 0x53524355  # "UCRS"
cdef uint32_t CTL_MAGIC = 0x43524355  # "UCRC"
cdef uint32_t CTL_CTS = 1
cdef uint32_t CTL_FIN = 2
cdef uint32_t CTL_DONE = 3
cdef uint32_t CTL_NACK = 4      # a posted receive got a request: rid is its tag
cdef uint32_t CTL_BLIND = 5     # the sender wrote what fitted: rid the tag, k the length
cdef int CTX_SHIFT = 44                      # ucxcomm.tags._CTX_SHIFT
cdef uint64_t SPLIT_BIT = (<uint64_t>1) << 44  # ucxcomm.tags.SPLIT_BIT
cdef uint64_t CTX_MASK = (<uint64_t>0xFFFFF) << 44
cdef uint64_t SRC_MASK = (<uint64_t>0xFFFFF) << 24
cdef uint64_t CTL_TAG = (<uint64_t>0xFFFFF) << 44  # ucxcomm.tags.CTL_CTX
#: The receiver's copy alone below this many bytes (each side's share would be small).
cdef size_t SPLIT_ALONE = 65536


cdef uint64_t CHECK_SEED = 0x27D4EB2F165667C5
cdef uint64_t CHECK_PRIME = 0x100000001B3


cdef inline uint32_t _rts_check(const split_rts *r) noexcept nogil:
    """A check word over a request's fields: a request whose bytes were overwritten in
    a posted receive's buffer (receives sharing memory) is told from a real one."""
    cdef uint64_t h = CHECK_SEED
    h = (h ^ r.world) * CHECK_PRIME
    h = (h ^ r.rid) * CHECK_PRIME
    h = (h ^ r.addr) * CHECK_PRIME
    h = (h ^ r.length) * CHECK_PRIME
    h = (h ^ r.pid) * CHECK_PRIME
    return <uint32_t>(h ^ (h >> 32))


cdef int _cma(bint write, int pid, uintptr_t local, uintptr_t remote, size_t n) noexcept nogil:
    """Copy ``n`` bytes from (``write``: to) process ``pid``'s memory at ``remote``: 0,
    or an errno."""
    cdef iovec lv, rv
    cdef ssize_t got
    while n > 0:
        lv.iov_base = <void *>local
        lv.iov_len = n
        rv.iov_base = <void *>remote
        rv.iov_len = n
        if write:
            got = process_vm_writev(pid, &lv, 1, &rv, 1, 0)
        else:
            got = process_vm_readv(pid, &lv, 1, &rv, 1, 0)
        if got < 0:
            if errno == EINTR:
                continue
            return errno
        if got == 0:
            return EFAULT
        local += <size_t>got
        remote += <size_t>got
        n -= <size_t>got
    return 0


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


INPROGRESS = UCXCOMM_INPROGRESS
#: Protocol-table rows counted per variant (``TagEngine.stat_rows``).
STAT_ROWS = UCXCOMM_STATS_ROWS
FULL_MASK = (1 << 64) - 1


cdef inline bint _fast_send(bint fast, size_t n):
    """Whether a send of ``n`` bytes asks for fast completion (``fast``: the endpoint's
    lanes are all shared memory or self; the sizes and their reasons:
    ``csrc/ucxcomm_ucp.h``)."""
    return ucxcomm_fast_send(fast, n)


# ====================================================================== library facts
def constants():
    """UCX's constants that Python needs, by name (``UCS_ERR_*``, ``UCP_ATOMIC_OP_*``)."""
    cdef size_t count = 0
    cdef const ucxcomm_const_t *table = ucxcomm_constants(&count)
    return {table[i].name.decode(): table[i].value for i in range(count)}


def status_string(int status):
    return ucxcomm_status_string(status).decode()


def version_string():
    return ucxcomm_version_string().decode()


def libucp_path():
    return ucxcomm_libucp_path().decode()


def ep_transports(uintptr_t ep):
    """``(status, "tl/dev;tl/dev;...")`` of an endpoint's lanes (``ucp_ep_query``)."""
    cdef char out[4096]
    cdef int st = ucxcomm_ep_transports(ep, out, sizeof(out))
    return st, (out.decode() if st == 0 else "")


def ep_info(uintptr_t ep):
    """UCX's description of an endpoint (``ucp_ep_print_info``: lanes and, with
    protocols v2, the protocol chosen per operation and size range), or ``""``."""
    cdef char out[32768]
    cdef long n = ucxcomm_ep_info(ep, out, sizeof(out))
    if n < 0:
        return ""
    if <size_t>n < sizeof(out):
        return out.decode("utf-8", "replace")
    cdef bytearray big = bytearray(n + 1)  # (many lanes and tables: read it again)
    n = ucxcomm_ep_info(ep, <char *>big, n + 1)
    return big[:max(n, 0)].decode("utf-8", "replace")


def ep_catch_errors(uintptr_t ep):
    """Install ucxcomm's error callback on an endpoint made without UCX error handling
    (else a transport error about the peer, such as a CMA copy from a peer that died,
    aborts the process); returns the status."""
    return ucxcomm_ep_catch_errors(ep)


def ep_failures():
    """How many endpoint failures UCX reported to that callback in this process."""
    return ucxcomm_ep_failures()


def ep_failed(uintptr_t ep, bint forget=False):
    """Whether that callback saw this endpoint fail (``forget``: when closing it)."""
    return bool(ucxcomm_ep_failed(ep, forget))


def log_quiet_push():
    """Swallow UCX's warnings and errors until :func:`log_quiet_pop`."""
    ucxcomm_log_quiet_push()


def log_drop_ucxx_ep_errors():
    """Drop ucxx's own log line about each endpoint error from now on (the endpoint's
    owner reports it); idempotent."""
    ucxcomm_log_drop_ucxx_ep_errors()


def log_ucxx_ep_errors():
    """How many of those lines were dropped."""
    return ucxcomm_log_ucxx_ep_errors()


def log_drop_lost_requests():
    """From now on drop UCX's "not returned to mpool" and "destroying inuse region"
    warnings (a peer failed: requests to it UCX cannot purge, and their registrations,
    are reported when the worker is destroyed)."""
    ucxcomm_log_drop_lost_requests()


def log_lost_requests():
    """How many such warnings were dropped."""
    return ucxcomm_log_lost_requests()


def log_quiet_pop():
    """End :func:`log_quiet_push`; returns the messages it swallowed (the first 8;
    more are counted as ``"... and N more"``)."""
    cdef unsigned n = ucxcomm_log_quiet_pop()
    cdef const char *text
    out = []
    for i in range(n):
        text = ucxcomm_log_quieted(i)
        if text == NULL:
            out.append(f"... and {n - i} more")
            break
        out.append(text.decode("utf-8", "replace"))
    return out


# ====================================================================== buffers
cdef object _ndarray = None  # numpy.ndarray, looked up on first use


cdef int get_buffer(object obj, Py_buffer *view, int flags) except -1:
    """``PyObject_GetBuffer``, refusing memory that holds Python object references (numpy
    ``dtype=object`` or structured dtypes with object fields, and memoryviews of them):
    their bytes are pointers, meaningless to (and a crash in) another process."""
    global _ndarray
    PyObject_GetBuffer(obj, view, flags)
    t = type(obj)
    if t is bytes or t is bytearray:
        return 0
    if _ndarray is None:
        import numpy
        _ndarray = numpy.ndarray
    if t is _ndarray:
        refs = obj.dtype.hasobject
    elif t is memoryview:
        refs = "O" in obj.format
    else:
        return 0
    if refs:
        PyBuffer_Release(view)
        raise TypeError("this buffer holds Python object references (numpy dtype=object "
                        "or object fields), which mean nothing in another process; send "
                        "objects with the lower-case API (comm.send/recv/bcast...), which "
                        "pickles them")
    return 0


cdef class BufRef:
    """Holds a buffer export (so the memory stays put) while UCX may use it."""


    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False


cdef object _cuda_runtime = None  # cupy.cuda.runtime, imported on first use
cdef object _NO_STREAM = object()


cdef object _runtime():
    global _cuda_runtime
    if _cuda_runtime is None:
        import cupy
        _cuda_runtime = cupy.cuda.runtime
    return _cuda_runtime


cdef _wait_for_producer(object obj, dict iface):
    """Before UCX touches GPU memory, wait (blocking this thread) until the work queued
    to produce it has run. Without this a send could read the buffer before the kernel
    writing it ran, and a receive's data could be overwritten by a fill still queued for
    it (seen on an H200: ``cupy.arange(n) + rank`` sent at once arrived stale, 3 ranks,
    every try).

    * CUDA Array Interface v3 ``stream`` (cupy names its current stream; 1 and 2 are the
      legacy and per-thread default streams, which ``cudaStreamSynchronize`` takes as
      they are): that stream. ``None``: the producer says the data is ready.
    * No ``stream`` (a v2 producer, such as torch): for a torch tensor, torch's current
      stream on its device; for anything else, the whole device.
    """
    stream = iface.get("stream", _NO_STREAM)
    if stream is None:
        return
    if stream is not _NO_STREAM:
        _runtime().streamSynchronize(stream)
    elif type(obj).__module__.startswith("torch"):
        import torch
        torch.cuda.current_stream(obj.device).synchronize()
    else:
        _runtime().deviceSynchronize()


cdef object _slow_target(object obj, bint writable, bint cuda):
    from .._buffers import as_recv_buffer, as_send_buffer
    from ..errors import UnsupportedError

    spec = as_recv_buffer(obj) if writable else as_send_buffer(obj)  # the clear errors
    if spec.device:
        if not cuda:
            raise UnsupportedError("a GPU buffer was given but this UCX has no CUDA support "
                                   "(install ucxcomm[gpu] on a CUDA machine)")
        _wait_for_producer(spec.obj, spec.iface)
        return (int(spec.iface["data"][0]), spec.nbytes, spec.obj, True)
    cdef BufRef ref = BufRef.__new__(BufRef)
    get_buffer(spec.obj, &ref.view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
    ref.held = True
    return (<uintptr_t>ref.view.buf, ref.view.len, ref, False)


def target(object obj, bint writable, bint cuda):
    """``obj`` as ``(address, nbytes, keepalive, device)``.

    C-contiguous host buffers take the buffer protocol directly; anything else (F order,
    GPU arrays, DLPack tensors, bad input) goes through :mod:`ucxcomm._buffers`, which
    raises the clear ``TypeError``/``ValueError``; GPU memory without CUDA support raises
    :class:`~ucxcomm.UnsupportedError`.
    """
    cdef BufRef ref = BufRef.__new__(BufRef)
    try:
        get_buffer(obj, &ref.view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
    except (TypeError, ValueError, BufferError):
        return _slow_target(obj, writable, cuda)
    ref.held = True
    return (<uintptr_t>ref.view.buf, ref.view.len, ref, False)


def subtarget(tuple t, Py_ssize_t offset, Py_ssize_t nbytes):
    """Bytes ``[offset, offset + nbytes)`` of target ``t`` (same memory, no copy)."""
    cdef Py_ssize_t size = t[1]
    if offset == 0 and nbytes == size:
        return t
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside a {size}-byte "
                         "buffer")
    return (<uintptr_t>t[0] + <uintptr_t>offset, nbytes, t[2], t[3])


# ====================================================================== tag engine
cdef class Op:
    """One pending tag operation."""


    cdef void mark_settled(self):
        self.done = True
        if self.settled is not None and not self.settled.done():
            self.settled.set_result(None)


cdef class Finish:
    """A receive's ``finish`` whose result the engine gets at C level when the message
    fitted (:meth:`fitted`, declared in ``_ucp.pxd``): a caller's compiled subclass
    builds it without a Python call (the communicator's ``Status`` per buffer receive).
    Calling the object maps any ``(sender_tag, nbytes, capacity)``, overflows included;
    a plain callable works too, it is then always called."""

    cdef object fitted(self, uint64_t stag, size_t nbytes, size_t cap):
        return self((stag, nbytes, cap))

    def __call__(self, result):
        raise NotImplementedError("a Finish subclass maps the receive's result")


cdef inline object _fitted(object finish, uint64_t stag, size_t nbytes, size_t cap):
    """``finish((stag, nbytes, cap))`` of a receive whose message fitted."""
    if isinstance(finish, Finish):
        return (<Finish>finish).fitted(stag, nbytes, cap)
    return finish((stag, nbytes, cap))


cdef Op ptr_op(uintptr_t ptr, size_t cap, object keep, bint device, uint64_t tag,
                uint64_t mask, object peers):
    """A receive of the message matching ``(tag, mask)`` into ``cap`` bytes at ``ptr``
    (``keep`` holds them)."""
    cdef Op op = Op.__new__(Op)
    op.peers = peers
    op.tag = tag
    op.mask = mask
    op.ptr = ptr
    op.cap = cap
    op.keep = keep
    op.device = device
    op.has_ptr = True
    return op


cdef Op _view_op(Py_buffer *view, uint64_t tag, uint64_t mask, object peers):
    """:func:`ptr_op` into exported host buffer ``view`` (the Op's BufRef takes the
    export over)."""
    cdef BufRef ref = BufRef.__new__(BufRef)
    ref.view = view[0]
    ref.held = True
    return ptr_op(<uintptr_t>ref.view.buf, <size_t>ref.view.len, ref, False, tag, mask,
                   peers)


cdef Op _target_op(tuple t, uint64_t tag, uint64_t mask, object peers):
    """:func:`ptr_op` into target ``t``."""
    return ptr_op(<uintptr_t>t[0], <size_t>t[1], t[2], t[3], tag, mask, peers)


def _retrieve(fut):
    """Mark a control message's failure retrieved (the operation it serves reports)."""
    if not fut.cancelled():
        fut.exception()


cdef class _Held:
    """A message a probe took out of UCX's queue (see ``TagEngine._hold_through``): its
    UCX handle, or a split request's payload."""
    cdef void *msg
    cdef uint64_t stag
    cdef size_t nbytes
    cdef bytes rts


cdef class TagEngine:
    """The pending tag operations of one UCX worker (see the module docstring).

    Held by :class:`ucxcomm.transport.worker.Worker`, which calls :meth:`_engine_setup`
    once its UCX worker exists and offers the public methods as its own (bound onto
    each instance). Their types: ``_ucp.pyi``. The semantics are the ones
    docs/design.md describes (matched probes in posting order, truncation into scratch
    memory, withdrawal of unmatched receives, failure of operations on dead peers after a
    grace period).
    """


    def __cinit__(self):
        self._stats = ucxcomm_stats_new()
        if self._stats == NULL:
            raise MemoryError("no memory for the traffic counters")
        self._stat_slots = {}

    def __dealloc__(self):
        ucxcomm_stats_free(<ucxcomm_stats_t *>self._stats)
        self._stats = NULL

    def _engine_setup(self, uintptr_t worker_handle, loop, ready, double spin_s, bint cuda,
                      status_error, others_ready=None, bint spin_yield=True):
        self._wh = worker_handle
        self._reqs = []
        self._probes = []
        self._held = []
        self._rv_send = {}
        self._routes = {}
        self._rv_recv = {}
        self._rv_blind = {}
        self._graveyard = []
        self._dead = {}
        import asyncio
        if type(loop).create_future is asyncio.BaseEventLoop.create_future:
            # The same future, without the Python frame of BaseEventLoop.create_future
            # (one per operation).
            import functools
            self._create_future = functools.partial(asyncio.Future, loop=loop)
        else:  # a loop with its own futures (uvloop...)
            self._create_future = loop.create_future
        self._ready = ready
        self._others_ready = others_ready
        self._spin_s = spin_s
        self._yield = spin_yield
        self._cuda = cuda
        self._status_error = status_error
        consts = constants()
        self._canceled = consts["UCS_ERR_CANCELED"]
        self._truncated = consts["UCS_ERR_MESSAGE_TRUNCATED"]
        import time
        self._monotonic = time.monotonic

    # ------------------------------------------------------------ checks
    cdef int c_check(self, object peers) except -1:
        if self._closed:
            from ..errors import ClosedError
            raise ClosedError("the worker is closed")
        if self._dead:
            err = self._dead_error(peers)
            if err is not None:
                raise err
        return 0

    cdef object _dead_error(self, object peers):
        if not self._dead or peers is None:
            return None
        now = self._monotonic()
        for p in peers:
            entry = self._dead.get(p)
            if entry is not None and now >= entry[0]:
                return entry[1]
        return None

    cdef object _error(self, int st, object peers, str what):
        peer = next(iter(peers)) if peers and len(peers) == 1 else None
        return self._status_error(st, peer, what)

    # ------------------------------------------------------------ buffers
    def send_ptr(self, obj):
        """``(address, nbytes, keepalive, device)`` of a send buffer, validated.

        Raises
        ------
        TypeError, ValueError
            Not a buffer / not contiguous. UnsupportedError: GPU memory without CUDA.
        """
        return target(obj, False, self._cuda)

    def recv_ptr(self, obj):
        """Like :meth:`send_ptr` for a receive buffer (must also be writable)."""
        return target(obj, True, self._cuda)

    def subtarget(self, tuple t, Py_ssize_t offset, Py_ssize_t nbytes):
        """Bytes ``[offset, offset + nbytes)`` of a target (same memory, no copy)."""
        return subtarget(t, offset, nbytes)

    # ------------------------------------------------------------ sends
    def send(self, uintptr_t ep, object obj, uint64_t tag, object peers, bint fast=False):
        """Post a tag send of buffer ``obj``; ``None`` if it completed at once (nothing
        allocated), else a future. ``fast`` asks for UCX's fast-completion protocols
        below 256 KiB (a win on shared memory, a loss on TCP: the endpoint decides);
        sends up to ``FAST_SMALL_MAX`` bytes ask for them on every endpoint."""
        return self.c_send(ep, obj, tag, peers, fast)

    cdef object c_send(self, uintptr_t ep, object obj, uint64_t tag, object peers,
                       bint fast):
        cdef Py_buffer view
        self.c_check(peers)
        try:
            get_buffer(obj, &view, PyBUF_SIMPLE)
        except (TypeError, ValueError, BufferError):
            return self.send_raw(ep, target(obj, False, self._cuda), tag, peers, fast)
        return self._send_view(ep, &view, tag, peers, fast)

    cdef object c_send_ep(self, EpSend s, object obj, uint64_t tag):
        """:meth:`c_send` on endpoint ``s``: a point-to-point message of ``_split_min``
        bytes or more to a peer on this host takes the split rendezvous."""
        cdef Py_buffer view
        if not s.split or ((tag >> CTX_SHIFT) & 3) != 0:  # (KIND_P2P only)
            return self.c_send(s.handle, obj, tag, s.peers, s.fast)
        self.c_check(s.peers)
        try:
            get_buffer(obj, &view, PyBUF_SIMPLE)
        except (TypeError, ValueError, BufferError):
            return self.send_raw(s.handle, target(obj, False, self._cuda), tag, s.peers,
                                 s.fast)
        if <size_t>view.len >= self._split_min and self._split_min > 0:
            return self._send_split(s, &view, tag)
        return self._send_view(s.handle, &view, tag, s.peers, s.fast)

    cdef object _send_view(self, uintptr_t ep, Py_buffer *pview, uint64_t tag, object peers,
                           bint fast):
        """Post the send of exported buffer ``pview`` (released here, or held by the Op)."""
        cdef Py_buffer view = pview[0]
        cdef void *req = NULL
        cdef int st
        cdef Op op
        cdef bint fcmpl = _fast_send(fast, view.len)
        st = ucxcomm_tag_send(ep, view.buf, view.len, tag, fcmpl, &req)
        if st >= 0:
            ucxcomm_count_send(<ucxcomm_stats_t *>self._stats, ep, view.len, fcmpl)
        if st == 0:
            PyBuffer_Release(&view)
            return None
        if st < 0:
            PyBuffer_Release(&view)
            raise self._error(st, peers, "send")
        cdef BufRef ref = BufRef.__new__(BufRef)
        ref.view = view  # ownership moves to the op
        ref.held = True
        op = Op.__new__(Op)
        op.future = self._create_future()
        op.peers = peers
        op.req = req
        op.keep = ref
        op.tag = tag
        self._reqs.append(op)
        return op.future

    def send_raw(self, uintptr_t ep, tuple t, uint64_t tag, object peers, bint fast=False):
        """Like :meth:`send` for a target from :meth:`send_ptr`."""
        cdef void *req = NULL
        cdef size_t n = t[1]
        self.c_check(peers)
        cdef bint fcmpl = _fast_send(fast, n)
        cdef int st = ucxcomm_tag_send(ep, <const void *><uintptr_t>t[0], n, tag, fcmpl,
                                       &req)
        if st >= 0:  # (device memory: UCX's host-memory table does not apply)
            ucxcomm_count_send(<ucxcomm_stats_t *>self._stats, ep, n,
                               -1 if t[3] else fcmpl)
        return self._polled_op(st, req, t[2], peers, "send", False, tag)

    cdef object _polled_op(self, int st, void *req, object keep, object peers, str what,
                           bint is_recv, uint64_t tag):
        """The outcome of a posted send/receive that needs no matching: None when it
        completed at once, the error, or a future for the request (polled with
        ucp_request_check_status; ``keep`` holds its buffer until then)."""
        if st == 0:
            return None
        if st < 0:
            raise self._error(st, peers, what)
        cdef Op op = Op.__new__(Op)
        op.future = self._create_future()
        op.peers = peers
        op.req = req
        op.keep = keep
        op.is_recv = is_recv
        op.tag = tag
        self._reqs.append(op)
        return op.future

    # ------------------------------------------------------------ receives
    def tag_recv(self, tuple t, uint64_t tag, uint64_t mask=FULL_MASK, object peers=None):
        """A posted receive with a tag mask into target ``t``; ``None`` when it completed
        at once. Sender and size are not reported."""
        cdef void *req = NULL
        cdef uint64_t stag = 0
        cdef size_t length = 0
        self.c_check(None)
        cdef int st = ucxcomm_tag_recv(self._wh, <void *><uintptr_t>t[0], <size_t>t[1], tag,
                                       mask, &req, &stag, &length)
        if st == 0:  # (matched a message that was already here; later: _poll_reqs)
            ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, stag, length, 1, t[3])
        return self._polled_op(st, req, t[2], peers, "receive", True, tag)

    def probe(self, uint64_t tag, uint64_t mask):
        """Non-destructive probe: ``(sender_tag, nbytes)`` of the first match, or None."""
        cdef void *msg = NULL
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef _Held h
        cdef int i
        self.c_check(None)
        ucxcomm_progress(self._wh)
        if self._held:
            i = self._held_find(tag, mask)
            if i >= 0:
                h = self._held[i]
                return h.stag & ~SPLIT_BIT, h.nbytes
        if not ucxcomm_tag_probe(self._wh, tag, mask, 0, &msg, &stag, &length):
            return None
        if self._split_rx and stag & SPLIT_BIT:
            h = self._hold_through(tag, mask, stag)
            if h is None:
                return None
            return h.stag & ~SPLIT_BIT, h.nbytes
        return stag, length

    def probe_wait(self, uint64_t tag, uint64_t mask, object peers):
        """Resolve to ``(sender_tag, nbytes)`` once a matching message is there (not
        consumed)."""
        self.c_check(None)
        cdef Op op = Op.__new__(Op)
        op.future = self._create_future()
        op.peers = peers
        op.tag = tag
        op.mask = mask
        op.peek = True
        self._probes.append(op)
        return op.future

    def recv_into(self, tuple t, uint64_t tag, uint64_t mask, object peers,
                  object finish=None, bint spin=False, bint post=False):
        """Matched-probe receive of the first message matching ``(tag, mask)`` into
        target ``t`` (from :meth:`recv_ptr`).

        Returns ``(sender_tag, nbytes, capacity)`` when the message was already there
        (or arrived while ``spin`` waited in place) and is fully received, else a future
        resolving to the same (mapped by ``finish`` if given). ``nbytes > capacity``: the
        message was consumed and the buffer holds its first ``capacity`` bytes, except
        with ``post``: a receive that must wait and that no earlier receive overlaps is
        posted to UCX (matched on arrival, straight into the buffer), and a message that
        outgrows it is consumed without writing the buffer.
        """
        self.c_check(None)
        cdef Op op = _target_op(t, tag, mask, peers)
        op.finish = finish
        op.posted = post  # (a request: set again when it is posted to UCX)
        return self.c_post_match(op, spin)

    def recv_posted(self, tuple t, uint64_t tag, uint64_t mask, object peers):
        """A receive posted straight to UCX into target ``t``, never probed: UCX takes
        the first message matching ``(tag, mask)``, from its unexpected queue or on
        arrival. ``(sender_tag, nbytes, capacity)`` when it finished at once, else a
        future of the same. A message larger than the buffer is consumed without being
        written anywhere and without memory of its size (``nbytes > capacity``), so a
        peer's oversized message costs nothing. Only for tags that no matched-probe
        receive (:meth:`recv_into`, :meth:`recv_alloc`) waits on at the same time:
        those would lose their place in the matching order."""
        self.c_check(None)
        return self._post_to_ucx(_target_op(t, tag, mask, peers))

    def irecv(self, object obj, uint64_t tag, uint64_t mask, object peers, object finish,
              bint spin=False, bint post=True):
        """``Comm.Irecv``'s (and ``Recv``'s) one crossing: :meth:`recv_into` of buffer
        ``obj`` (validated here, as :meth:`recv_ptr` does) with ``post`` and ``spin``.
        Returns ``finish(result)`` when the message was there (or arrived while ``spin``
        waited) and fitted (at C level when ``finish`` is a :class:`Finish`),
        ``(sender_tag, nbytes, capacity)`` when it outgrew ``obj`` (consumed, the prefix
        written), else a future resolving to ``finish(result)``.

        A message already here that fits and is received at once costs no Op, no held
        buffer object and no future: only the result."""
        return self.c_irecv(obj, tag, mask, peers, finish, spin, post)

    cdef object c_irecv(self, object obj, uint64_t tag, uint64_t mask, object peers,
                        object finish, bint spin, bint post):
        cdef Py_buffer view
        cdef void *msg = NULL
        cdef void *req = NULL
        cdef uint64_t stag = 0
        cdef size_t nbytes = 0
        cdef int st = 0
        cdef bint found = False
        cdef Op op
        self.c_check(None)
        try:
            get_buffer(obj, &view, PyBUF_WRITABLE)
        except (TypeError, ValueError, BufferError):
            op = _target_op(_slow_target(obj, True, self._cuda), tag, mask, peers)
            op.finish = finish
            op.posted = post
            return self._irecv_result(self.c_post_match(op, spin), op)
        cdef bint free = (not self._probes or not self._overlaps(tag, mask)) and not self._held
        if free:
            found = self._probe_fresh(tag, mask, &msg, &stag, &nbytes)
            if (found and nbytes <= <size_t>view.len
                    and not (stag & SPLIT_BIT and self._split_rx)):
                st = ucxcomm_msg_recv(self._wh, view.buf, nbytes, msg, &req, &stag, &nbytes)
                if st >= 0:
                    ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, stag, nbytes, 1, 0)
                if st == 0:
                    cap = view.len
                    PyBuffer_Release(&view)
                    return _fitted(finish, stag, nbytes, cap)
        try:
            op = _view_op(&view, tag, mask, peers)  # (the Op holds the buffer now)
        except BaseException:
            PyBuffer_Release(&view)
            raise
        op.finish = finish
        op.posted = post
        if found:
            if st == 0:  # too large (the prefix through scratch memory), or a split request
                self._recv_msg(op, msg, stag, nbytes, True)
            else:  # started above, and counted (or failed)
                op.sender_tag = stag
                op.length = nbytes
                self._started(op, st, req)
            return self._irecv_result(self._matched(op), op)
        if not free and self._held:
            return self._irecv_result(self.c_post_match(op, spin), op)
        if spin and free and not self._probes and self._spin_match(op):
            return self._irecv_result(self._matched(op), op)
        return self._irecv_result(self._wait_op(op, free), op)

    cdef object _irecv_result(self, object res, Op op):
        if type(res) is tuple and op.length <= op.cap:
            return _fitted(op.finish, op.sender_tag, op.length, op.cap)
        return res

    def recv_alloc(self, uint64_t tag, uint64_t mask, object peers, bint spin=False):
        """Matched-probe receive into new memory of the message's size (a ``bytearray``
        below 64 KiB, else a ``numpy.uint8`` array): ``(sender_tag, nbytes, buffer)``."""
        self.c_check(None)
        cdef Op op = Op.__new__(Op)
        op.peers = peers
        op.tag = tag
        op.mask = mask
        op.alloc = True
        return self.c_post_match(op, spin)

    def ep_send(self, uintptr_t handle, peers, bint fast):
        """An :class:`EpSend` for the endpoint with UCX handle ``handle``."""
        return EpSend(self, handle, peers, fast)

    cdef tuple c_exchange(self, uintptr_t ep, uintptr_t ptr, size_t n, object keep,
                          uint64_t stag, object speers, bint fast, Op op):
        """One exchange with one peer in a single call: post the send of ``n`` bytes at
        ``ptr`` (tag ``stag``), then the matched-probe receive ``op`` (prepared by the
        caller), waiting for it in place: ``(send future or None, receive result or
        future)``. Two-rank collectives are one exchange each."""
        sent = self.c_send_to(ep, ptr, n, keep, stag, speers, fast)
        return sent, self.c_post_match(op, True)

    cdef object c_send_to(self, uintptr_t ep, uintptr_t ptr, size_t n, object keep,
                          uint64_t stag, object speers, bint fast):
        """Send ``n`` bytes at ``ptr`` (``keep`` holds them) tagged ``stag``: None when it
        completed at once, else its future."""
        cdef void *req = NULL
        self.c_check(speers)
        cdef bint fcmpl = _fast_send(fast, n)
        cdef int rc = ucxcomm_tag_send(ep, <const void *>ptr, n, stag, fcmpl, &req)
        if rc >= 0:
            ucxcomm_count_send(<ucxcomm_stats_t *>self._stats, ep, n, fcmpl)
        return self._polled_op(rc, req, keep, speers, "send", False, stag)

    cdef object c_post_match(self, Op op, bint spin):
        # Only receives that could match the same message must keep their order; with no
        # earlier one pending, probe now (a message already here keeps the truncation
        # prefix), else post it to UCX (which then matches it on arrival, straight into
        # the buffer: no copy out of the unexpected queue, no probing per poll).
        cdef bint free = not self._probes or not self._overlaps(op.tag, op.mask)
        if free and (self._try_match(op, True)
                     or (spin and not self._probes and self._spin_match(op))):
            return self._matched(op)
        if free and op.posted:
            # A message that reached the worker but was not progressed yet is matched
            # here too: a window of Irecvs behind the sender's Isends then finishes at
            # the call, without a future each (1 KiB x 64 window: 0 -> ~60 of 64 found).
            # (Progress resolves no future: pending receives keep their order.)
            # (Such a message counts as unexpected: it arrived before the receive.)
            if self._progress_once() and self._try_match(op, True):
                return self._matched(op)
        return self._wait_op(op, free)

    cdef bint _probe_fresh(self, uint64_t tag, uint64_t mask, void **msg, uint64_t *stag,
                           size_t *nbytes) except -1:
        """Take the first message matching ``(tag, mask)`` out of UCX's unexpected
        queue, progressing the worker once if none is there (see :meth:`c_post_match`)."""
        if ucxcomm_tag_probe(self._wh, tag, mask, 1, msg, stag, nbytes):
            return True
        return bool(self._progress_once()
                    and ucxcomm_tag_probe(self._wh, tag, mask, 1, msg, stag, nbytes))

    cdef bint _progress_once(self) except -1:
        """Progress the worker once from a call; what that finished of the pending
        operations is completed too (their futures resolved): the progress task may be
        asleep on the worker's descriptor, whose events this call has just consumed.
        True when UCX did anything."""
        if not ucxcomm_progress(self._wh):
            return False
        if self._reqs:
            self._poll_reqs()
        return True

    cdef object _wait_op(self, Op op, bint free):
        """A receive with no message yet: posted to UCX when ``free`` (no earlier pending
        receive overlaps it) and allowed, else queued behind the pending ones."""
        if free and op.posted and (not self._split_rx or (
                not op.device and op.cap < self._split_post_max)):
            # Where split requests may come, only host receives too small for a split
            # message are posted (a request that reaches one is not read from its
            # buffer, which other receives may share: _rts_blind); the others are
            # probed, so a request is read from UCX's queue.
            return self._post_to_ucx(op)
        op.posted = False
        op.future = self._create_future()
        self._probes.append(op)
        return op.future

    cdef object _matched(self, Op op):
        """A receive that matched its message at the call: its result when it finished
        there, else its future (the receive of a message still arriving)."""
        if op.req == NULL:  # completed on the spot
            if op.future is not None:  # completed with an error
                return op.future
            return self._result(op)
        op.future = self._create_future()
        self._reqs.append(op)
        return op.future

    cdef bint _overlaps(self, uint64_t tag, uint64_t mask) except -1:
        """Whether a pending matched-probe receive could match a message that
        ``(tag, mask)`` matches (it must then go first)."""
        cdef Op p
        for p in self._probes:
            if ((p.tag ^ tag) & p.mask & mask) == 0:
                return True
        return False

    cdef object _post_to_ucx(self, Op op):
        """Post ``op``'s receive to UCX (no earlier receive overlaps it)."""
        cdef void *req = NULL
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef int st = ucxcomm_tag_recv(self._wh, <void *>op.ptr, op.cap, op.tag, op.mask,
                                       &req, &stag, &length)
        op.is_recv = True
        op.posted = True
        if st == UCXCOMM_INPROGRESS:
            op.req = req
            op.future = self._create_future()
            self._reqs.append(op)
            return op.future
        self._finish_posted(op, st, stag, length, True)
        if op.future is not None:  # completed with an error
            return op.future
        return self._result(op)

    cdef void _finish_posted(self, Op op, int st, uint64_t stag, size_t length,
                             bint early) except *:
        # A posted receive's outcome: UCX reports an overflow as an error (the message
        # is consumed, the buffer not written); ucxcomm reports it as a result whose
        # length exceeds the capacity (TruncationError, like a matched probe's).
        # ``early``: it finished when posted (its message was already here).
        if (st >= 0 or st == self._truncated) and self._split_rx and stag & SPLIT_BIT:
            self._rts_blind(op, stag, early)  # (the UCX request is finished)
            return
        if st >= 0 or st == self._truncated:
            op.sender_tag = stag
            op.length = length if st >= 0 or length > op.cap else op.cap + 1
            st = 0
            ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, stag, op.length, early,
                               op.device)
        self._complete(op, st)

    cdef bint _spin_match(self, Op op) except -1:
        """Wait for ``op``'s message right here while the event loop has nothing else
        to run, at most the spin time (the policy of ucxcomm.transport.progress; only
        called when no earlier receive is pending, so matching order is kept)."""
        ready = self._ready
        if self._spin_s <= 0 or self._closed or ready is None or self._others(ready):
            return False
        cdef double end = _now() + self._spin_s
        cdef Py_ssize_t seen = len(ready), n
        while _now() < end:
            n = len(ready)
            if n != seen:  # (only the policy's own wake-ups were there before)
                if self._others(ready):
                    break
                seen = n
            ucxcomm_progress(self._wh)
            if self._try_match(op, False):
                return True
            if self._reqs:
                self._poll_reqs()  # others' requests complete meanwhile
            # More ranks than cores: the rank we wait for may be waiting for this core.
            # Without this, 8 B Allreduce at 4 ranks on 2 cores took 200-320 us (the
            # spinner held the core until the scheduler's tick); with it 7.6 us. With a
            # core each it only costs the call (~0.17 us here: 8 B latency 1.36 -> 1.50
            # us), so it is on only then (Worker: UCXCOMM_SPIN_YIELD).
            if self._yield:
                sched_yield()
        return False

    cdef bint _others(self, object ready) except -1:
        """Whether a callback other than the progress policy's own wake-ups is ready
        (Progress.others_ready: those are no reason to stop spinning)."""
        if not len(ready):
            return False
        if self._others_ready is None:
            return True
        return bool(self._others_ready())

    cdef object _result(self, Op op):
        if op.alloc:
            return (op.sender_tag, op.length, op.buffer)
        return (op.sender_tag, op.length, op.cap)

    cdef bint _try_match(self, Op op, bint early) except -1:
        """Probe for ``op``; on a match start (or finish) its receive. True if matched.
        ``early``: a match is a message that was there before the receive."""
        cdef void *msg = NULL
        cdef uint64_t stag = 0
        cdef size_t nbytes = 0
        cdef _Held h = None
        cdef int i
        if self._held:
            i = self._held_find(op.tag, op.mask)
            if i >= 0:
                h = self._held[i]
                if not op.peek:
                    del self._held[i]
        if h is None:
            if not ucxcomm_tag_probe(self._wh, op.tag, op.mask, 0 if op.peek else 1, &msg,
                                     &stag, &nbytes):
                return False
            if op.peek and self._split_rx and stag & SPLIT_BIT:
                h = self._hold_through(op.tag, op.mask, stag)
                if h is None:
                    return False
        if op.peek:
            if h is not None:
                stag, nbytes = h.stag & ~SPLIT_BIT, h.nbytes
            op.done = True
            if not op.future.done():
                op.future.set_result((stag, nbytes))
            return True
        if h is not None:
            if h.rts is not None:
                self._rts_start(op, h.stag, <const char *>h.rts, True)
            else:
                self._recv_msg(op, h.msg, h.stag, h.nbytes, True)
            return True
        self._recv_msg(op, msg, stag, nbytes, early)
        return True

    cdef int _recv_msg(self, Op op, void *msg, uint64_t stag, size_t nbytes,
                       bint early) except -1:
        """Start (or finish) ``op``'s receive of probed message ``msg`` (counted here,
        as ``early``: unexpected)."""
        cdef void *req = NULL
        cdef uintptr_t ptr
        cdef int st
        cdef BufRef ref
        cdef char wire[SPLIT_SIZE]
        if self._split_rx and stag & SPLIT_BIT:
            if self._rts_take(msg, stag, nbytes, wire) < 0:
                self._rv_fail(op, RuntimeError(
                    f"a malformed split rendezvous request ({nbytes} bytes) matched"))
                return 0
            self._rts_start(op, stag, wire, early)
            return 0
        op.sender_tag = stag
        op.length = nbytes
        ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, stag, nbytes, early, op.device)
        if op.alloc:
            # Small: a bytearray is the cheapest allocation; large: numpy skips zeroing.
            if nbytes < 65536:
                arr = bytearray(nbytes)
            else:
                import numpy
                arr = numpy.empty(nbytes, dtype=numpy.uint8)
            ref = BufRef.__new__(BufRef)
            PyObject_GetBuffer(arr, &ref.view, PyBUF_WRITABLE)
            ref.held = True
            op.buffer = arr
            op.keep = ref
            ptr = <uintptr_t>ref.view.buf
        elif nbytes <= op.cap:
            ptr = op.ptr
        else:  # too large: take it whole into scratch memory, keep the prefix
            if op.device:
                import cupy
                arr = cupy.empty(nbytes, dtype=cupy.uint8)
                # (its block may come back from kernels still queued on the stream)
                cupy.cuda.get_current_stream().synchronize()
                ptr = <uintptr_t>arr.data.ptr
            else:
                import numpy
                arr = numpy.empty(nbytes, dtype=numpy.uint8)
                ptr = <uintptr_t>arr.ctypes.data
            op.scratch = (arr, ptr)
        st = ucxcomm_msg_recv(self._wh, <void *>ptr, nbytes, msg, &req, &stag, &nbytes)
        self._started(op, st, req)
        return 0

    cdef int _started(self, Op op, int st, void *req) except -1:
        """``op``'s message receive was posted with status ``st`` (request ``req``)."""
        op.is_recv = True
        if st == UCXCOMM_INPROGRESS:
            op.req = req
        else:
            self._complete(op, st)
        return 0

    cdef void _complete(self, Op op, int status) except *:
        op.req = NULL
        op.mark_settled()
        if status >= 0 and op.scratch is not None:
            self._copy_prefix(op)
        fut = op.future
        if fut is None:  # finished on the spot, before a future existed
            if status < 0:
                op.future = fut = self._create_future()
                fut.set_exception(self._error(status, op.peers, "receive"))
            return
        if fut.done():
            return
        if status == self._canceled:
            # Withdrawn by cancel() (its awaiter was cancelled, or Request.cancel()):
            # cancelled, not failed. An exception here was never retrieved (issue 15:
            # 'Future exception was never retrieved ... operation canceled' at Ctrl-C).
            fut.cancel()
        elif status < 0:
            fut.set_exception(self._error(status, op.peers, "operation"))
        elif op.alloc or op.has_ptr:
            if isinstance(op.finish, Finish) and not op.alloc and op.length <= op.cap:
                try:
                    result = (<Finish>op.finish).fitted(op.sender_tag, op.length, op.cap)
                except Exception as exc:
                    fut.set_exception(exc)
                    return
                fut.set_result(result)
                return
            result = self._result(op)
            if op.finish is not None:
                try:
                    result = op.finish(result)
                except Exception as exc:
                    fut.set_exception(exc)
                    return
            fut.set_result(result)
        else:
            fut.set_result(None)

    cdef void _copy_prefix(self, Op op) except *:
        arr, src = op.scratch
        cdef uintptr_t s = src
        if op.device:
            rt = _runtime()
            rt.memcpy(op.ptr, s, op.cap, 4)  # cudaMemcpyDefault (device to device:
            rt.deviceSynchronize()  # asynchronous) done before the scratch goes back
        else:
            memmove(<void *>op.ptr, <void *>s, op.cap)
        op.scratch = None

    # ------------------------------------------------------------ control
    def cancel(self, fut):
        """Withdraw the receive behind ``fut`` if it has not matched a message yet.

        Returns True when nothing was (or will be) received for it. An operation that
        already matched (or any send) keeps running so that the message moves whole;
        await ``settle`` to know when UCX no longer touches its buffer.
        """
        cdef Op op
        cdef Py_ssize_t i
        for i in range(len(self._probes)):
            op = self._probes[i]
            if op.future is fut:
                del self._probes[i]
                op.mark_settled()
                if not fut.done():
                    fut.cancel()
                return True
        cdef int st
        cdef uint64_t stag = 0
        cdef size_t length = 0
        for op in self._reqs:
            if op.future is fut and op.posted and op.req != NULL:
                # UCP withdraws an unmatched posted receive at once; a matched one
                # (data still moving) finishes normally.
                ucxcomm_cancel(self._wh, op.req)
                st = ucxcomm_test(op.req, 1, &stag, &length)
                if st == UCXCOMM_INPROGRESS:
                    return False
                self._finish_posted(op, st, stag, length, False)
                return st == self._canceled
            if (op.future is fut and op.is_recv and not op.has_ptr and not op.alloc
                    and op.req != NULL):
                # A posted receive: UCP removes it if unmatched (it then completes with
                # UCS_ERR_CANCELED); if matched, it completes normally.
                ucxcomm_cancel(self._wh, op.req)
                return False
        return False

    def settled_future(self, fut):
        """A future that resolves once the UCP request behind ``fut`` has finished, or
        None when it already has."""
        cdef Op op
        for op in self._reqs:
            if op.future is fut:
                if op.settled is None:
                    op.settled = self._create_future()
                return op.settled
        return None

    def counts(self):
        """``(requests in flight, matched-probe receives waiting, abandoned requests
        whose memory is kept)``: for tests and diagnostics."""
        return len(self._reqs), len(self._probes), len(self._graveyard)

    # ------------------------------------------------------------ counters
    # Every send and received message is counted where the engine posts or matches it
    # (csrc/stats.c): the peer of a send is its endpoint's, that of a receive is found
    # from its sender tag (stat_route); ucxcomm.transport.counters reads them.
    cdef int _stat_slot(self, object label) except -1:
        """The counter slot of peer ``label`` (made on first use)."""
        slot = self._stat_slots.get(label)
        if slot is None:
            slot = ucxcomm_stats_peer(<ucxcomm_stats_t *>self._stats)
            if slot < 0:
                raise MemoryError("no memory for the traffic counters")
            self._stat_slots[label] = slot
        return slot

    def stat_link(self, uintptr_t handle, object label, bint fast):
        """Count sends on endpoint ``handle`` as to peer ``label`` (``fast``: its lanes
        are fast lanes, which decides the protocol variant of its receives too)."""
        if ucxcomm_stats_route_ep(<ucxcomm_stats_t *>self._stats, handle,
                                  self._stat_slot(label), fast) != 0:
            raise MemoryError("no memory for the traffic counters")

    def stat_rows(self, object label, int variant, list first):
        """Tally ``label``'s messages of protocol ``variant`` (0: plain, 1: fast
        completion) by the row of UCX's protocol table holding their size: ``first``,
        the rows' first sizes, ascending (at most ``STAT_ROWS``)."""
        cdef size_t sizes[16]
        cdef Py_ssize_t i, n = len(first)
        if n > UCXCOMM_STATS_ROWS:
            raise ValueError(f"at most {UCXCOMM_STATS_ROWS} rows")
        for i in range(n):
            sizes[i] = first[i]
        if ucxcomm_stats_set_rows(<ucxcomm_stats_t *>self._stats, self._stat_slot(label),
                                  variant, sizes, <unsigned>n) != 0:
            raise ValueError("bad counter rows")

    def stat_route(self, unsigned shift, object prefixes, object label):
        """Count received messages whose sender tag ``>> shift`` is one of
        ``prefixes`` as from peer ``label`` (one ``shift`` per engine)."""
        cdef int slot = self._stat_slot(label)
        for prefix in prefixes:
            if ucxcomm_stats_route_src(<ucxcomm_stats_t *>self._stats, shift, prefix,
                                       slot) != 0:
                raise ValueError(f"cannot route sender tags >> {shift} to a counter")

    def stat_tallies(self, object label):
        """``(sent, received, unexpected)`` of peer ``label`` (None: never counted):
        ``sent`` and ``received`` list ``(messages, bytes)`` per protocol row, plain
        variant's ``STAT_ROWS`` rows, then the fast variant's, then the unclassified;
        ``unexpected``, the receives that found their message already here."""
        slot = self._stat_slots.get(label) if label is not None else 0
        if slot is None:
            return None
        cdef const ucxcomm_peer_stats_t *p = ucxcomm_stats_get(
            <ucxcomm_stats_t *>self._stats, slot)
        cdef int i
        sent = [(p.sent[i].messages, p.sent[i].bytes)
                for i in range(UCXCOMM_STATS_UNCLASSIFIED + 1)]
        recv = [(p.recv[i].messages, p.recv[i].bytes)
                for i in range(UCXCOMM_STATS_UNCLASSIFIED + 1)]
        return sent, recv, (p.unexpected.messages, p.unexpected.bytes)

    def pending_sends(self, peers):
        """Futures of the sends to ``peers`` still in flight."""
        cdef Op op
        return [op.future for op in self._reqs
                if not op.is_recv and op.peers == peers and op.future is not None
                and not op.future.done()]

    # ------------------------------------------------------------ polling
    def pending(self):
        return bool(self._reqs or self._probes)

    def poll(self):
        """Progress UCX once and complete every operation that finished (futures
        resolved here); returns how many finished."""
        ucxcomm_progress(self._wh)
        if self._reqs or self._probes:
            return self._poll()
        return 0

    def arm(self):
        """Drain UCX's events, complete what finished, then arm the worker: True when
        it is safe to sleep on its descriptor."""
        while ucxcomm_progress(self._wh):
            pass
        if self._poll():
            return False
        cdef int armed = ucxcomm_arm(self._wh)
        if armed < 0:  # arming unsupported: sleep on the timer only
            return True
        return armed == 1

    cdef int _poll_reqs(self) except -1:
        cdef int finished = 0
        cdef Op op
        cdef int st
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef list keep = []
        if self._ctl_req != NULL and (self._rv_send or self._rv_recv or self._rv_blind):
            # (a control message is only ever about a rendezvous pending here: with
            # none, it waits in its buffer and every other poll skips the test)
            finished += self._ctl_poll()
        for op in self._reqs:
            if op.req == NULL:
                if op.rv == 0:  # finished while polled elsewhere
                    continue
                # a split rendezvous waiting for a control message
                if self._dead and (err := self._dead_error(op.peers)) is not None:
                    self._abandon(op, err)
                    finished += 1
                else:
                    keep.append(op)
                continue
            st = ucxcomm_test(op.req, op.is_recv, &stag, &length)
            if st != UCXCOMM_INPROGRESS:
                if op.posted:
                    self._finish_posted(op, st, stag, length, False)
                else:
                    if op.is_recv and st >= 0 and not (op.has_ptr or op.alloc):
                        # (a tag_recv; matched-probe receives were counted on match)
                        ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, stag, length,
                                           0, op.device)
                    self._complete(op, st)
                finished += 1
            elif self._dead and (err := self._dead_error(op.peers)) is not None:
                self._abandon(op, err)
                finished += 1
            else:
                keep.append(op)
        self._reqs = keep
        return finished

    cdef int _poll(self) except -1:
        """Poll every pending operation once; returns how many finished."""
        cdef int finished = 0
        cdef Op op
        cdef list keep
        cdef set missed
        if self._reqs:
            finished += self._poll_reqs()
        if self._probes:
            keep = []
            # (tag, mask) criteria that found nothing this round (worth tracking only when
            # several probes are pending)
            missed = set() if len(self._probes) > 1 else None
            for op in self._probes:
                if op.future.done():  # cancelled by its awaiter
                    op.mark_settled()
                    finished += 1
                elif missed and (op.tag, op.mask) in missed and not self._dead:
                    # Nothing arrived since the same criteria missed: skip the probe.
                    keep.append(op)
                elif self._try_match(op, False):
                    finished += 1
                    if op.req != NULL:
                        self._reqs.append(op)
                elif self._dead and (err := self._dead_error(op.peers)) is not None:
                    op.mark_settled()
                    op.future.set_exception(err)
                    finished += 1
                else:
                    if missed is not None:
                        missed.add((op.tag, op.mask))
                    keep.append(op)
            self._probes = keep
        return finished

    cdef void _abandon(self, Op op, object err) except *:
        # The peer is gone; UCP may never finish this request. A receive is cancelled:
        # one UCP withdraws at once (posted, never matched) no longer touches its
        # memory, which is released; any other keeps its memory alive until the worker
        # is destroyed (a stream reader's posted receives of a client that announced
        # batches and left held their buffers for good otherwise: issue 27 review).
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef bint finished = False
        if op.rv:
            self._rv_forget(op)
        if op.is_recv and op.req != NULL:
            ucxcomm_cancel(self._wh, op.req)
            finished = ucxcomm_test(op.req, 1, &stag, &length) != UCXCOMM_INPROGRESS
        if not finished:
            self._graveyard.append(op.keep)
        op.req = NULL
        op.mark_settled()
        if not op.future.done():
            op.future.set_exception(err)

    # ------------------------------------------------------------ split rendezvous
    def split_setup(self, int world, route, size_t split_min, route_stag=None):
        """Handle split rendezvous requests on this worker (it carries a world's
        communicators): ``world`` is this process's world rank, ``route(w)`` the
        :class:`EpSend` of the endpoint to world rank ``w`` (for control messages; kept
        until it closes, then asked again), ``route_stag(t)``
        the world rank that sent a message with tag ``t`` (-1: unknown), ``split_min`` the
        size from which this process's sends to same-host peers split (0: never).
        False when the worker already serves a world (the first one's stays)."""
        if self._split_rx:
            return False  # (one world per worker: the first one's)
        self._split_rx = True
        self._pid = getpid()
        self._world = world
        self._route = route
        self._route_stag = route_stag
        self._split_min = split_min
        self._split_post_max = split_min if split_min else 262144
        if self._ctl_req == NULL:
            self._ctl_post()
        return True

    cdef object _send_split(self, EpSend s, Py_buffer *pview, uint64_t tag):
        """The split rendezvous's send: a request (RTS) on the message's own tag with
        ``SPLIT_BIT``; the receiver's CTS names its buffer and the sender's share, which
        the sender writes (``process_vm_writev``) while the receiver reads the rest; FIN
        says the share is there, DONE that the receiver is done with this buffer."""
        cdef BufRef ref = BufRef.__new__(BufRef)
        ref.view = pview[0]
        ref.held = True
        cdef uint64_t rid = self._rv_next
        self._rv_next += 1
        cdef bytearray wire = bytearray(SPLIT_SIZE)
        cdef split_rts *rts = <split_rts *><char *>wire
        rts.magic = RTS_MAGIC
        rts.world = <uint32_t>self._world
        rts.rid = rid
        rts.addr = <uint64_t><uintptr_t>ref.view.buf
        rts.length = <uint64_t>ref.view.len
        rts.pid = <uint32_t>self._pid
        rts.check = _rts_check(rts)
        cdef void *req = NULL
        cdef int st = ucxcomm_tag_send(s.handle, <char *>wire, SPLIT_SIZE, tag | SPLIT_BIT,
                                       1, &req)
        if st < 0:
            raise self._error(st, s.peers, "send")
        ucxcomm_count_send(<ucxcomm_stats_t *>self._stats, s.handle, ref.view.len, 0)
        self.split_sent += 1
        if st != 0:
            sent = self._polled_op(st, req, wire, s.peers, "send", False, tag)
            sent.add_done_callback(_retrieve)
        cdef Op op = Op.__new__(Op)
        op.future = self._create_future()
        op.peers = s.peers
        op.keep = ref
        op.ptr = <uintptr_t>ref.view.buf
        op.cap = <size_t>ref.view.len
        op.tag = tag
        op.rv = 1
        op.rv_id = rid
        op.rv_peer = s.world
        self._rv_send[rid] = op
        self._reqs.append(op)
        return op.future

    cdef int _ctl_send(self, int world, uint32_t kind, uint64_t rid, uintptr_t addr,
                       size_t k) except -1:
        """Send control message ``kind`` about message ``rid`` to world rank ``world``:
        0, or 1 when it could not be sent (the peer is gone or the worker closing: what
        waits on the peer fails through the dead-peer path)."""
        cdef bytearray wire = bytearray(SPLIT_SIZE)
        cdef split_ctl *c = <split_ctl *><char *>wire
        c.magic = CTL_MAGIC
        c.kind = kind
        c.rid = rid
        c.addr = addr
        c.k = k
        c.pid = <uint32_t>self._pid
        c.world = <uint32_t>self._world
        cdef EpSend s = self._routes.get(world)
        if s is None or s.closed:  # (first use, or released: ask again)
            try:
                s = self._route(world)
            except Exception:
                return 1
            if s.closed:
                return 1
            self._routes[world] = s
        cdef void *req = NULL
        cdef int st = ucxcomm_tag_send(s.handle, <char *>wire, SPLIT_SIZE, CTL_TAG, 1, &req)
        if st < 0:
            return 1
        if st != 0:
            sent = self._polled_op(st, req, wire, frozenset((world,)), "send", False,
                                   CTL_TAG)
            sent.add_done_callback(_retrieve)
        return 0

    cdef int _ctl_post(self) except -1:
        """(Re)post the receive of control messages; those already here are handled."""
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef int st
        cdef char got[SPLIT_SIZE]
        while True:
            st = ucxcomm_tag_recv(self._wh, self._ctl_buf, SPLIT_SIZE, CTL_TAG, CTX_MASK,
                                  &self._ctl_req, &stag, &length)
            if st == UCXCOMM_INPROGRESS:
                return 0
            self._ctl_req = NULL
            if st < 0 and st != self._truncated:
                return 0  # (the worker is closing)
            memcpy(got, self._ctl_buf, SPLIT_SIZE)
            self._ctl_dispatch(got, length if st >= 0 else 0)

    cdef int _ctl_poll(self) except -1:
        """Handle the control message that arrived, if any (then post the next)."""
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef char got[SPLIT_SIZE]
        if self._ctl_req == NULL:
            return 0
        cdef int st = ucxcomm_test(self._ctl_req, 1, &stag, &length)
        if st == UCXCOMM_INPROGRESS:
            return 0
        self._ctl_req = NULL
        if st < 0 and st != self._truncated:
            return 0
        memcpy(got, self._ctl_buf, SPLIT_SIZE)
        # This one first: posting again may take (and handle) the next ones at once.
        self._ctl_dispatch(got, length if st >= 0 else 0)
        self._ctl_post()
        return 1

    cdef int _ctl_dispatch(self, const char *buf, size_t length) except -1:
        """One control message (anything malformed or about no pending message is
        dropped: it can only be a peer's mistake)."""
        cdef split_ctl c
        cdef Op op
        cdef int err
        cdef size_t k
        if length != SPLIT_SIZE:
            return 0
        memcpy(&c, buf, SPLIT_SIZE)
        if c.magic != CTL_MAGIC:
            return 0
        if c.kind == CTL_CTS:
            op = self._rv_send.get(c.rid)
            if op is None or op.rv != 1 or <int>c.world != op.rv_peer:
                return 0
            k = min(<size_t>c.k, op.cap)
            with nogil:
                err = _cma(True, <int>c.pid, op.ptr, <uintptr_t>c.addr, k)
            if not err:
                self.split_shared += 1
            op.rv = 2
            self._ctl_send(op.rv_peer, CTL_FIN, op.rv_id, 1 if err else 0, k)
        elif c.kind == CTL_DONE:
            op = self._rv_send.pop(c.rid, None)
            if op is None or <int>c.world != op.rv_peer:
                if op is not None:
                    self._rv_send[c.rid] = op
                return 0
            op.rv = 0
            self._complete(op, 0)
        elif c.kind == CTL_NACK:
            self._nack(buf)
        elif c.kind == CTL_BLIND:
            ops = self._rv_blind.get((<int>c.world, c.rid))
            if not ops:
                return 0
            op = ops.pop(0)
            if not ops:
                del self._rv_blind[(<int>c.world, c.rid)]
            op.rv = 0
            if c.addr:
                self._rv_fail(op, RuntimeError(
                    f"world rank {op.rv_peer} could not deliver a message of {c.k} bytes "
                    "(split rendezvous into a posted receive)"))
            else:
                op.length = <size_t>c.k
                self._complete(op, 0)
        elif c.kind == CTL_FIN:
            op = self._rv_recv.pop((<int>c.world, c.rid), None)
            if op is None:
                return 0
            err = op.rv_err
            if c.addr and not err:  # the sender could not write its share: read it
                with nogil:
                    err = _cma(False, op.rv_pid, op.ptr, op.rv_addr, op.rv_k)
            self._rv_finish(op, err)
        return 0

    cdef int _nack(self, const char *buf) except -1:
        """A posted receive of world rank ``c.world`` got one of this process's requests
        (tag ``c.rid``) in its buffer, where it is not read (receives may share memory):
        the oldest request to that rank with that tag still waiting for its CTS is the
        one (a receiver matches one sender's messages of one tag in order). Write what
        fits (``c.k`` bytes at ``c.addr``), say how long the message is, done."""
        cdef split_ctl c
        memcpy(&c, buf, SPLIT_SIZE)
        cdef Op op, best = None
        cdef int err = 0
        cdef size_t n
        for op in self._rv_send.values():
            if (op.rv == 1 and op.rv_peer == <int>c.world and op.tag == c.rid
                    and (best is None or op.rv_id < best.rv_id)):
                best = op
        if best is None:
            self._ctl_send(<int>c.world, CTL_BLIND, c.rid, 1, 0)
            return 0
        n = min(<size_t>c.k, best.cap)
        with nogil:
            err = _cma(True, <int>c.pid, best.ptr, <uintptr_t>c.addr, n)
        self._rv_send.pop(best.rv_id, None)
        best.rv = 0
        self._ctl_send(best.rv_peer, CTL_BLIND, c.rid, 1 if err else 0, best.cap)
        self._complete(best, 0)
        return 0

    cdef int _rts_blind(self, Op op, uint64_t stag, bint early) except -1:
        """A posted receive's buffer got a split request: not read from there (other
        receives may share that memory); the sender, asked by tag (NACK), writes what
        fits and tells the length (BLIND)."""
        cdef int world = -1
        op.posted = False
        op.req = NULL
        op.is_recv = True
        op.sender_tag = stag & ~SPLIT_BIT
        try:
            world = self._route_stag(op.sender_tag)
        except Exception:
            world = -1
        if world < 0 or self._ctl_send(world, CTL_NACK, op.sender_tag,
                                       op.ptr, op.cap):
            self._rv_fail(op, RuntimeError("a split rendezvous request reached a posted "
                                           "receive from a rank this process cannot name"))
            return 0
        ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, op.sender_tag, op.cap, early,
                           op.device)
        self.split_received += 1
        op.rv = 4
        op.rv_peer = world
        op.rv_id = op.sender_tag
        self._rv_blind.setdefault((world, op.sender_tag), []).append(op)
        if op.future is None:
            op.future = self._create_future()
        self._reqs.append(op)
        return 0

    cdef int _rts_take(self, void *msg, uint64_t stag, size_t nbytes, char *out) except -1:
        """Receive probed request ``msg`` into ``out`` (SPLIT_SIZE bytes); 0, or -1 when
        it is not a well-formed request (consumed)."""
        cdef void *req = NULL
        cdef uint64_t st_tag = 0
        cdef size_t got = 0
        cdef int st
        if nbytes != SPLIT_SIZE:
            junk = bytearray(nbytes)
            st = ucxcomm_msg_recv(self._wh, <char *>junk, nbytes, msg, &req, &st_tag, &got)
        else:
            st = ucxcomm_msg_recv(self._wh, out, SPLIT_SIZE, msg, &req, &st_tag, &got)
        while st == UCXCOMM_INPROGRESS:  # (a 40-byte eager message that is here)
            ucxcomm_progress(self._wh)
            st = ucxcomm_test(req, 1, &st_tag, &got)
        if (st < 0 or nbytes != SPLIT_SIZE or (<split_rts *>out).magic != RTS_MAGIC
                or (<split_rts *>out).check != _rts_check(<split_rts *>out)):
            return -1
        return 0

    cdef int _rts_start(self, Op op, uint64_t stag, const char *wire, bint early) except -1:
        """``op`` matched the split request ``wire``: copy the receiver's part now (the
        whole message when it is small, truncated, or bound for GPU memory), ask the
        sender for its share (CTS); ``op`` then waits for FIN in ``_reqs``."""
        cdef split_rts rts
        memcpy(&rts, wire, SPLIT_SIZE)
        cdef size_t n, k
        cdef int err = 0
        cdef uintptr_t dst
        op.sender_tag = stag & ~SPLIT_BIT
        op.length = <size_t>rts.length
        op.rv_peer = <int>rts.world
        op.rv_id = rts.rid
        op.rv_pid = <int>rts.pid
        op.rv_addr = <uintptr_t>rts.addr
        op.is_recv = True
        ucxcomm_count_recv(<ucxcomm_stats_t *>self._stats, op.sender_tag, op.length, early,
                           op.device)
        self.split_received += 1
        if op.alloc:
            try:
                import numpy
                arr = numpy.empty(op.length, dtype=numpy.uint8)
            except (MemoryError, ValueError) as exc:
                self._ctl_send(op.rv_peer, CTL_DONE, op.rv_id, 0, 0)
                self._rv_fail(op, exc)
                return 0
            op.buffer = arr
            op.ptr = <uintptr_t>arr.ctypes.data
            op.cap = op.length
            op.has_ptr = False
        n = min(op.length, op.cap)
        if op.device or op.length > op.cap or n < SPLIT_ALONE:
            # The receiver copies all of it (GPU memory: through host memory).
            if op.device:
                import numpy
                arr = numpy.empty(n, dtype=numpy.uint8)
                dst = <uintptr_t>arr.ctypes.data
            else:
                dst = op.ptr
            with nogil:
                err = _cma(False, op.rv_pid, dst, op.rv_addr, n)
            if op.device and not err:
                rt = _runtime()
                rt.memcpy(op.ptr, dst, n, 1)  # cudaMemcpyHostToDevice
            self._ctl_send(op.rv_peer, CTL_DONE, op.rv_id, 0, 0)
            op.rv = 0
            if err:
                self._rv_fail(op, self._cma_error(err, op))
            else:
                self._complete(op, 0)
            return 0
        k = n // 2  # the sender's share: [0, k)
        op.rv_k = k
        if self._ctl_send(op.rv_peer, CTL_CTS, op.rv_id, op.ptr, k):
            k = 0  # (no CTS: the sender writes nothing; the receive fails below)
            op.rv_k = 0
            op.rv_err = ESRCH
        with nogil:
            err = _cma(False, op.rv_pid, op.ptr + k, op.rv_addr + k, n - k)
        if not op.rv_err:
            op.rv_err = err
        if op.rv_k == 0:  # no CTS went out: no FIN will come
            op.rv = 0
            self._rv_fail(op, self._cma_error(op.rv_err or ESRCH, op))
            return 0
        op.rv = 3
        self._rv_recv[(op.rv_peer, op.rv_id)] = op
        if op.future is None:
            op.future = self._create_future()
        self._reqs.append(op)
        return 0

    cdef int _rv_finish(self, Op op, int err) except -1:
        """A receive whose FIN came: DONE to the sender, then the result."""
        op.rv = 0
        self._ctl_send(op.rv_peer, CTL_DONE, op.rv_id, 0, 0)
        if err:
            self._rv_fail(op, self._cma_error(err, op))
        else:
            self._complete(op, 0)
        return 0

    cdef object _cma_error(self, int err, Op op):
        if err == ESRCH:
            from ..errors import PeerFailure
            return PeerFailure(f"world rank {op.rv_peer} is gone (its process ended while "
                               "a message from it was being copied)")
        import os
        return OSError(err, f"copying a message from world rank {op.rv_peer}'s memory "
                            f"failed: {os.strerror(err)}")

    cdef void _rv_fail(self, Op op, object exc) except *:
        op.rv = 0
        op.mark_settled()
        if op.future is None:
            op.future = self._create_future()
        if not op.future.done():
            op.future.set_exception(exc)

    cdef void _rv_forget(self, Op op):
        if op.rv == 1 or op.rv == 2:
            self._rv_send.pop(op.rv_id, None)
        elif op.rv == 3:
            self._rv_recv.pop((op.rv_peer, op.rv_id), None)
        elif op.rv == 4:
            ops = self._rv_blind.get((op.rv_peer, op.rv_id))
            if ops is not None and op in ops:
                ops.remove(op)
        op.rv = 0

    cdef int _held_find(self, uint64_t tag, uint64_t mask) except -2:
        """The index of the first held message that ``(tag, mask)`` matches, or -1."""
        cdef _Held h
        cdef Py_ssize_t i
        for i in range(len(self._held)):
            h = self._held[i]
            if ((h.stag ^ tag) & mask) == 0:
                return <int>i
        return -1

    cdef object _hold_through(self, uint64_t tag, uint64_t mask, uint64_t stag):
        """A probe that does not consume found the split request ``stag``: take it out of
        UCX's queue (its size is in its payload), and with it every earlier message
        from the same sender (they keep their order ahead of it, in ``_held``).
        Returns the request's _Held."""
        cdef uint64_t smask = (CTX_MASK & ~SPLIT_BIT) | SRC_MASK
        cdef uint64_t stag2 = 0
        cdef size_t nbytes = 0
        cdef void *msg = NULL
        cdef _Held h
        while ucxcomm_tag_probe(self._wh, stag & smask, smask, 1, &msg, &stag2, &nbytes):
            h = _Held.__new__(_Held)
            h.stag = stag2
            h.nbytes = nbytes
            if stag2 & SPLIT_BIT:
                wire = bytearray(SPLIT_SIZE)
                if self._rts_take(msg, stag2, nbytes, <char *>wire) < 0:
                    continue  # (malformed: dropped)
                h.rts = bytes(wire)
                h.nbytes = <size_t>(<split_rts *><char *>wire).length
            else:
                h.msg = msg
            self._held.append(h)
            if ((stag2 ^ tag) & mask) == 0:
                return h
        return None

    def revoke_ops(self, uint64_t value, uint64_t mask, make_err):
        """Fail every pending operation whose tag holds ``value`` under ``mask`` (a
        communicator's context: ``Comm.revoke``) with a fresh ``make_err()`` each, as a
        dead peer's are (a receive is cancelled; a send's memory is kept until the worker
        is destroyed); returns how many."""
        cdef Op op
        cdef list keep = []
        cdef int n = 0
        for op in self._reqs:
            if (op.req != NULL or op.rv) and not op.done and (op.tag & mask) == value:
                self._abandon(op, make_err())
                n += 1
            else:
                keep.append(op)
        self._reqs = keep
        keep = []
        for op in self._probes:
            if not op.done and (op.tag & mask) == value:
                op.mark_settled()
                if op.future is not None and not op.future.done():
                    op.future.set_exception(make_err())
                n += 1
            else:
                keep.append(op)
        self._probes = keep
        return n

    def _abort_ops(self, err):
        """Cancel every request, let UCP finish what it can (briefly), fail the rest
        with ``err``; their memory is kept until the worker is destroyed."""
        cdef Op op
        cdef int st, attempt
        cdef uint64_t stag = 0
        cdef size_t length = 0
        cdef list keep
        cdef list ops = self._reqs + self._probes
        for op in self._reqs:
            if op.rv:  # (a split rendezvous: a peer may still copy from or into it)
                self._graveyard.append(op.keep)
                op.rv = 0
        if self._ctl_req != NULL:  # (cancelled, then finished: UCP frees it then)
            ucxcomm_cancel(self._wh, self._ctl_req)
            for attempt in range(100):
                if ucxcomm_test(self._ctl_req, 1, &stag, &length) != UCXCOMM_INPROGRESS:
                    break
                ucxcomm_progress(self._wh)
            self._ctl_req = NULL
        self._rv_send.clear()
        self._routes.clear()
        self._rv_recv.clear()
        self._rv_blind.clear()
        for op in self._reqs:
            if op.req != NULL:
                ucxcomm_cancel(self._wh, op.req)
        for attempt in range(100):
            if not self._reqs:
                break
            ucxcomm_progress(self._wh)
            keep = []
            for op in self._reqs:
                if op.req == NULL:
                    continue
                st = ucxcomm_test(op.req, op.is_recv, &stag, &length)
                if st == UCXCOMM_INPROGRESS:
                    keep.append(op)
                else:
                    op.req = NULL
            self._reqs = keep
        for op in self._reqs + self._probes:
            self._graveyard.append(op.keep)
        # Every operation's future ends here, also those UCP finished (cancelled) above:
        # left pending, whoever awaited one would wait forever.
        for op in ops:
            op.req = NULL
            op.mark_settled()
            if op.future is not None and not op.future.done():
                op.future.set_exception(err)
                op.future.exception()  # nobody may await it any more: mark retrieved
        self._reqs = []
        self._probes = []


# ====================================================================== RMA engine
cdef object _status_error = None  # _ucx.status_error, set by set_status_error


def set_status_error(fn):
    """Install the ``ucs_status_t`` -> exception mapper (``_ucx.status_error``)."""
    global _status_error
    _status_error = fn


cdef object _raise_status(int st, str what):
    raise _status_error(st, None, what)


def rma_create(dict options, double spin_s):
    """A new RMA engine (csrc/rma.c) configured with ``options`` (UCX context options
    without ``UCX_``): ``(status, handle, error text)``."""
    cdef list keys = [k.encode() for k in options]
    cdef list values = [v.encode() for v in options.values()]
    cdef Py_ssize_t n = len(keys), i
    cdef const char *ks[64]
    cdef const char *vs[64]
    cdef void *out = NULL
    cdef char err[256]
    if n > 64:
        raise ValueError("too many UCX options")
    for i in range(n):
        ks[i] = keys[i]
        vs[i] = values[i]
    err[0] = 0
    cdef int st = ucxcomm_rma_create(ks, vs, n, spin_s, &out, err, sizeof(err))
    return st, <uintptr_t>out, err.decode()


def rma_destroy(uintptr_t eng):
    ucxcomm_rma_destroy(<void *>eng)


def rma_address(uintptr_t eng):
    cdef char buf[4096]
    cdef size_t n = 0
    cdef int st = ucxcomm_rma_address(<void *>eng, buf, sizeof(buf), &n)
    return st, (buf[:n] if st == 0 else b"")


def rma_connect(uintptr_t eng, bytes address):
    cdef uintptr_t ep = 0
    cdef int st = ucxcomm_rma_connect(<void *>eng, <const char *>address, &ep)
    return st, ep


def rma_ep_close(uintptr_t eng, uintptr_t ep):
    ucxcomm_rma_ep_close(<void *>eng, ep)


def rma_mem_map(uintptr_t eng, uintptr_t addr, size_t length):
    cdef void *memh = NULL
    cdef int st = ucxcomm_rma_mem_map(<void *>eng, <void *>addr, length, &memh)
    return st, <uintptr_t>memh


def rma_mem_alloc(uintptr_t eng, size_t length):
    """``(status, memh, address)`` of ``length`` bytes allocated and mapped by UCX."""
    cdef void *memh = NULL
    cdef void *addr = NULL
    cdef int st = ucxcomm_rma_mem_alloc(<void *>eng, length, &memh, &addr)
    return st, <uintptr_t>memh, <uintptr_t>addr


def rma_mem_unmap(uintptr_t eng, uintptr_t memh):
    return ucxcomm_rma_mem_unmap(<void *>eng, <void *>memh)


def rma_rkey_pack(uintptr_t eng, uintptr_t memh):
    cdef char buf[8192]
    cdef size_t n = 0
    cdef int st = ucxcomm_rma_rkey_pack(<void *>eng, <void *>memh, buf, sizeof(buf), &n)
    return st, (buf[:n] if st == 0 else b"")


def rma_rkey_ptr(uintptr_t rkey, uint64_t raddr):
    """``(status, local address)`` of remote address ``raddr`` when this process has the
    owner's memory mapped (shared memory), else a nonzero status."""
    cdef uintptr_t ptr = 0
    cdef int st = ucxcomm_rma_rkey_ptr(<void *>rkey, raddr, &ptr)
    return st, ptr


def rma_rkey_unpack(uintptr_t ep, bytes packed):
    cdef void *rkey = NULL
    cdef int st = ucxcomm_rma_rkey_unpack(ep, <const char *>packed, &rkey)
    return st, <uintptr_t>rkey


def rma_rkey_destroy(uintptr_t rkey):
    ucxcomm_rma_rkey_destroy(<void *>rkey)


def rma_notify_fd(uintptr_t eng):
    return ucxcomm_rma_notify_fd(<void *>eng)


def rma_progress(uintptr_t eng):
    return ucxcomm_rma_progress(<void *>eng)


def rma_arm(uintptr_t eng):
    ucxcomm_rma_arm(<void *>eng)


def rma_disarm(uintptr_t eng):
    ucxcomm_rma_disarm(<void *>eng)


cdef class RmaRequest:
    """A one-sided operation still in flight: it owns the memory UCX may still touch
    (the origin buffer, or the operand and reply words of an atomic)."""

    cdef void *req
    cdef object keep
    cdef public int status     # UCXCOMM_INPROGRESS until finished
    cdef uint64_t operand      # an atomic's operand (compare value for compare-and-swap)
    cdef uint64_t reply        # an atomic's reply word (new value in, old value out)
    cdef bint fetch
    cdef bint signed
    cdef size_t size

    def test(self):
        """Test once (UCP frees the request when finished); returns the status."""
        if self.status == UCXCOMM_INPROGRESS and self.req != NULL:
            self.status = ucxcomm_rma_test(self.req)
            if self.status != UCXCOMM_INPROGRESS:
                self.req = NULL
        return self.status

    def value(self):
        """The previous value fetched by a finished atomic (else None)."""
        return _word_value(&self.reply, self.size, self.signed) if self.fetch else None


cdef object _word_value(uint64_t *word, size_t size, bint signed):
    if size == 4:
        v32 = (<uint32_t *>word)[0]
        return <int32_t>v32 if signed else v32
    return <int64_t>word[0] if signed else word[0]


cdef int _store_word(uint64_t *word, object value, size_t size) except -1:
    """``value`` (any Python int) as the ``size``-byte integer the hardware sees."""
    if size == 4:
        (<uint32_t *>word)[0] = <uint32_t>(value & 0xFFFFFFFF)
    else:
        word[0] = <uint64_t>(value & 0xFFFFFFFFFFFFFFFF)
    return 0


cdef int _spin(void *eng, void *req, double spin_s) noexcept nogil:
    """Wait in place for one request: progress the engine and test it until it finished
    or ``spin_s`` passed (one-sided requests finish within microseconds: the target's
    progress thread serves them). Returns the last status; UCP frees the request when it
    finished."""
    cdef int st = ucxcomm_rma_test(req)
    if st != UCXCOMM_INPROGRESS or spin_s <= 0:
        return st
    cdef double end = _now() + spin_s
    while st == UCXCOMM_INPROGRESS and _now() < end:
        ucxcomm_rma_progress(eng)
        st = ucxcomm_rma_test(req)
    return st


cdef object _outcome(int st, void *req, void *eng, double spin_s, object keep):
    """After posting: None (done) or an RmaRequest (still in flight after waiting in
    place up to ``spin_s``); a failure raises the ucxcomm error."""
    if st == UCXCOMM_INPROGRESS:
        st = _spin(eng, req, spin_s)
    if st == 0:
        return None
    if st < 0:
        _raise_status(st, "RMA")
    cdef RmaRequest r = RmaRequest.__new__(RmaRequest)
    r.req = req
    r.keep = keep
    r.status = UCXCOMM_INPROGRESS
    return r


def rma_put(uintptr_t eng, uintptr_t ep, object buf, uint64_t raddr, uintptr_t rkey,
            double spin_s):
    """Put all of ``buf`` (host memory with the buffer protocol, C-contiguous) at
    ``raddr``, waiting in place up to ``spin_s``: None (done) or an :class:`RmaRequest`.
    ``BufferError``/``TypeError`` when ``buf`` is not such a buffer (nothing moved)."""
    cdef BufRef ref = BufRef.__new__(BufRef)
    get_buffer(buf, &ref.view, PyBUF_SIMPLE)
    ref.held = True
    cdef void *req = NULL
    cdef int st = ucxcomm_rma_put(<void *>eng, ep, ref.view.buf, ref.view.len, raddr,
                                  <void *>rkey, &req)
    return _outcome(st, req, <void *>eng, spin_s, ref)


cdef size_t _COPY_NOGIL = 64 << 10  # copies from this size let other threads run


def copy_in(uintptr_t dst, object buf):
    """Copy all of ``buf`` (host memory with the buffer protocol, C-contiguous) to address
    ``dst`` (memory of a peer mapped into this process)."""
    cdef Py_buffer view
    get_buffer(buf, &view, PyBUF_SIMPLE)
    try:
        if <size_t>view.len >= _COPY_NOGIL:
            with nogil:
                memcpy(<void *>dst, view.buf, view.len)
        else:
            memcpy(<void *>dst, view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


def copy_out(object buf, uintptr_t src):
    """Fill ``buf`` (writable host memory, C-contiguous) from address ``src``."""
    cdef Py_buffer view
    get_buffer(buf, &view, PyBUF_WRITABLE)
    try:
        if <size_t>view.len >= _COPY_NOGIL:
            with nogil:
                memcpy(view.buf, <const void *>src, view.len)
        else:
            memcpy(view.buf, <const void *>src, view.len)
    finally:
        PyBuffer_Release(&view)


def copy_at(uintptr_t dst, uintptr_t src, size_t n):
    """``memcpy(dst, src, n)`` (addresses from :func:`target` and mapped peer memory)."""
    if n >= _COPY_NOGIL:
        with nogil:
            memcpy(<void *>dst, <const void *>src, n)
    else:
        memcpy(<void *>dst, <const void *>src, n)


def rma_put_at(uintptr_t eng, uintptr_t ep, tuple t, uint64_t raddr, uintptr_t rkey,
               double spin_s):
    """:func:`rma_put` of target ``t`` (from :func:`target`; host memory)."""
    cdef void *req = NULL
    cdef int st = ucxcomm_rma_put(<void *>eng, ep, <const void *><uintptr_t>t[0],
                                  <size_t>t[1], raddr, <void *>rkey, &req)
    return _outcome(st, req, <void *>eng, spin_s, t[2])


def rma_get_at(uintptr_t eng, uintptr_t ep, tuple t, uint64_t raddr, uintptr_t rkey,
               double spin_s):
    """:func:`rma_get` into target ``t`` (from :func:`target`, writable; host memory)."""
    cdef void *req = NULL
    cdef int st = ucxcomm_rma_get(<void *>eng, ep, <void *><uintptr_t>t[0], <size_t>t[1],
                                  raddr, <void *>rkey, &req)
    return _outcome(st, req, <void *>eng, spin_s, t[2])


def rma_get(uintptr_t eng, uintptr_t ep, object buf, uint64_t raddr, uintptr_t rkey,
            double spin_s):
    """Get ``len(buf)`` bytes at ``raddr`` into ``buf`` (writable host memory); like
    :func:`rma_put`."""
    cdef BufRef ref = BufRef.__new__(BufRef)
    get_buffer(buf, &ref.view, PyBUF_WRITABLE)
    ref.held = True
    cdef void *req = NULL
    cdef int st = ucxcomm_rma_get(<void *>eng, ep, ref.view.buf, ref.view.len, raddr,
                                  <void *>rkey, &req)
    return _outcome(st, req, <void *>eng, spin_s, ref)


def rma_flush(uintptr_t eng, uintptr_t ep, double spin_s):
    """Flush the endpoint (every operation complete at the target); like :func:`rma_put`."""
    cdef void *req = NULL
    cdef int st = ucxcomm_rma_flush(<void *>eng, ep, &req)
    return _outcome(st, req, <void *>eng, spin_s, None)


def rma_atomic(uintptr_t eng, uintptr_t ep, int opcode, size_t size, bint signed,
               object value, object compare, bint fetch, uint64_t raddr, uintptr_t rkey,
               double spin_s):
    """One remote atomic on a 4- or 8-byte integer (``compare`` for compare-and-swap,
    which always fetches), waiting in place up to ``spin_s``. Returns the previous value
    (fetching, done), None (not fetching, done), or an :class:`RmaRequest` whose
    :meth:`RmaRequest.value` is the previous value; a failure raises."""
    cdef RmaRequest r = RmaRequest.__new__(RmaRequest)
    cdef void *req = NULL
    cdef int st
    r.size = size
    r.signed = signed
    if compare is not None:  # UCP: the operand is the compare value; the reply word
        _store_word(&r.operand, compare, size)  # brings the new value in, the old out
        _store_word(&r.reply, value, size)
        fetch = True
    else:
        _store_word(&r.operand, value, size)
    r.fetch = fetch
    st = ucxcomm_rma_atomic(<void *>eng, ep, opcode, &r.operand,
                            &r.reply if fetch else NULL, size, raddr, <void *>rkey, &req)
    if st == UCXCOMM_INPROGRESS:
        st = _spin(<void *>eng, req, spin_s)
    if st == UCXCOMM_INPROGRESS:
        r.req = req
        r.status = st
        return r
    if st < 0:
        _raise_status(st, "atomic")
    return _word_value(&r.reply, size, signed) if fetch else None


# ====================================================================== endpoints
cdef class EpSend:
    """One endpoint's tag send in one compiled call: :meth:`send` is that endpoint's
    ``isend`` (``Endpoint`` keeps ``handle``, ``fast`` and ``closed`` current)."""


    def __init__(self, TagEngine eng, uintptr_t handle, peers, bint fast):
        self.eng = eng
        self.handle = handle
        self.peers = peers
        self.fast = fast

    def send(self, object obj, uint64_t tag):
        """Post a tag send of buffer ``obj``: None when it completed at once, else a
        future (``TagEngine.send``)."""
        if self.closed:
            from ..errors import ClosedError
            raise ClosedError("the endpoint is closed")
        return self.eng.c_send_ep(self, obj, tag)
