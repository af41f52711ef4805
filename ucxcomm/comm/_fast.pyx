# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The communicator's compiled fast paths, over the transport's engine.

What runs per call of a communicator's buffer point-to-point and small collectives,
written against the engine's declarations (``ucxcomm/transport/_ucp.pxd``: ``TagEngine``
and its ``c_*`` methods, ``Op``, ``BufRef``, ``EpSend``, ``Finish``), the way ucxx's
``arr.pxd`` serves its users: no callables or globals handed to the transport, no
private attribute of another module read.

* :class:`StatusFinish` (:data:`RECV_STATUS`): a buffer receive's :class:`Status`, built
  at C level by the engine when the message fitted;
* :class:`P2P`: ``Comm.Send``/``Isend``/``Recv``/``Irecv`` in one compiled call each;
* :class:`FastCollectives`: the small collectives of a communicator of 2 to
  ``SMALL_MAX_RANKS`` ranks, in one call each.

Imported by :class:`~ucxcomm.Comm` when the first communicator is made (the world
exists, so the engine is loaded): ``import ucxcomm`` loads nothing compiled. The layout
of tags and the Python paths these mirror are :mod:`ucxcomm.tags` and
:mod:`ucxcomm.comm.small`'s.
"""

import weakref

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE, PyBUF_WRITABLE, PyObject_GetBuffer
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject, PyTypeObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcmp, memcpy, memmove, memset
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec

cdef extern from "<time.h>":
    enum: CLOCK_REALTIME_COARSE

from ucxcomm.comm._kernels cimport sum_into
from ucxcomm.transport._ucp cimport BufRef, EpSend, Finish, Op, TagEngine, ptr_op

import numpy as np

from .. import tags
from . import algorithms, collectives, communicator, fingerprint, ops, request, small, trace

# What the paths use from the communicator layer, bound once (C globals: no lookups).
cdef object ndarray = np.ndarray
cdef object IN_PLACE = collectives.IN_PLACE
cdef object DONE = small.DONE
cdef object TUNING = algorithms.TUNING
cdef object RING_KEY = "allreduce_ring_min"
cdef object SUM = ops.SUM
cdef object Status = request.Status
cdef object recv_status = communicator.recv_status
cdef object make_tag = tags.make_tag
cdef object KIND_P2P = tags.KIND_P2P
cdef object KIND_COLL = tags.KIND_COLL
cdef Py_ssize_t SMALL_MAX = small.SMALL_MAX
cdef uint64_t FULL_MASK = 0xFFFFFFFFFFFFFFFF
cdef uint64_t SRC_MASK = tags._SRC_MASK
cdef uint64_t TAG_MASK = tags._TAG_MASK
cdef int SRC_SHIFT = tags._SRC_SHIFT
cdef long long C_TAG_UB = tags.TAG_UB
cdef tuple _NO_ARGS = ()


# ====================================================================== receive status
cdef class StatusFinish(Finish):
    """The ``finish`` of a buffer receive: ``recv_status``, whose result for a message
    that fitted (the common case) the engine gets from :meth:`fitted` without a Python
    call."""

    cdef object fitted(self, uint64_t stag, size_t nbytes, size_t cap):
        # (Status's own tp_new: no lookup of __new__, no bound call)
        s = (<PyTypeObject *>Status).tp_new(Status, <PyObject *>_NO_ARGS, NULL)
        s.source = <long long>((stag & SRC_MASK) >> SRC_SHIFT)
        s.tag = <long long>(stag & TAG_MASK)
        s.nbytes = nbytes
        return s

    def __call__(self, result):
        return recv_status(result)


#: The finish of every buffer receive of a communicator.
RECV_STATUS = StatusFinish()


# ====================================================================== reductions
# The reductions done here: (dtype kind, itemsize) -> kernel (SUM; native byte order).
cdef dict _NATIVE_SUM = {("f", 4): 1, ("f", 8): 2, ("i", 4): 3, ("u", 4): 3, ("i", 8): 4, ("u", 8): 4}


def native_kernel(op, dtype):
    """``(kernel, itemsize)`` of the compiled reduction of ``op`` on ``dtype``; kernel 0:
    not served here (the Python paths take the call)."""
    if op is not SUM or not dtype.isnative:
        return 0, 1
    return _NATIVE_SUM.get((dtype.kind, dtype.itemsize), 0), dtype.itemsize


cdef void _sum_rows(int kind, const char *rows, int size, Py_ssize_t nbytes,
                    char *out) noexcept nogil:
    """``out = ((row 0 + row 1) + row 2) + ...``: the rows (``nbytes`` each, one per rank,
    back to back) folded from the left, the order of ``SmallCollectives.allreduce``
    (the same on every rank: bit-identical results)."""
    cdef int k
    sum_into(kind, rows, rows + nbytes, out, nbytes)
    for k in range(2, size):
        sum_into(kind, out, rows + k * nbytes, out, nbytes)


cdef void _sum_strided(int kind, const char *rows, Py_ssize_t stride, int size,
                       Py_ssize_t nbytes, char *out) noexcept nogil:
    """``_sum_rows`` over rows ``stride`` bytes apart (the checked exchange's scratch)."""
    cdef int k
    sum_into(kind, rows, rows + stride, out, nbytes)
    for k in range(2, size):
        sum_into(kind, out, rows + k * stride, out, nbytes)


# ====================================================================== fingerprints
cdef extern from *:
    """
    typedef struct {
        uint8_t magic; uint8_t form; uint8_t kind; uint8_t device;
        uint32_t op; int32_t root; uint32_t dtype; int64_t count; int64_t own;
    } ucxcomm_fp;
    """
    ctypedef struct ucxcomm_fp:
        uint8_t magic
        uint8_t form
        uint8_t kind
        uint8_t device
        uint32_t op
        int32_t root
        uint32_t dtype
        int64_t count
        int64_t own

cdef Py_ssize_t FP_HDR = fingerprint.HDR
cdef object fp_verdict = fingerprint.verdict
cdef object fp_op_code = fingerprint.op_code
cdef object fp_dtype_code = fingerprint.dtype_code
cdef object CollectiveMismatch = fingerprint.CollectiveMismatch
assert sizeof(ucxcomm_fp) == fingerprint.HDR


# ====================================================================== flight recorder
cdef extern from *:
    """
    typedef struct {
        uint64_t n; int64_t t0; int64_t t1; uint64_t nbytes;
        uint32_t cid; int32_t seq; int32_t tag; int32_t peer;
        int32_t wpeer; int32_t crank; int32_t csize;
        uint16_t kind; uint8_t state; uint8_t flags;
    } ucxcomm_rec;
    typedef struct {
        char magic[8]; uint32_t version; uint32_t nslots; uint32_t pid;
        int32_t rank; int32_t size; uint32_t pad;
        uint64_t next; uint64_t lost; int64_t t_open; char pad2[8];
    } ucxcomm_trace_hdr;
    static inline void ucxcomm_publish(uint64_t *p, uint64_t v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    """
    ctypedef struct ucxcomm_rec:
        uint64_t n
        int64_t t0
        int64_t t1
        uint64_t nbytes
        uint32_t cid
        int32_t seq
        int32_t tag
        int32_t peer
        int32_t wpeer
        int32_t crank
        int32_t csize
        uint16_t kind
        uint8_t state
        uint8_t flags
    ctypedef struct ucxcomm_trace_hdr:
        char magic[8]
        uint32_t version
        uint32_t nslots
        uint32_t pid
        int32_t rank
        int32_t size
        uint64_t next
        uint64_t lost
        int64_t t_open
    void ucxcomm_publish(uint64_t *p, uint64_t v)

cdef enum:
    ST_POSTED = 1
    ST_WAITING = 2
    ST_DONE = 3
    ST_FAILED = 4
    ST_CANCELLED = 5

cdef int K_SEND = trace.KIND["Send"]
cdef int K_RECV = trace.KIND["Recv"]
cdef int K_IRECV = trace.KIND["Irecv"]
cdef int K_ALLREDUCE = trace.KIND["Allreduce"]
cdef int K_RSB = trace.KIND["Reduce_scatter_block"]
cdef int K_ALLGATHER = trace.KIND["Allgather"]
cdef int K_ALLTOALL = trace.KIND["Alltoall"]
cdef int K_BCAST = trace.KIND["Bcast"]
cdef int K_BARRIER = trace.KIND["barrier"]
cdef dict _KIND = trace.KIND
cdef object note_failure = trace.note_failure


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int64_t _coarse_ns() noexcept nogil:
    """The wall clock at the kernel's tick (a few ms; several times cheaper): the time
    of an operation that finished within its call."""
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME_COARSE, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class Recorder:
    """This process's flight recorder (:mod:`ucxcomm.comm.trace` describes the records
    and the file): a ring of ``nslots`` 64-byte records in ``mem`` (a shared mapping of
    ``path``, or private memory). The compiled paths call its C methods; Python code
    calls :meth:`start`, :meth:`end` and :meth:`fail`."""

    cdef ucxcomm_trace_hdr *hdr
    cdef ucxcomm_rec *recs
    cdef uint32_t nslots
    cdef uint32_t cursor      # the next slot to try (no division on the record path)
    cdef BufRef ref
    cdef readonly object mem
    cdef readonly object path
    cdef object last

    def __init__(self, mem, path, int nslots, int rank, int size, int pid):
        if nslots < 0 or nslots > 65535:
            raise ValueError(f"a recorder holds 0 (off) to 65535 records, not {nslots}")
        self.mem = mem
        self.path = path
        self.ref = BufRef.__new__(BufRef)
        PyObject_GetBuffer(mem, &self.ref.view, PyBUF_WRITABLE)
        self.ref.held = True
        if self.ref.view.len < 64 + 64 * <Py_ssize_t>nslots:
            raise ValueError("the recorder's memory is too small")
        memset(self.ref.view.buf, 0, 64 + 64 * <size_t>nslots)
        self.hdr = <ucxcomm_trace_hdr *>self.ref.view.buf
        self.recs = <ucxcomm_rec *>(<char *>self.ref.view.buf + 64)
        self.nslots = nslots
        self.hdr.version = trace.VERSION
        self.hdr.nslots = nslots
        self.hdr.pid = pid
        self.hdr.rank = rank
        self.hdr.size = size
        self.hdr.t_open = _now_ns()
        memcpy(self.hdr.magic, <const char *>trace.MAGIC, 8)  # (last: now readable)
        if nslots == 0:  # (off: nothing recorded, snapshot() empty)
            self.close()

    def close(self):
        """Stop recording (the memory stays the caller's to unmap or delete;
        :meth:`snapshot` returns the last records from now on)."""
        if self.nslots == 0:
            return
        self.last = self.snapshot()
        self.nslots = 0
        self.hdr = NULL
        self.recs = NULL
        self.ref = None

    cdef uint64_t begin(self, int kind, int state, uint32_t cid, int crank, int csize,
                        int seq, int peer, int wpeer, int tag, uint64_t nbytes) noexcept:
        """Record an operation; its token (for :meth:`finish`), 0 when not recording.
        ``state`` DONE records one that finished within the call (end = start)."""
        cdef uint32_t slot, i, st
        cdef ucxcomm_rec *r
        if self.nslots == 0:
            return 0
        cdef uint64_t n = self.hdr.next + 1
        self.hdr.next = n
        slot = self.cursor
        st = self.recs[slot].state
        if st == ST_POSTED or st == ST_WAITING:  # (in flight: kept; find a free slot)
            for i in range(1, self.nslots):
                slot += 1
                if slot == self.nslots:
                    slot = 0
                st = self.recs[slot].state
                if st != ST_POSTED and st != ST_WAITING:
                    break
            else:
                slot = self.cursor
                self.hdr.lost += 1
        self.cursor = slot + 1 if slot + 1 < self.nslots else 0
        r = &self.recs[slot]
        ucxcomm_publish(&r.n, 0)
        if state >= ST_DONE:
            r.t0 = _coarse_ns()
            r.t1 = r.t0
        else:
            r.t0 = _now_ns()
            r.t1 = 0
        r.nbytes = nbytes
        r.cid = cid
        r.seq = seq
        r.tag = tag
        r.peer = peer
        r.wpeer = wpeer
        r.crank = crank
        r.csize = csize
        r.kind = <uint16_t>kind
        r.state = <uint8_t>state
        r.flags = 0
        ucxcomm_publish(&r.n, n)
        return (n << 16) | slot

    cdef void finish(self, uint64_t token, int state) noexcept:
        """The operation of ``token`` ended in ``state`` (nothing if its record was
        overwritten since)."""
        cdef ucxcomm_rec *r
        if self.nslots == 0 or token == 0 or (token & 0xFFFF) >= self.nslots:
            return
        r = &self.recs[token & 0xFFFF]
        if r.n != (token >> 16):
            return
        r.t1 = _now_ns()
        r.state = <uint8_t>state

    def start(self, kind, int state, uint32_t cid, int crank, int csize, int seq=-1,
              int peer=-2, int wpeer=-2, int tag=-2, uint64_t nbytes=0):
        """Record an operation of ``kind`` (a name of ``trace.KINDS``) starting in
        ``state``; returns its token."""
        return self.begin(_KIND.get(kind, 0), state, cid, crank, csize, seq, peer, wpeer,
                          tag, nbytes)

    def end(self, uint64_t token, int state=ST_DONE):
        """The operation of ``token`` ended in ``state`` (DONE by default)."""
        self.finish(token, state)

    def seen(self, uint64_t token, fut):
        """The operation of ``token`` ended as the done future ``fut`` says: done,
        cancelled, or failed (a PeerFailure gets ``trace.note_failure``)."""
        if self.nslots == 0 or token == 0:
            return
        if fut.cancelled():
            self.finish(token, ST_CANCELLED)
            return
        exc = fut.exception()
        if exc is None:
            self.finish(token, ST_DONE)
        else:
            self.finish(token, ST_FAILED)
            note_failure(self, exc)

    def waiting(self, uint64_t token):
        """A blocking call now waits on the operation of ``token``."""
        cdef ucxcomm_rec *r
        if self.nslots == 0 or token == 0 or (token & 0xFFFF) >= self.nslots:
            return
        r = &self.recs[token & 0xFFFF]
        if r.n == (token >> 16) and r.state == ST_POSTED:
            r.state = ST_WAITING

    def snapshot(self):
        """A copy of the header and records (bytes; ``trace.parse`` reads it)."""
        if self.nslots == 0:
            return self.last or b""
        return (<char *>self.ref.view.buf)[:64 + 64 * <Py_ssize_t>self.nslots]


# ====================================================================== point-to-point
cdef class P2P:
    """A communicator's buffer point-to-point in one call into compiled code each:
    :meth:`send` for ``Send``/``Isend`` and :meth:`recv` for ``Recv``/``Irecv``, from
    the arguments as the user gave them.

    The common case (open communicator, ``int`` rank and tag in range, a connected
    endpoint; for receives a ``(source, tag)`` whose match the communicator has checked
    and cached before) goes straight to the engine; anything else goes to the
    communicator's Python path (``Comm._post_send``, ``Comm._recv_slow``), which checks,
    raises or connects, with the same results. The communicator is held weakly (it
    holds this object; a cycle would keep a dropped one and its scratch memory until
    the garbage collector runs)."""

    cdef TagEngine eng
    cdef object group
    cdef object world
    cdef list eps
    cdef dict cache
    cdef object kind
    cdef uint64_t base
    cdef Py_ssize_t size
    cdef object owner
    cdef Recorder rec
    cdef uint32_t cid
    cdef int crank
    cdef tuple members
    #: The flight record of the last call that returned a future (0: none): ended by
    #: the caller where it sees the future complete (``Comm.Send``/``Recv``, the
    #: ``Request`` of ``Isend``/``Irecv``), not by a done-callback (one would put a
    #: callback on the event loop's ready queue per message, and a waiter spinning in
    #: place gives way to the loop when it sees one: an event-loop round trip each).
    cdef public uint64_t token

    def __init__(self, comm):
        g = comm.group
        self.eng = g.transport.engine
        self.group = g
        self.world = g.world
        self.eps = g.eps
        self.cache = g.match_cache
        self.kind = KIND_P2P
        self.base = g.p2p_base
        self.size = g.size
        self.owner = weakref.ref(comm)
        self.rec = g.world.recorder
        self.cid = g.cid
        self.crank = g.rank
        self.members = tuple(g.members)

    cdef void _record(self, int kind, object peer, object tag, object res, bint wait):
        """The record of a send or receive whose call (a Python path's) returned
        ``res``: :meth:`_rec` once the rank and tag are known to be ints in range."""
        cdef int p = -2, t = -2
        if type(peer) is int and -1 <= <long long>peer < self.size:
            p = peer
        if type(tag) is int and -1 <= <long long>tag <= C_TAG_UB:
            t = tag
        self._rec(kind, p, t, res, wait)

    cdef inline void _rec(self, int kind, int p, int t, object res, bint wait):
        """The record of a send or receive to or from rank ``p`` (-1: any, -2: none)
        with tag ``t`` whose call returned ``res``: done (None, a Status), failed (a
        truncated result), else in flight (its token in :attr:`token`)."""
        cdef int state, w
        cdef uint64_t token
        cdef Recorder rec = self.rec
        if rec.nslots == 0:
            self.token = 0
            return
        if res is None or type(res) is Status:
            state = ST_DONE
        elif type(res) is tuple:
            state = ST_FAILED if res[1] > res[2] else ST_DONE
        else:
            state = ST_WAITING if wait else ST_POSTED
        w = p if (p < 0 or self.cid == 0) else <int>self.members[p]  # (world: the same)
        token = rec.begin(kind, state, self.cid, self.crank, <int>self.size, -1, p, w, t, 0)
        self.token = token if state < ST_DONE else 0

    def send(self, object obj, object dest, object tag):
        """Post the send of buffer ``obj`` to rank ``dest`` with ``tag``: None when it
        completed at once, else its future."""
        cdef int dover = 0, tover = 0
        cdef long long d, t
        cdef EpSend s
        if type(dest) is int and type(tag) is int and not self.group.closed \
                and not self.world.closed:
            d = PyLong_AsLongLongAndOverflow(dest, &dover)
            t = PyLong_AsLongLongAndOverflow(tag, &tover)
            if not (dover or tover) and 0 <= d < self.size and 0 <= t <= C_TAG_UB:
                ep = self.eps[d]
                if ep is not None:
                    sender = ep.sender
                    if type(sender) is EpSend:
                        s = <EpSend>sender
                        if not s.closed:
                            res = self.eng.c_send_ep(s, obj, self.base | <uint64_t>t)
                            self._rec(K_SEND, <int>d, <int>t, res, False)
                            return res
        res = self.owner()._post_send(obj, dest, tag)
        self._record(K_SEND, dest, tag, res, False)
        return res

    def recv(self, object obj, object source, object tag, bint spin, bint post):
        """Receive into buffer ``obj`` (``TagEngine.irecv`` with ``spin`` and ``post``):
        a :class:`Status` when the message was there and fitted, ``(sender_tag, nbytes,
        capacity)`` when the receive finished at once otherwise, else a future resolving
        to the Status (``recv_status``)."""
        if type(source) is int and type(tag) is int and not self.group.closed \
                and not self.world.closed:
            got = self.cache.get((self.kind, source, tag))
            if got is not None:
                m = <tuple>got
                res = self.eng.c_irecv(obj, m[0], m[1], m[2], RECV_STATUS, spin, post)
                # (a cached match: source and tag are ints in range)
                self._rec(K_RECV if spin else K_IRECV, <int>source, <int>tag, res, spin)
                return res
        res = self.owner()._recv_slow(obj, source, tag, spin, post)
        self._record(K_RECV if spin else K_IRECV, source, tag, res, spin)
        return res


cdef inline object _pending_send(object sends, object sent):
    """``sends`` (None or a list) with ``sent`` added when it is a future (a send that
    did not complete at once)."""
    if sent is None:
        return sends
    if sends is None:
        return [sent]
    sends.append(sent)
    return sends


# ====================================================================== small collectives
cdef class FastCollectives:
    """A communicator's small collectives, each in one call into compiled code, for 2 to
    ``SMALL_MAX_RANKS`` ranks (made by :class:`~ucxcomm.comm.collectives.Collectives`
    on the first call).

    Every method takes C-contiguous numpy arrays of plain data up to ``SMALL_MAX`` bytes
    per message and does what the Python paths of :mod:`ucxcomm.comm.small` do, with
    the same messages and tags (so ranks may mix the two): check the communicator is
    open, take the call's sequence number, send to every other rank (Bcast: the root
    only), receive from every other rank (each receive waits in place), then, for
    Allreduce and Reduce_scatter_block, fold the rows (one per rank, in a reused
    scratch) from the left in rank order, in C. Reductions are those
    :func:`native_kernel` maps to a kernel here (SUM of 32/64-bit floats and integers);
    the fold's order makes the result the same bits on every rank.

    A method returns ``None`` at once, having done nothing, for arguments it does not
    serve (the general path takes them and raises its errors); ``DONE`` when the call
    finished; otherwise ``(send futures, receive results or futures, sequence number,
    rows or None)`` for the caller to finish (``SmallCollectives.wait_rest``):
    ``rows``, a bytearray (reductions only), then holds rank ``q``'s contribution at
    ``q * nbytes`` once every receive is done (this rank's own is already there).
    """

    cdef TagEngine eng
    cdef list eps             # the EpSend of every other rank's endpoint, in rank order
    cdef list ranks           # their ranks
    cdef object rpeers        # every member (a receive fails if any dies)
    cdef int rank
    cdef int size
    cdef uint64_t stag0       # this rank's messages, sequence number 0
    cdef uint64_t ctx0        # the communicator's collective tags, source 0, sequence 0
    cdef object next_seq, check_open
    cdef Py_ssize_t small_max
    cdef object last_op, last_dt
    cdef int last_kind
    cdef Py_ssize_t last_size
    cdef object plain_dt      # the last dtype found to hold plain data
    cdef object rows          # bytearray(size * small_max), None after a hand-off
    cdef BufRef rows_ref
    cdef Recorder rec
    cdef uint32_t cid
    cdef tuple members
    # The checked exchange (fingerprints on: comm/fingerprint.py's combined form)
    cdef readonly bint check
    cdef Py_ssize_t row       # bytes per scratch row: the largest first message, rounded
    cdef object stage         # bytearray((2 * size + 1) * row), None after a hand-off
    cdef BufRef stage_ref
    cdef ucxcomm_fp fp        # this rank's fingerprint of the current call
    cdef uint32_t sum_code
    cdef object code_dt       # the dtype whose code is code_dt_val
    cdef uint32_t code_dt_val
    cdef Py_ssize_t code_dt_isz  # its itemsize
    cdef Py_ssize_t *lens     # each rank's message length in the current call

    def __init__(self, group):
        self.check = group.check
        self.lens = <Py_ssize_t *>PyMem_Malloc(group.size * sizeof(Py_ssize_t))
        if self.lens == NULL:
            raise MemoryError()
        self.row = (fingerprint.capacity(group.size) + 15) & ~15
        self.stage = None
        self.sum_code = fp_op_code(SUM)
        self.code_dt = None
        self.rec = group.world.recorder
        self.cid = group.cid
        self.members = tuple(group.members)
        self.eng = group.transport.engine
        self.rpeers = group.peers_all
        self.rank = group.rank
        self.size = group.size
        self.ctx0 = make_tag(group.cid, KIND_COLL, 0, 0)
        self.stag0 = make_tag(group.cid, KIND_COLL, self.rank, 0)
        self.next_seq = group.next_seq
        self.check_open = group.check_open
        self.small_max = SMALL_MAX
        self.ranks = [q for q in range(self.size) if q != self.rank]
        self.eps = [group.endpoint(q).sender for q in self.ranks]
        for ep in self.eps:
            if type(ep) is not EpSend:
                raise TypeError("FastCollectives needs the engine's endpoints")

    # ------------------------------------------------------------ helpers
    cdef object _done(self, int kind, object seq, int root, Py_ssize_t nbytes):
        """Record a collective that finished within the call; DONE."""
        self.rec.begin(kind, ST_DONE, self.cid, self.rank, self.size, seq, root,
                       self.members[root] if root >= 0 else -2, -2, nbytes)
        return DONE

    cdef int _kernel(self, object op, object dt) except -1:
        """The reduction kernel for ``op`` on ``dt`` (0: not served); sets last_size."""
        if op is not self.last_op or dt is not self.last_dt:
            kind, size = native_kernel(op, dt)
            self.last_kind = kind
            self.last_size = size
            self.last_op = op
            self.last_dt = dt
        return self.last_kind

    cdef bint _plain(self, object dt) except -1:
        if dt is self.plain_dt:
            return True
        if dt.hasobject:
            return False
        self.plain_dt = dt
        return True

    cdef BufRef _view(self, object arr, int flags):
        """A held export of ``arr`` (C-contiguous), or None when it has none."""
        cdef BufRef ref = BufRef.__new__(BufRef)
        try:
            PyObject_GetBuffer(arr, &ref.view, flags | PyBUF_C_CONTIGUOUS)
        except (BufferError, TypeError, ValueError):
            return None
        ref.held = True
        return ref

    cdef uintptr_t _rows(self) except 0:
        if self.rows is None:
            self.rows = bytearray(self.size * self.small_max)
            self.rows_ref = BufRef.__new__(BufRef)
            PyObject_GetBuffer(self.rows, &self.rows_ref.view, PyBUF_WRITABLE)
            self.rows_ref.held = True
        return <uintptr_t>self.rows_ref.view.buf

    cdef bint _closed_ep(self) except -1:
        cdef EpSend ep
        for ep in self.eps:
            if ep.closed:
                return True
        return False

    cdef object _post_all(self, BufRef sref, uintptr_t sbase, Py_ssize_t sstep,
                          Py_ssize_t nb, uintptr_t rbase, object rkeep, object seq):
        """Send ``nb`` bytes at ``sbase + q * sstep`` to every other rank ``q``, then
        receive ``q``'s ``nb`` bytes into ``rbase + q * nb``, each waited for in place.
        None when every send completed and every message arrived whole, else ``(send
        futures, receive results or futures)`` (None for a receive that is done)."""
        cdef Op rop
        cdef EpSend ep
        cdef Py_ssize_t i, q
        cdef TagEngine eng = self.eng
        cdef uint64_t stag = self.stag0 | <uint64_t>seq
        cdef Py_ssize_t others = self.size - 1
        sends = None
        for i in range(others):
            ep = self.eps[i]
            q = self.ranks[i]
            sent = eng.c_send_to(ep.handle, sbase + q * sstep, <size_t>nb, sref, stag,
                                 ep.peers, ep.fast)
            sends = _pending_send(sends, sent)
        eng.c_check(self.rpeers)
        got = None
        for i in range(others):
            q = self.ranks[i]
            rop = self._recv_op(rbase + <uintptr_t>q * nb, <size_t>nb, rkeep, q, seq)
            res = eng.c_post_match(rop, True)
            if got is None and (type(res) is not tuple or rop.length != rop.cap):
                got = [None] * i  # (those before were whole)
            if got is not None:
                got.append(res)
        if sends is None and got is None:
            return None
        return ([] if sends is None else sends), ([] if got is None else got)

    cdef Op _recv_op(self, uintptr_t ptr, size_t cap, object keep, Py_ssize_t source,
                     object seq):
        return ptr_op(ptr, cap, keep, False,
                      self.ctx0 | (<uint64_t>source << SRC_SHIFT) | <uint64_t>seq,
                      FULL_MASK, self.rpeers)

    cdef object _rows_out(self, tuple res, object seq, bint rows):
        """What a call that must wait returns (the rows become the caller's)."""
        out = (res[0], res[1], seq, self.rows if rows else None)
        if rows:
            self.rows = None  # (receives may still write it)
            self.rows_ref = None
        return out

    cdef tuple _rsb_views(self, send, recv, op):
        """``(send view, recv view, block bytes)`` of a Reduce_scatter_block this class
        serves, else None."""
        cdef BufRef rref, sref
        cdef Py_ssize_t nb
        if type(recv) is not ndarray or type(send) is not ndarray:
            return None
        dt = recv.dtype
        if self._kernel(op, dt) == 0 or send.dtype is not dt or self._closed_ep():
            return None
        sref = self._view(send, PyBUF_SIMPLE)
        if sref is None:
            return None
        nb = sref.view.len // self.size
        if (sref.view.len % (self.size * self.last_size) or nb > self.small_max
                or <uintptr_t>sref.view.buf % <uintptr_t>self.last_size):
            return None
        rref = self._view(recv, PyBUF_WRITABLE)
        if (rref is None or rref.view.len < nb
                or <uintptr_t>rref.view.buf % <uintptr_t>self.last_size):
            return None
        return sref, rref, nb

    cdef tuple _copy_views(self, send, recv, bint split):
        """``(send view, recv view, block bytes)`` of an Allgather (``split`` false:
        ``send`` is one block) or Alltoall (``split``: ``send`` holds one block per rank)
        this class serves, else None."""
        cdef BufRef rref, sref
        cdef Py_ssize_t nb
        if type(recv) is not ndarray or type(send) is not ndarray:
            return None
        dt = recv.dtype
        if send.dtype is not dt or not self._plain(dt) or self._closed_ep():
            return None
        sref = self._view(send, PyBUF_SIMPLE)
        if sref is None:
            return None
        nb = sref.view.len // self.size if split else sref.view.len
        if nb > self.small_max or (split and sref.view.len % (self.size * sref.view.itemsize)):
            return None
        rref = self._view(recv, PyBUF_WRITABLE)
        if rref is None or rref.view.len != self.size * nb:
            return None
        return sref, rref, nb

    cdef BufRef _bcast_view(self, buf, root):
        """The view of a Bcast's buffer this class serves, else None."""
        cdef BufRef ref
        if (type(buf) is not ndarray or type(root) is not int
                or not 0 <= root < self.size):
            return None
        if not self._plain(buf.dtype) or self._closed_ep():
            return None
        ref = self._view(buf, PyBUF_SIMPLE if root == self.rank else PyBUF_WRITABLE)
        if ref is None or ref.view.len > self.small_max:
            return None
        return ref

    # ------------------------------------------------------------ the collectives
    cdef tuple _allreduce_args(self, send, recv, op):
        """``(send view, recv view)`` of an Allreduce this class serves, else None."""
        cdef BufRef rref, sref
        cdef int i
        if type(recv) is not ndarray:
            return None
        if send is IN_PLACE:
            send = recv
        elif type(send) is not ndarray:
            return None
        dt = recv.dtype
        if self._kernel(op, dt) == 0 or (send is not recv and send.dtype is not dt):
            return None
        if self._closed_ep():
            return None
        rref = self._view(recv, PyBUF_WRITABLE)
        if rref is None:
            return None
        cdef Py_ssize_t n = rref.view.len
        if (n > self.small_max or n >= TUNING[RING_KEY]
                or <uintptr_t>rref.view.buf % <uintptr_t>self.last_size):
            return None
        sref = self._view(send, PyBUF_SIMPLE)
        if (sref is None or sref.view.len != n or sref.view.ndim != rref.view.ndim
                or <uintptr_t>sref.view.buf % <uintptr_t>self.last_size):
            return None
        for i in range(rref.view.ndim):
            if sref.view.shape[i] != rref.view.shape[i]:
                return None
        return sref, rref

    cdef object _fold_blocks(self, BufRef sref, BufRef rref, Py_ssize_t nb, bint split):
        """Allreduce (``split`` false: all of ``sref`` from every rank) or
        Reduce_scatter_block (block ``q`` of ``sref`` to rank ``q``), ``nb`` bytes per
        rank: rows of every rank's contribution, folded in rank order into ``rref``."""
        cdef uintptr_t base
        cdef Py_ssize_t own = self.rank * nb if split else 0
        self.check_open()
        seq = self.next_seq()
        base = self._rows()
        memmove(<char *>base + self.rank * nb, <const char *>sref.view.buf + own, nb)
        res = self._post_all(sref, <uintptr_t>sref.view.buf, nb if split else 0, nb, base,
                             self.rows_ref, seq)
        if res is None:
            _sum_rows(self.last_kind, <const char *>base, self.size, nb,
                      <char *>rref.view.buf)
            return self._done(K_RSB if split else K_ALLREDUCE, seq, -2, nb)
        return self._rows_out(res, seq, True)

    cdef object _copy_blocks(self, BufRef sref, BufRef rref, Py_ssize_t nb, bint split):
        """Allgather (``split`` false: ``sref`` is one block, to every rank) or Alltoall
        (block ``q`` of ``sref`` to rank ``q``): rank ``q``'s block into block ``q`` of
        ``rref``."""
        cdef Py_ssize_t own = self.rank * nb if split else 0
        self.check_open()
        seq = self.next_seq()
        memmove(<char *>rref.view.buf + self.rank * nb, <const char *>sref.view.buf + own,
                nb)
        res = self._post_all(sref, <uintptr_t>sref.view.buf, nb if split else 0, nb,
                             <uintptr_t>rref.view.buf, rref, seq)
        if res is None:
            return self._done(K_ALLTOALL if split else K_ALLGATHER, seq, -2, nb)
        return self._rows_out(res, seq, False)

    def allreduce(self, send, recv, op):
        """``Allreduce(send, recv, op)`` (``send`` may be IN_PLACE)."""
        if self.check:
            return self._checked_blocking(K_ALLREDUCE, send, recv, op, -1)
        args = self._allreduce_args(send, recv, op)
        if args is None:
            return None
        return self._fold_blocks(args[0], args[1], (<BufRef>args[1]).view.len, False)

    def reduce_scatter_block(self, send, recv, op):
        """``Reduce_scatter_block(send, recv, op)``: block ``q`` of ``send`` to rank
        ``q``; this rank's block of every rank's folded into the start of ``recv``."""
        if self.check:
            return self._checked_blocking(K_RSB, send, recv, op, -1)
        args = self._rsb_views(send, recv, op)
        if args is None:
            return None
        return self._fold_blocks(args[0], args[1], args[2], True)

    def allgather(self, send, recv):
        """``Allgather(send, recv)``: every rank's block in rank order in ``recv``."""
        if self.check:
            return self._checked_blocking(K_ALLGATHER, send, recv, None, -1)
        args = self._copy_views(send, recv, False)
        if args is None:
            return None
        return self._copy_blocks(args[0], args[1], args[2], False)

    def alltoall(self, send, recv):
        """``Alltoall(send, recv)``: block ``q`` of ``send`` to rank ``q``, its block for
        this rank into block ``q`` of ``recv``."""
        args = self._copy_views(send, recv, True)
        if args is None:
            return None
        return self._copy_blocks(args[0], args[1], args[2], True)

    def bcast(self, buf, root):
        """``Bcast(buf, root)``: the root sends to every rank, the others receive in
        place."""
        cdef Op rop
        cdef EpSend ep
        cdef TagEngine eng = self.eng
        if self.check:
            return self._checked_blocking(K_BCAST, buf, buf, None, root)
        cdef BufRef ref = self._bcast_view(buf, root)
        if ref is None:
            return None
        cdef bint sender = root == self.rank
        self.check_open()
        seq = self.next_seq()
        if sender:
            sends = []
            for ep in self.eps:
                sent = eng.c_send_to(ep.handle, <uintptr_t>ref.view.buf,
                                     <size_t>ref.view.len, ref, self.stag0 | <uint64_t>seq,
                                     ep.peers, ep.fast)
                if sent is not None:
                    sends.append(sent)
            if not sends:
                return self._done(K_BCAST, seq, root, ref.view.len)
            return (sends, [], seq, None)
        eng.c_check(self.rpeers)
        rop = self._recv_op(<uintptr_t>ref.view.buf, <size_t>ref.view.len, ref, root, seq)
        got = eng.c_post_match(rop, True)
        if type(got) is tuple and rop.length == rop.cap:
            return self._done(K_BCAST, seq, root, ref.view.len)
        return ([], [got], seq, None)

    # ------------------------------------------------- the checked exchange
    cdef object _checked_blocking(self, int kind, send, recv, op, root):
        """A blocking call's checked exchange, for the arguments this class serves
        (C-contiguous numpy arrays of plain data, SUM of 32/64-bit numbers for the
        reductions); None for the others (the Python paths check them and call
        :meth:`exchange`). DONE, or a :class:`Pending`."""
        cdef BufRef sref, rref
        cdef Py_ssize_t nb, n
        if type(recv) is not ndarray:
            return None
        if send is IN_PLACE:
            if kind != K_ALLREDUCE:
                return None
            send = recv
        elif type(send) is not ndarray:
            return None
        dt = recv.dtype
        if send.dtype is not dt:
            return None
        if kind == K_ALLREDUCE or kind == K_RSB:
            if self._kernel(op, dt) == 0:  # (a kernel's dtype is plain)
                return None
        elif not self._plain(dt):
            return None
        if kind == K_BCAST:
            if type(root) is not int or not 0 <= root < self.size:
                return None
            sref = rref = self._view(recv, PyBUF_SIMPLE if root == self.rank
                                     else PyBUF_WRITABLE)
            if sref is None:
                return None
            nb = sref.view.len
        else:
            sref = self._view(send, PyBUF_SIMPLE)
            rref = self._view(recv, PyBUF_WRITABLE)
            if sref is None or rref is None:
                return None
            n = sref.view.len
            if kind == K_ALLREDUCE:
                if rref.view.len != n or n >= TUNING[RING_KEY]:
                    return None
                nb = n
            elif kind == K_ALLGATHER:
                nb = n
                if rref.view.len != self.size * nb:
                    return None
            else:  # Alltoall, Reduce_scatter_block: one block per rank
                if n % (self.size * sref.view.itemsize):
                    return None
                nb = n // self.size
                if kind == K_ALLTOALL and rref.view.len != n:
                    return None
                if kind == K_RSB and rref.view.len < nb:
                    return None
        if nb > self.small_max:
            return None
        return self._xchg(kind, sref, rref, nb, -1 if kind != K_BCAST else root,
                          self.sum_code if kind == K_ALLREDUCE or kind == K_RSB else 0,
                          dt, self.last_kind if kind == K_ALLREDUCE or kind == K_RSB else 0,
                          -2)

    def exchange(self, kind, send, recv, int root, op):
        """The checked exchange of collective ``kind`` (a name of ``trace.KIND``) on
        flat host arrays the caller checked (``send`` may be ``recv``): DONE, or a
        :class:`Pending` (a reduction ``op`` without a compiled kernel: the caller
        folds)."""
        cdef int k = _KIND[kind]
        cdef BufRef sref = self._view(send, PyBUF_SIMPLE)
        cdef BufRef rref = self._view(recv, PyBUF_WRITABLE) if (k != K_BCAST
                                                                 or root != self.rank) else sref
        if sref is None or rref is None:
            raise ValueError(f"{kind}: the buffers must be C-contiguous")
        cdef Py_ssize_t nb = sref.view.len
        if k == K_ALLTOALL or k == K_RSB:
            nb //= self.size
        if k == K_BARRIER:
            return self._xchg(k, sref, rref, 0, -1, 0, None, 0, -1)
        cdef int kernel = self._kernel(op, send.dtype) if op is not None else 0
        return self._xchg(k, sref, rref, nb, root, fp_op_code(op) if op is not None else 0,
                          send.dtype, kernel, send.size)

    cdef uintptr_t _stage_base(self) except 0:
        if self.stage is None:
            self.stage = bytearray((2 * self.size + 1) * self.row)
            self.stage_ref = BufRef.__new__(BufRef)
            PyObject_GetBuffer(self.stage, &self.stage_ref.view, PyBUF_WRITABLE)
            self.stage_ref.held = True
        return <uintptr_t>self.stage_ref.view.buf

    cdef object _xchg(self, int kind, BufRef sref, BufRef rref, Py_ssize_t nb, int root,
                      uint32_t opc, object dt, int kernel, Py_ssize_t count):
        """Send this rank's fingerprint and data (``comm/fingerprint.py``'s combined
        form) to every other rank, receive every other rank's into scratch rows, check
        them, then copy or fold into ``rref``."""
        cdef EpSend ep
        cdef TagEngine eng = self.eng
        cdef Py_ssize_t i, q, p = self.size, me = self.rank, row = self.row
        cdef Py_ssize_t slen
        cdef uintptr_t base, src
        cdef const char *sbuf = <const char *>sref.view.buf
        cdef bint split = kind == K_ALLTOALL or kind == K_RSB
        if dt is not self.code_dt:
            self.code_dt_val = fp_dtype_code(dt)
            self.code_dt_isz = dt.itemsize if dt is not None else 1
            self.code_dt = dt
        if count == -2:  # the send buffer's elements
            count = sref.view.len // self.code_dt_isz
        self.check_open()
        seq = self.next_seq()
        base = self._stage_base()
        self.fp.magic = 0xC5
        self.fp.form = 2
        self.fp.kind = <uint8_t>kind
        self.fp.device = 0
        self.fp.op = opc
        self.fp.root = root
        self.fp.dtype = self.code_dt_val
        self.fp.count = count
        self.fp.own = -1
        cdef uint64_t stag = self.stag0 | <uint64_t>seq
        cdef uintptr_t shared = base + <uintptr_t>(2 * p * row)
        memcpy(<void *>shared, &self.fp, FP_HDR)
        slen = FP_HDR
        if kind == K_BCAST:
            if me == root:
                memcpy(<char *>shared + FP_HDR, sbuf, nb)
                slen += nb
        elif not split:
            memcpy(<char *>shared + FP_HDR, sbuf, nb)
            slen += nb
        sends = None
        try:
            for i in range(p - 1):
                ep = self.eps[i]
                q = self.ranks[i]
                if split:
                    src = base + <uintptr_t>((p + q) * row)
                    memcpy(<void *>src, &self.fp, FP_HDR)
                    memcpy(<char *>src + FP_HDR, sbuf + q * nb, nb)
                    sent = eng.c_send_to(ep.handle, src, <size_t>(FP_HDR + nb), self.stage_ref,
                                         stag, ep.peers, ep.fast)
                else:
                    sent = eng.c_send_to(ep.handle, shared, <size_t>slen, self.stage_ref, stag,
                                         ep.peers, ep.fast)
                sends = _pending_send(sends, sent)
            # this rank's own part, where the rows are read
            if kind == K_ALLREDUCE:
                memcpy(<char *>base + me * row + FP_HDR, sbuf, nb)
            elif kind == K_RSB:
                memcpy(<char *>base + me * row + FP_HDR, sbuf + me * nb, nb)
            recvs = self._recv_rows(base, seq)
        except BaseException:  # (operations may be posted on the scratch: not reused)
            self.stage = None
            self.stage_ref = None
            raise
        if recvs is None and sends is None and (kernel != 0 or not (
                kind == K_ALLREDUCE or kind == K_RSB)):
            self._settle(kind, <char *>base, self.lens, &self.fp, rref, sref, nb, root,
                         kernel, seq)
            return self._done(kind, seq, root if kind == K_BCAST else -2, nb)
        cdef Pending pend = self._pending(sends, recvs, seq, kind)
        pend.kernel = kernel
        pend.root = root
        pend.nb = nb
        pend.fp = self.fp
        pend.rref = rref
        pend.sref = sref
        return pend

    cdef object _recv_rows(self, uintptr_t base, object seq):
        """Receive every other rank's first message of call ``seq`` into its scratch row
        (``self.lens``: the lengths of those that arrived, -1 for the others); None when
        all arrived, else the futures (rank order, None where arrived)."""
        cdef Op rop
        cdef Py_ssize_t i, q, p = self.size, row = self.row
        cdef TagEngine eng = self.eng
        eng.c_check(self.rpeers)
        self.lens[self.rank] = 0  # (this rank's own: not received)
        recvs = None
        for i in range(p - 1):
            q = self.ranks[i]
            rop = self._recv_op(base + <uintptr_t>(q * row), <size_t>row, self.stage_ref, q,
                                seq)
            res = eng.c_post_match(rop, True)
            if type(res) is tuple:
                self.lens[q] = <Py_ssize_t>rop.length
            else:
                self.lens[q] = -1
                if recvs is None:
                    recvs = [None] * p
                recvs[q] = res
        return recvs

    cdef Pending _pending(self, object sends, object recvs, object seq, int kind):
        """The call's operations and scratch, handed to the caller (who finishes it)."""
        cdef Py_ssize_t i, p = self.size
        cdef Pending pend = Pending.__new__(Pending)
        pend.owner = self
        pend.sends = [] if sends is None else sends
        pend.recvs = [None] * p if recvs is None else recvs
        pend.seq = seq
        pend.kind = kind
        pend.stage = self.stage
        pend.stage_ref = self.stage_ref
        pend.lens = [self.lens[i] for i in range(p)]
        self.stage = None  # (the caller finishes with it; operations may still use it)
        self.stage_ref = None
        return pend

    def check_round(self, bytes fp, seq, what):
        """The general form's round of fingerprints (``comm/fingerprint.py``) of a call
        that took sequence number ``seq``: ``fp`` to every other rank, every other
        rank's first message into scratch; DONE when all equal ``fp``, else a
        :class:`Pending` (operations to wait for, or fingerprints that differ: its
        ``finish`` asks ``fingerprint.verdict``)."""
        cdef EpSend ep
        cdef TagEngine eng = self.eng
        cdef Py_ssize_t i, p = self.size, row = self.row, n = len(fp)
        cdef uintptr_t base
        if n > row:
            raise ValueError(f"{what}: a fingerprint of {n} bytes (at most {row})")
        self.check_open()
        base = self._stage_base()
        cdef uintptr_t shared = base + <uintptr_t>(2 * p * row)
        memcpy(<void *>shared, <const char *>fp, n)
        cdef uint64_t stag = self.stag0 | <uint64_t>seq
        sends = None
        try:
            for i in range(p - 1):
                ep = self.eps[i]
                sent = eng.c_send_to(ep.handle, shared, <size_t>n, self.stage_ref, stag,
                                     ep.peers, ep.fast)
                sends = _pending_send(sends, sent)
            recvs = self._recv_rows(base, seq)
        except BaseException:  # (operations may be posted on the scratch: not reused)
            self.stage = None
            self.stage_ref = None
            raise
        if recvs is None and sends is None and n == FP_HDR:
            if self._same_fp(<char *>base, self.lens, fp):
                return DONE
        cdef Pending pend = self._pending(sends, recvs, seq, -1)
        pend.what = what
        pend.fpbytes = fp
        return pend

    cdef bint _same_fp(self, char *base, Py_ssize_t *lens, bytes fp):
        cdef Py_ssize_t q, n = len(fp)
        cdef const char *f = <const char *>fp
        for q in range(self.size):
            if q != self.rank and (lens[q] != n or memcmp(base + q * self.row, f, n) != 0):
                return False
        return True

    cdef int _verdict(self, char *base, Py_ssize_t *lens, bytes fp, object seq,
                      object what) except -1:
        """Fingerprints that differ: what ``fingerprint.verdict`` says of them (it
        raises, or finds them compatible: per-rank counts)."""
        cdef Py_ssize_t q, n, row = self.row
        fps = []
        for q in range(self.size):
            if q == self.rank:
                fps.append(fp)
            else:
                n = max(0, min(lens[q], row))
                fps.append(base[q * row:q * row + n])
        err = fp_verdict(fps, what, seq)
        if err is not None:
            raise err
        return 0

    cdef int _settle(self, int kind, char *base, Py_ssize_t *lens, ucxcomm_fp *fp,
                     BufRef rref, BufRef sref, Py_ssize_t nb, int root, int kernel,
                     object seq) except -1:
        """Check every rank's message (``lens``: their lengths), then copy or fold:
        0 done, 1 the caller folds (a reduction without a kernel)."""
        cdef Py_ssize_t q, p = self.size, me = self.rank, row = self.row, want
        cdef char *out = <char *>rref.view.buf
        cdef const char *own = <const char *>sref.view.buf
        for q in range(p):
            if q == me:
                continue
            want = FP_HDR + (0 if kind == K_BCAST and q != root else nb)
            if lens[q] != want or memcmp(base + q * row, fp, FP_HDR) != 0:
                self._mismatch(kind, base, lens, fp, seq)
        if kind == K_BCAST:
            if me != root:
                memcpy(out, base + root * row + FP_HDR, nb)
        elif kind == K_BARRIER:
            pass
        elif kind == K_ALLGATHER or kind == K_ALLTOALL:
            for q in range(p):
                if q != me:
                    memcpy(out + q * nb, base + q * row + FP_HDR, nb)
            memmove(out + me * nb, own + (me * nb if kind == K_ALLTOALL else 0), nb)
        else:
            if kernel == 0:
                return 1
            _sum_strided(kernel, base + FP_HDR, row, <int>p, nb, base + 2 * p * row + FP_HDR)
            memcpy(out, base + 2 * p * row + FP_HDR, nb)
        return 0

    cdef int _mismatch(self, int kind, char *base, Py_ssize_t *lens, ucxcomm_fp *fp,
                       object seq) except -1:
        cdef Py_ssize_t q, n, row = self.row
        fps = []
        for q in range(self.size):
            if q == self.rank:
                fps.append((<char *>fp)[:FP_HDR])
            else:
                n = max(0, min(lens[q], row))
                fps.append(base[q * row:q * row + n])
        what = trace.KINDS[kind]
        err = fp_verdict(fps, what, seq)
        if err is None:
            err = CollectiveMismatch(
                f"collective #{seq}, {what}: a message of unexpected length arrived "
                f"(lengths {[lens[q] for q in range(self.size)]})", seq=seq)
        raise err

    def __dealloc__(self):
        if self.lens != NULL:
            PyMem_Free(self.lens)


cdef class Pending:
    """A checked exchange (``FastCollectives.exchange``) still in flight, or one whose
    reduction the caller folds: ``sends`` and ``recvs`` (futures; None for a receive
    done in the call) to wait for, then :meth:`finish`."""

    cdef readonly list sends
    cdef readonly list recvs
    cdef readonly object seq
    cdef list lens
    cdef FastCollectives owner
    cdef int kind, kernel, root
    cdef Py_ssize_t nb
    cdef ucxcomm_fp fp
    cdef object stage
    cdef BufRef stage_ref
    cdef BufRef rref
    cdef BufRef sref
    cdef object what          # a check round's (kind -1): the collective's name
    cdef bytes fpbytes        # a check round's: this rank's fingerprint

    @property
    def kind(self):
        return trace.KINDS[self.kind] if self.kind >= 0 else self.what

    def release(self):
        """Give the scratch back for the next call (every operation of this one is
        complete, and the caller is done with the rows)."""
        o = self.owner
        if self.stage is not None and o.stage is None:
            o.stage = self.stage
            o.stage_ref = self.stage_ref
        self.stage = None
        self.stage_ref = None

    def finish(self):
        """After every send and receive completed: check every rank's fingerprint, then
        copy or fold. Returns None, or, for a reduction without a compiled kernel, the
        rows (a ``(size, nbytes)`` uint8 array, rank order) for the caller to fold.
        Raises CollectiveMismatch."""
        cdef FastCollectives o = self.owner
        cdef Py_ssize_t q, p = o.size
        if self.stage_ref is None:
            raise RuntimeError("this exchange was finished already")
        cdef Py_ssize_t *lens = <Py_ssize_t *>PyMem_Malloc(p * sizeof(Py_ssize_t))
        if lens == NULL:
            raise MemoryError()
        try:
            for q in range(p):
                fut = self.recvs[q]
                lens[q] = fut.result()[1] if fut is not None else self.lens[q]
            try:
                if self.kind < 0:  # a check round (per-rank counts: the verdict's rules)
                    if (len(self.fpbytes) != FP_HDR
                            or not o._same_fp(<char *>self.stage_ref.view.buf, lens,
                                              self.fpbytes)):
                        o._verdict(<char *>self.stage_ref.view.buf, lens, self.fpbytes,
                                   self.seq, self.what)
                    done = True
                else:
                    done = o._settle(self.kind, <char *>self.stage_ref.view.buf, lens,
                                     &self.fp, self.rref, self.sref, self.nb, self.root,
                                     self.kernel, self.seq) == 0
            except BaseException:
                self.release()
                raise
            if done:
                self.release()
                return None
        finally:
            PyMem_Free(lens)
        row = o.row
        arr = np.frombuffer(self.stage, np.uint8, p * row).reshape(p, row)
        return arr[:, FP_HDR:FP_HDR + self.nb]
