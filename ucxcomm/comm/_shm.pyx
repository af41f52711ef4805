# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The node's shared-memory collective engine (see :mod:`ucxcomm.comm.shm`).

Each rank of a communicator whose ranks all run on one host owns one segment (a file
under ``/dev/shm`` that every member maps): a header, a ring of arrival records and a
ring of data slots. A collective call is one :class:`Call`, advanced by
:meth:`Call.advance` until it is done; a rank has at most one Call of a Node under way
(``comm/shm.py`` queues the others):

* **record**: the rank writes its record (the call's fingerprint, the first step of its
  pieces and how many it writes) into the ring entry of the call's generation, once
  every member has finished with the entry's previous record.
* **pieces**: each rank that has input for others writes it piece by piece into its
  slots: piece ``s`` (counted over the rank's life) goes to slot ``s % nslots`` once
  every reader of the slot's previous piece has consumed it or finished that piece's
  call (each member counts, in its own header, the pieces it consumed of every writer;
  the writer remembers who reads each slot's piece: maybe an earlier call's root, not
  this call's), then ``written = s + 1`` is published. Writing needs nobody's record: a
  rank's pieces are out before its peers arrive.
* **check**: with the checks on, the rank reads every member's record of the
  generation: all match, or the Python side raises the verdict. Only then does it write
  into the user's buffer: it copies (or folds, in rank order) the pieces it needs out
  of the writers' slots, as they appear. A call returns once its pieces are written,
  its records checked and its reads done.

Counters are 64-bit words on their own cache lines, written with release and read with
acquire ordering. Nothing here waits without bound: :meth:`Call.advance` spins at most
its budget and reports that it is blocked; the Python side then checks for failures and
comes back. Nothing read from a peer's segment is trusted for a length: every copy is
bounded by this rank's own buffers and the slot size.
"""

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ucxcomm.comm._kernels cimport sum_into

cdef extern from *:
    """
    static inline unsigned long long ucxcomm_shm_ld(const unsigned long long *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void ucxcomm_shm_st(unsigned long long *p, unsigned long long v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    """
    unsigned long long ld "ucxcomm_shm_ld"(const unsigned long long *p) nogil
    void st "ucxcomm_shm_st"(unsigned long long *p, unsigned long long v) nogil

cdef extern from "<sched.h>":
    int sched_yield() nogil

cdef extern from "<unistd.h>":
    int getpid() nogil

cdef extern from "<sys/uio.h>":
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long liovcnt,
                             const iovec *remote, unsigned long riovcnt,
                             unsigned long flags) nogil
    ssize_t process_vm_writev(int pid, const iovec *local, unsigned long liovcnt,
                              const iovec *remote, unsigned long riovcnt,
                              unsigned long flags) nogil

cdef extern from "<errno.h>":
    int errno

import numpy as np

# ------------------------------------------------------------------ segment layout
#: Segment header fields (u64 words; each counter on a cache line of its own).
MAGIC = 0x75637873686D3031  # "ucxshm01"
cdef uint64_t C_MAGIC = MAGIC
cdef enum:
    OFF_MAGIC = 0        # written last by the creator
    OFF_RANK = 8
    OFF_SIZE = 16
    OFF_SLOT = 24
    OFF_NSLOTS = 32
    OFF_ACKED = 64       # every record of a generation <= this is done with here
    OFF_WRITTEN = 128    # pieces this rank has written
    OFF_MAPPED = 192     # 1 once this rank has mapped every member's segment
    OFF_PID = 256        # this rank's process id
    OFF_SELF = 320       # where this rank maps its own segment (its virtual address)
    OFF_DIRECT = 384     # 1: this rank can read every member's memory (CMA); 2: cannot
    OFF_CONSUMED = 1024  # + 64 k: pieces of member k this rank has consumed (32 words)
    OFF_DDONE = 3072     # + 64 k: the last call whose data this rank read from member
                         # k's own buffer (single-copy mode; 32 words)
    OFF_DPUSH = 5120     # + 64 k: the last call whose share this rank wrote straight
                         # into member k's buffer (single-copy mode, pushed; 32 words)
    OFF_RECS = 8192
    NREC = 4
    REC_BYTES = 2048
    REC_GEN = 0          # the record's generation (written last)
    REC_STEPS = 8        # pieces the rank writes in this call
    REC_FPLEN = 16
    REC_BASE = 40        # its first piece's number
    REC_NBYTES = 48      # the bytes of its call (n)
    REC_OFF = 56         # with a verdict: 1 when every member stops using the engine
    REC_DIRECT = 64      # 1: the rank asks for single-copy mode (and can read others)
    REC_ADDR = 72        # single-copy mode: where its data is, in its address space
    REC_RADDR = 80       # single-copy mode: where its output goes (a writer pushes there)
    REC_PUSH = 88        # 1: the rank asks that writers push a share (see Call._split)
    REC_ABORT = 24       # generation whose verdict follows (written after the text)
    REC_TEXTLEN = 32
    REC_FP = 128
    FP_MAX = 896
    REC_TEXT = 1024
    TEXT_MAX = 1024
    OFF_DATA = 16384
    MAXP = 32

#: Bytes of a segment's header and record ring (the data slots follow).
DATA_OFFSET = OFF_DATA
#: Largest fingerprint a record holds.
FINGERPRINT_MAX = FP_MAX
#: Largest verdict text a record holds.
VERDICT_MAX = TEXT_MAX

# ---------------------------------------------------------------------- call kinds
cdef enum:
    K_BCAST = 1
    K_ALLGATHER = 2
    K_ALLTOALL = 3
    K_ALLREDUCE = 4
    K_RSB = 5
    K_GATHER = 6
    K_SCATTER = 7
    K_REDUCE = 8
KINDS = {"Bcast": K_BCAST, "Allgather": K_ALLGATHER, "Alltoall": K_ALLTOALL,
         "Allreduce": K_ALLREDUCE, "Reduce_scatter_block": K_RSB, "Gather": K_GATHER,
         "Scatter": K_SCATTER, "Reduce": K_REDUCE}

#: What :meth:`Call.advance` returns.
DONE = 0
BLOCKED = 1
MISMATCH = 2   # every record is in and they differ, or a member passed this generation
ABORTED = 3    # a member published a verdict for this generation
TRUNCATED = 4  # done, but (checks off) a writer's message was longer than this rank's
               # buffer: its pieces were consumed and nothing was written


cdef inline uint64_t *word(char *base, Py_ssize_t off) noexcept nogil:
    return <uint64_t *>(base + off)


cdef char *_address(object arr) except NULL:
    """The first byte of a C-contiguous array (its buffer, released at once: the call
    keeps the array alive)."""
    cdef Py_buffer v
    PyObject_GetBuffer(arr, &v, PyBUF_SIMPLE)
    cdef char *out = <char *>v.buf
    PyBuffer_Release(&v)
    return out if out != NULL else <char *>1


cdef inline int64_t now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class Node:
    """This rank's view of the communicator's segments: its own (created by the Python
    side) and its peers' (attached as they appear). ``slot``: bytes per data slot,
    ``nslots``: slots per segment."""

    cdef readonly int rank, size, nslots
    cdef readonly Py_ssize_t slot
    cdef char **bases
    cdef Py_buffer *views
    cdef list owners
    cdef readonly uint64_t pieces      # pieces this rank has written (its written word)
    cdef public bint spin_yield
    #: Bytes a message needs (single-copy mode, Bcast, Scatter and Gather) before this
    #: rank asks writers to push a share of it (see Call._split; 0: never).
    cdef public Py_ssize_t push_min
    #: Bytes this rank has pushed into its readers' buffers (for tests and diagnostics).
    cdef readonly uint64_t pushed
    # Of the piece in each of this rank's slots: the members that read it (a bit each)
    # and its call's generation. The slot comes free once those members consumed it or
    # finished that call, whoever reads the next piece (see Call._free).
    cdef uint64_t *slot_readers
    cdef uint64_t *slot_gen

    def __cinit__(self):
        self.bases = NULL
        self.views = NULL
        self.slot_readers = NULL
        self.slot_gen = NULL

    def __init__(self, int rank, int size, Py_ssize_t slot, int nslots, object own):
        if not (0 <= rank < size <= MAXP) or slot < 4096 or slot % 64 or nslots < 2:
            raise ValueError("shared-memory engine: bad geometry")
        self.rank, self.size, self.slot, self.nslots = rank, size, slot, nslots
        self.bases = <char **>PyMem_Malloc(size * sizeof(char *))
        self.views = <Py_buffer *>PyMem_Malloc(size * sizeof(Py_buffer))
        self.slot_readers = <uint64_t *>PyMem_Malloc(nslots * sizeof(uint64_t))
        self.slot_gen = <uint64_t *>PyMem_Malloc(nslots * sizeof(uint64_t))
        if (self.bases == NULL or self.views == NULL or self.slot_readers == NULL
                or self.slot_gen == NULL):
            raise MemoryError()
        memset(self.bases, 0, size * sizeof(char *))
        memset(self.slot_readers, 0, nslots * sizeof(uint64_t))
        memset(self.slot_gen, 0, nslots * sizeof(uint64_t))
        self.owners = [None] * size
        self.pieces = 0
        self.spin_yield = False
        self.push_min = 0
        self.pushed = 0
        self._hold(rank, own, True)
        cdef char *b = self.bases[rank]
        word(b, OFF_RANK)[0] = rank
        word(b, OFF_SIZE)[0] = size
        word(b, OFF_SLOT)[0] = slot
        word(b, OFF_NSLOTS)[0] = nslots
        word(b, OFF_PID)[0] = getpid()
        word(b, OFF_SELF)[0] = <uint64_t><size_t>b
        st(<unsigned long long *>word(b, OFF_MAGIC), C_MAGIC)

    cdef _hold(self, int k, object mem, bint writable):
        PyObject_GetBuffer(mem, &self.views[k], PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
        if self.views[k].len < self.total():
            PyBuffer_Release(&self.views[k])
            raise ValueError("shared-memory segment too small")
        self.bases[k] = <char *>self.views[k].buf
        self.owners[k] = mem

    def total(self):
        """Bytes of one segment."""
        return OFF_DATA + self.slot * self.nslots

    def attach(self, int k, object mem):
        """Map peer ``k``'s segment (``mem``: a writable buffer over it); False while
        its creator has not finished it (or it is not a segment of this geometry)."""
        if self.bases[k] != NULL:
            return True
        cdef Py_buffer v
        PyObject_GetBuffer(mem, &v, PyBUF_WRITABLE)
        cdef char *b = <char *>v.buf
        ok = (v.len >= self.total() and ld(<unsigned long long *>word(b, OFF_MAGIC)) == C_MAGIC
              and word(b, OFF_RANK)[0] == <uint64_t>k and word(b, OFF_SIZE)[0] == <uint64_t>self.size
              and word(b, OFF_SLOT)[0] == <uint64_t>self.slot
              and word(b, OFF_NSLOTS)[0] == <uint64_t>self.nslots)
        PyBuffer_Release(&v)
        if not ok:
            return False
        self._hold(k, mem, True)
        for j in range(self.size):
            if self.bases[j] == NULL:
                return True
        st(<unsigned long long *>word(self.bases[self.rank], OFF_MAPPED), 1)
        return True

    def attached(self, int k):
        return self.bases[k] != NULL

    def probe_direct(self):
        """Whether this rank can read every member's memory with ``process_vm_readv``
        (CMA: ptrace permission; Docker's default seccomp profile or
        ``kernel.yama.ptrace_scope`` may forbid it): each member's magic read through
        its own mapping's address. Published for the members (every segment mapped
        first); single-copy mode needs every member's yes."""
        cdef uint64_t got
        cdef iovec local, remote
        cdef bint ok = True
        cdef char *b
        for k in range(self.size):
            b = self.bases[k]
            if k == self.rank or b == NULL:
                ok = ok and b != NULL
                continue
            got = 0
            local.iov_base = &got
            local.iov_len = 8
            remote.iov_base = <void *><size_t>(word(b, OFF_SELF)[0] + OFF_MAGIC)
            remote.iov_len = 8
            if process_vm_readv(<int>word(b, OFF_PID)[0], &local, 1, &remote, 1, 0) != 8 \
                    or got != C_MAGIC:
                ok = False
        st(<unsigned long long *>word(self.bases[self.rank], OFF_DIRECT), 1 if ok else 2)
        return ok

    def refuse_direct(self):
        """This rank takes no single-copy call (``UCXCOMM_SHM_DIRECT=no``)."""
        st(<unsigned long long *>word(self.bases[self.rank], OFF_DIRECT), 2)

    def direct_ok(self):
        """Whether this rank found it can read every member's memory."""
        return ld(<unsigned long long *>word(self.bases[self.rank], OFF_DIRECT)) == 1

    def everyone_mapped(self):
        """Whether every member has mapped every segment (names can go)."""
        for k in range(self.size):
            if self.bases[k] == NULL or ld(<unsigned long long *>word(self.bases[k], OFF_MAPPED)) != 1:
                return False
        return True

    def release(self):
        """Let go of every segment (the owners' buffers can then be closed)."""
        if self.bases == NULL:
            return
        for k in range(self.size):
            if self.bases[k] != NULL:
                self.bases[k] = NULL
                PyBuffer_Release(&self.views[k])
        self.owners = [None] * self.size

    def __dealloc__(self):
        if self.bases != NULL:
            self.release()
            PyMem_Free(self.bases)
            self.bases = NULL
        if self.views != NULL:
            PyMem_Free(self.views)
            self.views = NULL
        PyMem_Free(self.slot_readers)
        self.slot_readers = NULL
        PyMem_Free(self.slot_gen)
        self.slot_gen = NULL

    def acked(self, int k):
        """Member ``k``'s acked generation (0 before it attached)."""
        return 0 if self.bases[k] == NULL else ld(<unsigned long long *>word(self.bases[k], OFF_ACKED))

    cdef char *_entry(self, int k, uint64_t gen, Py_ssize_t field) noexcept:
        """Member ``k``'s record entry of generation ``gen`` when its word ``field``
        names that generation (its record, or its verdict), else NULL."""
        cdef char *b = self.bases[k]
        if b == NULL:
            return NULL
        cdef char *rec = b + OFF_RECS + (gen % NREC) * REC_BYTES
        return rec if ld(<unsigned long long *>word(rec, field)) == gen else NULL

    def record_fp(self, int k, uint64_t gen):
        """Member ``k``'s fingerprint of generation ``gen``, or None."""
        cdef char *rec = self._entry(k, gen, REC_GEN)
        if rec == NULL:
            return None
        cdef uint64_t n = word(rec, REC_FPLEN)[0]
        return (rec + REC_FP)[:min(n, <uint64_t>FP_MAX)]

    def verdict_text(self, int k, uint64_t gen):
        """``(text, off)`` of the verdict member ``k`` published for generation ``gen``
        (``off``: the engine is off for the communicator from now on), or None."""
        cdef char *rec = self._entry(k, gen, REC_ABORT)
        if rec == NULL:
            return None
        cdef uint64_t n = word(rec, REC_TEXTLEN)[0]
        return ((rec + REC_TEXT)[:min(n, <uint64_t>TEXT_MAX)].decode("utf-8", "replace"),
                bool(word(rec, REC_OFF)[0]))

    def publish_verdict(self, uint64_t gen, bytes text, bint off=False):
        """Write this rank's verdict of generation ``gen`` (its peers raise it too), with
        or without its record (a member's segment missing: no record could be written)."""
        cdef char *rec = self.bases[self.rank] + OFF_RECS + (gen % NREC) * REC_BYTES
        cdef Py_ssize_t n = min(len(text), <Py_ssize_t>TEXT_MAX)
        memcpy(rec + REC_TEXT, <char *>text, n)
        word(rec, REC_TEXTLEN)[0] = n
        word(rec, REC_OFF)[0] = off
        st(<unsigned long long *>word(rec, REC_ABORT), gen)

    def ack(self, uint64_t gen):
        """This rank is done with every record of generation ``gen`` and before."""
        cdef unsigned long long *w = <unsigned long long *>word(self.bases[self.rank], OFF_ACKED)
        if ld(w) < gen:
            st(w, gen)


cdef class Call:
    """One collective call on the engine: made by the Python side with the call's
    geometry, then :meth:`advance`\ d until DONE."""

    cdef Node node
    cdef readonly uint64_t gen
    cdef bytes fp
    cdef int kind, root, kernel, fold_kinds, writes, reads, folds_own
    cdef uint64_t readers
    cdef readonly int stage          # 0: record not written, 1: under way, 2: done
    cdef readonly bint verified
    cdef bint differ, truncated, want_direct, direct, deferred, want_push, push, pushed
    cdef bint own_src  # (Reduce_scatter_block) fold this rank's own block from its input
    cdef uint64_t dmask
    cdef uint64_t mine_steps, tw, tr, base, have_rec, need_rec, full_mask, writers
    cdef uint64_t kbase[MAXP]
    cdef uint64_t ksteps[MAXP]
    cdef uint64_t ktr[MAXP]
    cdef char *send
    cdef char *recv
    cdef Py_ssize_t n, piece, itemsize
    cdef object keep, ufunc, dtype, recv_arr
    cdef list seg_arrs
    cdef bint check

    def __init__(self, Node node, uint64_t gen, str kind, object fp, object send,
                 object recv, Py_ssize_t n, int root, int kernel, object ufunc,
                 bint direct=False):
        """``fp``: this rank's fingerprint (None: checks off); ``send``/``recv``:
        C-contiguous numpy arrays of one dtype (where a rank has no buffer of one kind,
        its other one: never written); ``n``: bytes (Bcast, Allreduce, Reduce: the
        whole buffer; the others: one rank's block);
        ``kernel``: the compiled SUM kernel (0: fold with ``ufunc``); ``direct``: ask
        for single-copy mode (the copying collectives: each reader copies straight
        out of the writer's buffer with ``process_vm_readv``, and the writer returns
        once every reader is done; taken when every member asks and can). Acknowledges
        every record before ``gen`` (this rank is past those calls: a rank makes one
        Call at a time per Node, :meth:`ucxcomm.comm.shm.NodeShm.start` holding later
        ones back until it is over, for the Calls share ``pieces``, the slots and the
        records)."""
        self._setup(node, gen, KINDS[kind], fp, send, _address(send), recv, _address(recv),
                    recv.dtype, n, root, kernel, ufunc, direct)

    cdef int _setup(self, Node node, uint64_t gen, int kind, object fp, object send,
                    char *sp, object recv, char *rp, object dt, Py_ssize_t n, int root,
                    int kernel, object ufunc, bint direct) except -1:
        """:meth:`__init__` with the arrays' first bytes (``sp``, ``rp``) and ``recv``'s
        dtype ``dt`` known (:class:`Entry` has them)."""
        cdef int p = node.size, r = node.rank, k
        self.check = fp is not None
        self.fp = fp if self.check else b""
        if len(self.fp) > FP_MAX:
            raise ValueError("fingerprint too long for the shared-memory engine")
        self.node, self.gen = node, gen
        self.kind = kind
        self.root, self.n, self.itemsize, self.kernel = root, n, dt.itemsize, kernel
        self.ufunc, self.dtype = ufunc, dt
        self.keep = (send, recv)
        self.send = sp
        self.recv = rp
        self.recv_arr = recv
        node.ack(gen - 1)
        cdef Py_ssize_t itemsize = self.itemsize
        cdef Py_ssize_t per = node.slot
        if self.kind == K_ALLTOALL or self.kind == K_RSB or self.kind == K_SCATTER:
            per = node.slot // p
        per -= per % 64
        if itemsize > 1:
            per -= per % itemsize
        if per <= 0:
            raise ValueError("shared-memory slot too small for this call")
        self.piece = per
        self.fold_kinds = (self.kind == K_ALLREDUCE or self.kind == K_RSB
                           or self.kind == K_REDUCE)
        self.full_mask = (<uint64_t>1 << p) - 1 if p < 64 else <uint64_t>0xFFFFFFFFFFFFFFFF
        # Who writes pieces, and whose records this rank needs: every member's with the
        # checks on; else those of the writers it reads.
        # Who writes pieces, who reads them, and whether this rank reads (or folds).
        cdef uint64_t others = self.full_mask & ~(<uint64_t>1 << r)
        cdef bint rooted = self.kind == K_BCAST or self.kind == K_SCATTER
        if rooted:  # the root writes, the others read
            self.writers = <uint64_t>1 << root
            self.reads = r != root
            self.readers = self.full_mask & ~(<uint64_t>1 << root)
        elif self.kind == K_GATHER:  # the others write, the root reads
            self.writers = self.full_mask & ~(<uint64_t>1 << root)
            self.reads = r == root
            self.readers = <uint64_t>1 << root
        elif self.kind == K_REDUCE:  # everyone writes, the root folds
            self.writers = self.full_mask
            self.reads = r == root
            self.readers = <uint64_t>1 << root
        else:
            self.writers = self.full_mask
            self.reads = True
            self.readers = self.full_mask
        self.folds_own = self.fold_kinds and self.reads
        # A Reduce_scatter_block folds its own block straight from its input (nobody
        # else reads it, so it is not copied into the slots) unless the output lies in
        # the input (in place: the partial sums would overwrite it before it is read).
        self.own_src = (self.kind == K_RSB and n > 0
                        and (sp + p * n <= rp or rp + n <= sp))
        self.readers &= others
        self.writes = (self.writers >> r) & 1
        steps = (n + per - 1) // per if n > 0 else 0
        self.mine_steps = steps if self.writes else 0
        if self.check:
            self.need_rec = self.full_mask
        elif not self.reads:
            self.need_rec = 0
        elif rooted:
            self.need_rec = self.writers
        else:
            self.need_rec = self.full_mask
        self.want_direct = direct and not self.fold_kinds and ld(
            <unsigned long long *>word(node.bases[r], OFF_DIRECT)) == 1
        if self.want_direct:
            self.need_rec = self.full_mask  # (the mode is every member's choice)
        self.deferred = self.want_direct  # (no pieces before the mode is known)
        self.direct = False
        # Pushed shares: where the writers would otherwise wait idle for their readers
        # (a Bcast root, a Gather's others; a Scatter root copies its own block
        # meanwhile, as long as each reader's read: nothing to even out there).
        self.want_push = (self.want_direct and node.push_min > 0 and n >= node.push_min
                          and (self.kind == K_BCAST or self.kind == K_GATHER))
        self.push = self.pushed = False
        self.dmask = 0
        self.need_rec &= ~(<uint64_t>1 << r)
        self.have_rec = 0
        self.seg_arrs = None
        self.stage = 0
        self.verified = False
        self.differ = False
        self.truncated = False
        self.tw = self.tr = 0
        for k in range(p):
            self.ktr[k] = 0
            self.ksteps[k] = 0
            self.kbase[k] = 0
        return 0

    @property
    def progress(self):
        """A count that rises whenever the call moves (a record, a piece written or
        read): a waiter that sees it rise is not waiting for a late member."""
        cdef uint64_t out = self.stage + self.have_rec + self.tw + self.tr + self.dmask
        cdef int k
        for k in range(self.node.size):
            out += self.ktr[k]
        return out

    def fingerprints(self):
        """Each member's fingerprint of this generation (None: not in)."""
        return [self.node.record_fp(k, self.gen) for k in range(self.node.size)]

    def passed(self):
        """Members that moved past this generation without a record of it (they took
        another path for this call)."""
        out = []
        for k in range(self.node.size):
            if (k != self.node.rank and self.node.record_fp(k, self.gen) is None
                    and self.node.acked(k) >= self.gen):
                out.append(k)
        return out

    def missing(self):
        """Members whose record of this generation is not in yet."""
        return [k for k in range(self.node.size)
                if k != self.node.rank and self.node.record_fp(k, self.gen) is None]

    def aborted(self):
        """``(member, verdict, off)`` of a member that published one for this
        generation (see :meth:`Node.verdict_text`)."""
        for k in range(self.node.size):
            if k != self.node.rank:
                got = self.node.verdict_text(k, self.gen)
                if got is not None:
                    return k, got[0], got[1]
        return None

    cpdef int advance(self, int64_t budget_ns) except -1:
        """Go as far as the other members allow, spinning up to ``budget_ns``: DONE,
        BLOCKED, MISMATCH or ABORTED."""
        cdef int64_t end = now_ns() + budget_ns
        cdef uint64_t spins = 0
        cdef int r
        while True:
            r = self._try()
            if r != BLOCKED:
                return r
            spins += 1
            if self.node.spin_yield:
                sched_yield()
            if (spins & 31) == 0 or budget_ns <= 0:
                if now_ns() >= end:
                    return BLOCKED

    cdef int _try(self) except -1:
        cdef int r
        if self.stage == 2:
            return DONE
        if self.stage == 0:
            if not self._record():
                return BLOCKED
            self.stage = 1
        self._write()
        if not self.verified:
            r = self._records()
            if r != DONE:
                return r
        if self._read() == BLOCKED or self.tw < self.mine_steps:
            return BLOCKED
        self.stage = 2
        self.keep = None
        self.recv_arr = None
        self.node.ack(self.gen)
        return TRUNCATED if self.truncated else DONE

    cdef bint _record(self) noexcept:
        """Write this rank's record once its ring entry is free (False: not yet)."""
        cdef Node node = self.node
        cdef int k, p = node.size
        cdef char *rec = node.bases[node.rank] + OFF_RECS + (self.gen % NREC) * REC_BYTES
        cdef uint64_t old = ld(<unsigned long long *>word(rec, REC_GEN))
        for k in range(p):  # (a first record needs no peer: a member that cannot map
            if k == node.rank or old == 0:  # segments still learns of this call)
                continue
            if node.bases[k] == NULL or ld(<unsigned long long *>word(node.bases[k], OFF_ACKED)) < old:
                return False
        self.base = node.pieces
        # Its own pieces before this call are folded or abandoned (a call that stopped
        # at a mismatch): counted consumed, or its ring would wait for them forever.
        st(<unsigned long long *>word(node.bases[node.rank], OFF_CONSUMED + 64 * node.rank),
           self.base)
        memcpy(rec + REC_FP, <char *>self.fp, len(self.fp))
        word(rec, REC_FPLEN)[0] = len(self.fp)
        word(rec, REC_STEPS)[0] = self.mine_steps
        word(rec, REC_BASE)[0] = self.base
        word(rec, REC_NBYTES)[0] = self.n
        word(rec, REC_DIRECT)[0] = self.want_direct
        word(rec, REC_PUSH)[0] = self.want_push
        word(rec, REC_RADDR)[0] = <uint64_t><size_t>self.recv
        word(rec, REC_ADDR)[0] = <uint64_t><size_t>(self.recv if self.kind == K_BCAST else self.send)
        st(<unsigned long long *>word(rec, REC_GEN), self.gen)
        return True

    cdef void _write(self) noexcept:
        """Write this rank's pieces while slots are free (nobody's record needed)."""
        cdef Node node = self.node
        cdef int k, j, p = node.size, r = node.rank
        cdef char *mine = node.bases[r]
        cdef char *slot
        cdef uint64_t s, i
        cdef Py_ssize_t off, ln
        if self.deferred:
            return
        while self.tw < self.mine_steps:
            s = self.base + self.tw
            i = s % <uint64_t>node.nslots
            if s >= <uint64_t>node.nslots and not self._free(s, i):
                return
            slot = mine + OFF_DATA + i * node.slot
            off = <Py_ssize_t>self.tw * self.piece
            ln = self._len(self.tw)
            if ln > 0:
                if self.kind == K_BCAST:
                    memcpy(slot, self.recv + off, ln)
                elif (self.kind == K_ALLGATHER or self.kind == K_ALLREDUCE
                      or self.kind == K_GATHER or self.kind == K_REDUCE):
                    memcpy(slot, self.send + off, ln)
                else:  # Alltoall, Scatter (the others' blocks); Reduce_scatter_block (all)
                    for j in range(p):
                        if j != r or (self.kind == K_RSB and not self.own_src):
                            memcpy(slot + j * self.piece, self.send + j * self.n + off, ln)
            node.slot_readers[i] = self.readers | (<uint64_t>self.folds_own << r)
            node.slot_gen[i] = self.gen
            node.pieces = s + 1
            st(<unsigned long long *>word(mine, OFF_WRITTEN), s + 1)
            self.tw += 1
            if not self.folds_own:  # (nobody here reads its own pieces)
                st(<unsigned long long *>word(mine, OFF_CONSUMED + 64 * r), s + 1)

    cdef bint _free(self, uint64_t s, uint64_t i) noexcept:
        """Whether slot ``i`` may take this rank's piece ``s``: every reader of the piece
        now in it (``s - nslots``, maybe of an earlier call, whose readers may not be
        this call's: a Reduce or Gather to another root) consumed it, or finished its
        call (or gave it up: a mismatch). The readers of this call have no say: a member
        that reads nothing of the old piece counts it consumed as soon as it reads this
        call's record, while the old piece's reader may still be folding it."""
        cdef Node node = self.node
        cdef int k, r = node.rank
        cdef uint64_t need = s + 1 - node.nslots
        cdef uint64_t mask = node.slot_readers[i]
        cdef uint64_t gen = node.slot_gen[i]
        cdef char *b
        for k in range(node.size):
            if not ((mask >> k) & 1):
                continue
            b = node.bases[k]
            if b == NULL:
                return False
            if (ld(<unsigned long long *>word(b, OFF_CONSUMED + 64 * r)) < need
                    and ld(<unsigned long long *>word(b, OFF_ACKED)) < gen):
                return False
        return True

    cdef int _records(self) except -1:
        """Read the records this rank needs: DONE once all are in and match (then the
        own-block copies are made), else BLOCKED, MISMATCH or ABORTED."""
        cdef Node node = self.node
        cdef int k, p = node.size, r = node.rank
        cdef char *b
        cdef char *theirs
        cdef uint64_t bit
        cdef bint aborted = False
        for k in range(p):
            bit = <uint64_t>1 << k
            if not (self.need_rec & bit):
                continue
            b = node.bases[k]
            if b == NULL:
                continue  # (not mapped yet: its record is missing)
            theirs = b + OFF_RECS + (self.gen % NREC) * REC_BYTES
            if ld(<unsigned long long *>word(theirs, REC_ABORT)) == self.gen:
                aborted = True
            if self.have_rec & bit:
                continue
            if ld(<unsigned long long *>word(theirs, REC_GEN)) != self.gen:
                if ld(<unsigned long long *>word(b, OFF_ACKED)) >= self.gen:
                    return MISMATCH  # it passed this call on another path
                continue
            if self.check and (word(theirs, REC_FPLEN)[0] != <uint64_t>len(self.fp) or memcmp(
                    theirs + REC_FP, <char *>self.fp, len(self.fp)) != 0):
                self.differ = True  # (the verdict waits for every record)
                self.have_rec |= bit
                continue
            if not self.check and ((self.writers >> k) & 1) and word(theirs, REC_NBYTES)[0] > <uint64_t>self.n:
                self.truncated = True  # (its pieces are consumed, unwritten: then raise)
            self.kbase[k] = word(theirs, REC_BASE)[0]
            # (a peer's count bounds nothing here: reads stop at this rank's own sizes)
            self.ksteps[k] = min(word(theirs, REC_STEPS)[0], <uint64_t>node.nslots << 32)
            self.have_rec |= bit
            # Its pieces before this call are abandoned (a call that stopped at a
            # mismatch) or consumed: count them consumed.
            st(<unsigned long long *>word(node.bases[r], OFF_CONSUMED + 64 * k), self.kbase[k])
        # Every record in: this rank's own verdict (the same as every member's);
        # else a member's published verdict (it saw a member on another path).
        if self.have_rec != self.need_rec:
            return ABORTED if aborted else BLOCKED
        if self.differ:
            return MISMATCH
        if aborted:
            return ABORTED
        if self.writes:
            self.kbase[r] = self.base
            self.ksteps[r] = self.mine_steps
        if self.want_direct:
            self.direct = True
            self.push = self.want_push
            for k in range(p):
                if k == r:
                    continue
                theirs = node.bases[k] + OFF_RECS + (self.gen % NREC) * REC_BYTES
                if not word(theirs, REC_DIRECT)[0]:
                    self.direct = False
                if not word(theirs, REC_PUSH)[0]:
                    self.push = False  # (every member's choice, as the mode is)
            self.push = self.push and self.direct
            self.deferred = False
            if self.direct:
                self.mine_steps = 0
                for k in range(p):
                    self.ksteps[k] = 0
            else:
                self._write()
        self.verified = True
        if not self.truncated:
            self._begin()
        return DONE

    cdef void _begin(self) noexcept:
        """The copies of this rank's own block that need nobody."""
        cdef int r = self.node.rank
        if ((self.kind == K_ALLGATHER or (self.kind == K_GATHER and r == self.root))
                and self.send != self.recv + r * self.n):
            memcpy(self.recv + r * self.n, self.send, self.n)
        elif self.kind == K_ALLTOALL and self.send != self.recv:
            memcpy(self.recv + r * self.n, self.send + r * self.n, self.n)
        elif (self.kind == K_SCATTER and r == self.root
              and self.recv != self.send + r * self.n):
            memcpy(self.recv, self.send + r * self.n, self.n)

    cdef inline Py_ssize_t _len(self, uint64_t t) noexcept:
        cdef Py_ssize_t off = <Py_ssize_t>t * self.piece
        if off >= self.n:
            return 0
        return min(self.piece, self.n - off)

    cdef inline char *_slot_of(self, int k, uint64_t s) noexcept:
        return self.node.bases[k] + OFF_DATA + (s % <uint64_t>self.node.nslots) * self.node.slot

    cdef int _read(self) except -1:
        """Copy (or fold) the pieces this rank needs as their writers publish them."""
        cdef Node node = self.node
        cdef int k, p = node.size, r = node.rank
        cdef uint64_t s, t
        cdef char *mine = node.bases[r]
        cdef char *theirs
        cdef Py_ssize_t off, ln
        cdef bint blocked = False
        if self.fold_kinds:
            return self._fold_all() if self.reads else DONE
        if self.direct:
            return self._direct()
        if not self.reads:
            return DONE
        for k in range(p):
            if k == r or not ((self.writers >> k) & 1):
                continue
            while self.ktr[k] < self.ksteps[k]:
                t = self.ktr[k]
                s = self.kbase[k] + t
                if ld(<unsigned long long *>word(node.bases[k], OFF_WRITTEN)) <= s:
                    blocked = True
                    break
                theirs = self._slot_of(k, s)
                ln = 0 if self.truncated else self._len(t)
                off = <Py_ssize_t>t * self.piece
                if ln > 0:
                    if self.kind == K_BCAST:
                        memcpy(self.recv + off, theirs, ln)
                    elif self.kind == K_ALLGATHER or self.kind == K_GATHER:
                        memcpy(self.recv + k * self.n + off, theirs, ln)
                    elif self.kind == K_SCATTER:
                        memcpy(self.recv + off, theirs + r * self.piece, ln)
                    else:
                        memcpy(self.recv + k * self.n + off, theirs + r * self.piece, ln)
                self.ktr[k] = t + 1
                st(<unsigned long long *>word(mine, OFF_CONSUMED + 64 * k), s + 1)
        return BLOCKED if blocked else DONE

    cdef int _direct(self) except -1:
        """Single-copy mode: read every writer's data straight out of its buffer (with
        pushed shares: the part the writer does not write here itself), push this
        writer's shares into its readers' buffers, then wait until every reader of this
        rank's buffer is done with it and every share pushed here has come."""
        cdef Node node = self.node
        cdef int k, p = node.size, r = node.rank
        cdef char *rec
        cdef char *mine = node.bases[r]
        cdef uint64_t addr, theirs_n, off
        cdef Py_ssize_t ln
        cdef char *dst
        for k in range(p):
            if (not self.reads or k == r or not ((self.writers >> k) & 1)
                    or (self.dmask >> k) & 1):
                continue
            rec = node.bases[k] + OFF_RECS + (self.gen % NREC) * REC_BYTES
            addr = word(rec, REC_ADDR)[0]
            theirs_n = word(rec, REC_NBYTES)[0]  # (their block; bounds every read)
            off = 0
            ln = self.n
            dst = self.recv
            if self.kind == K_ALLGATHER or self.kind == K_GATHER:
                dst = self.recv + k * self.n
            elif self.kind == K_ALLTOALL:
                dst = self.recv + k * self.n
                off = <uint64_t>r * theirs_n
            elif self.kind == K_SCATTER:
                off = <uint64_t>r * theirs_n
            if <uint64_t>ln > theirs_n:
                ln = theirs_n
            if self.push:
                ln = self._split(ln)  # (the writer pushes the rest)
            if not self.truncated and ln > 0:
                self._cma(<int>word(node.bases[k], OFF_PID)[0], dst, addr + off, ln, k,
                          False)
            self.dmask |= <uint64_t>1 << k
            st(<unsigned long long *>word(mine, OFF_DDONE + 64 * k), self.gen)
        if self.writes and self.push and not self.pushed:
            self._push_all()
            self.pushed = True
        if self.writes:  # (this rank's buffer stays as it is until its readers are done)
            for k in range(p):
                if (self.readers >> k) & 1 and ld(<unsigned long long *>word(
                        node.bases[k], OFF_DDONE + 64 * r)) < self.gen:
                    return BLOCKED
        if self.reads and self.push:  # (the shares the writers push here)
            for k in range(p):
                if (k != r and (self.writers >> k) & 1 and ld(<unsigned long long *>word(
                        node.bases[k], OFF_DPUSH + 64 * r)) < self.gen):
                    return BLOCKED
        return DONE

    cdef inline Py_ssize_t _split(self, Py_ssize_t rn) noexcept:
        """Of a reader's ``rn`` bytes from one writer (pushed shares), the first ones,
        which the reader copies itself; the writer writes the rest into the reader's
        buffer meanwhile. Shares that even out the bytes each process copies: a Bcast
        root pushes 1/p of every reader's bytes (it has p - 1 readers, each reading the
        rest); a Gather writer pushes its whole block (its one reader copies its own
        block meanwhile, as long as a writer's push). A share under 4 KiB is not
        pushed. Both sides compute it from ``rn`` alone."""
        cdef Py_ssize_t p = self.node.size, h
        if self.kind == K_GATHER:
            h = 0
        else:
            h = (rn - rn // p) & ~(<Py_ssize_t>63)
        return rn if rn - h < 4096 else h

    cdef int _push_all(self) except -1:
        """Push this writer's share of every reader's bytes into the reader's buffer
        (``process_vm_writev``), then say so (``OFF_DPUSH``); a reader whose buffer is
        shorter than this rank's message (checks off: it raises TruncationError) gets
        nothing, only the word."""
        cdef Node node = self.node
        cdef int k, p = node.size, r = node.rank
        cdef char *rec
        cdef char *mine = node.bases[r]
        cdef char *src
        cdef uint64_t raddr, kn
        cdef Py_ssize_t h, rn = self.n
        for k in range(p):
            if not (self.readers >> k) & 1:
                continue
            rec = node.bases[k] + OFF_RECS + (self.gen % NREC) * REC_BYTES
            kn = word(rec, REC_NBYTES)[0]
            raddr = word(rec, REC_RADDR)[0]
            if kn >= <uint64_t>rn and rn > 0:
                h = self._split(rn)
                if self.kind == K_BCAST:
                    src = self.recv
                else:  # Gather: into the root's block of this rank
                    src = self.send
                    raddr += <uint64_t>r * kn
                if rn > h:
                    self._cma(<int>word(node.bases[k], OFF_PID)[0], src + h, raddr + h,
                              rn - h, k, True)
                    node.pushed += <uint64_t>(rn - h)
            st(<unsigned long long *>word(mine, OFF_DPUSH + 64 * k), self.gen)
        return 0

    cdef int _cma(self, int pid, char *buf, uint64_t addr, Py_ssize_t ln, int k,
                  bint push) except -1:
        """Copy ``ln`` bytes between ``buf`` here and ``addr`` in member ``k``'s address
        space (process ``pid``): read them (``process_vm_readv``), or write them there
        (``push``: ``process_vm_writev``)."""
        cdef iovec local, remote
        cdef ssize_t got
        cdef int err = 0
        with nogil:
            while ln > 0:
                local.iov_base = buf
                local.iov_len = ln
                remote.iov_base = <void *><size_t>addr
                remote.iov_len = ln
                if push:
                    got = process_vm_writev(pid, &local, 1, &remote, 1, 0)
                else:
                    got = process_vm_readv(pid, &local, 1, &remote, 1, 0)
                if got <= 0:
                    err = errno if got < 0 else 5
                    break
                buf += got
                addr += got
                ln -= got
        if err:
            what = "writing into" if push else "reading"
            call = "process_vm_writev" if push else "process_vm_readv"
            raise OSError(err, f"{what} member {k}'s buffer ({call})")
        return 0

    cdef int _fold_all(self) except -1:
        """Fold every member's piece of each step into the output, in rank order (the
        same bytes and order on every member: bit-identical results)."""
        cdef Node node = self.node
        cdef int k, p = node.size, r = node.rank
        cdef uint64_t t, s, most = 0
        cdef Py_ssize_t sub = r * self.piece if self.kind == K_RSB else 0
        cdef Py_ssize_t off, ln
        cdef char *mine = node.bases[r]
        cdef bint whole
        for k in range(p):
            if self.ksteps[k] > most:
                most = self.ksteps[k]
        while self.tr < most:
            t = self.tr
            whole = True
            for k in range(p):
                if t >= self.ksteps[k]:
                    whole = False  # (calls that differ, checks off: no result)
                    continue
                if ld(<unsigned long long *>word(node.bases[k], OFF_WRITTEN)) <= self.kbase[k] + t:
                    return BLOCKED
            ln = self._len(t)
            off = <Py_ssize_t>t * self.piece
            if whole and ln > 0 and not self.truncated:
                self._fold(t, off, ln, sub)
            for k in range(p):
                if t < self.ksteps[k]:
                    s = self.kbase[k] + t
                    st(<unsigned long long *>word(mine, OFF_CONSUMED + 64 * k), s + 1)
            self.tr = t + 1
        return DONE

    cdef inline char *_src(self, int k, uint64_t t, Py_ssize_t off, Py_ssize_t sub) noexcept:
        """Where member ``k``'s part of step ``t`` is: its slot, or this rank's own
        input (``own_src``)."""
        if self.own_src and k == self.node.rank:
            return self.send + k * self.n + off
        return self._slot_of(k, self.kbase[k] + t) + sub

    cdef int _fold(self, uint64_t t, Py_ssize_t off, Py_ssize_t ln, Py_ssize_t sub) except -1:
        cdef Node node = self.node
        cdef int k, p = node.size
        cdef char *out = self.recv + off
        if self.kernel:
            sum_into(self.kernel, self._src(0, t, off, sub), self._src(1, t, off, sub), out, ln)
            for k in range(2, p):
                sum_into(self.kernel, out, self._src(k, t, off, sub), out, ln)
            return 0
        if self.seg_arrs is None:
            self.seg_arrs = [np.frombuffer(node.owners[k], np.uint8) for k in range(p)]
        dt = self.dtype
        o = self.recv_arr.reshape(-1).view(np.uint8)[off:off + ln].view(dt)
        segs = self.seg_arrs
        views = []
        for k in range(p):
            if self.own_src and k == node.rank:
                so = k * self.n + off
                views.append(self.keep[0].reshape(-1).view(np.uint8)[so:so + ln].view(dt))
                continue
            so = OFF_DATA + ((self.kbase[k] + t) % <uint64_t>node.nslots) * node.slot + sub
            views.append(segs[k][so:so + ln].view(dt))
        self.ufunc(views[0], views[1], out=o)
        for k in range(2, p):
            self.ufunc(o, views[k], out=o)
        return 0


# ====================================================================== the lean entry
cdef object _ndarray = np.ndarray
cdef tuple _NAMES = (None, "Bcast", "Allgather", "Alltoall", "Allreduce",
                     "Reduce_scatter_block", "Gather", "Scatter", "Reduce")
cdef tuple _LIMITS = (None,) + tuple(f"shm_max_{k}" for k in _NAMES[1:])


cdef class Entry:
    """The engine's entry for plain numpy arrays, in one compiled call (``comm/shm.py``'s
    ``NodeShm.entry``; ``comm/collectives.py`` tries it first): each method checks its
    arguments as the Python entry does, takes the sequence number, makes the
    :class:`Call` and advances it. It returns ``done`` when the call finished, the
    rest to await (``NodeShm._after``) when it did not, or None, with nothing taken,
    where it does not serve the call (another kind of buffer or size, the engine busy
    with an earlier call, its segments not all mapped yet, or off): the Python entry
    then takes it, and gives the errors."""

    cdef object sh, group, next_seq, check_open, rec, done, make_fp, kernel_of, ufunc_of
    cdef object tuning, waiting, cid, last_op, last_dt, last_ufunc, tag_ub
    cdef int tag_bits
    cdef Node node
    cdef int rank, size, last_kernel
    cdef tuple members
    cdef int64_t budget
    cdef bint check, push, crowded
    cdef Py_ssize_t small_max
    cdef list fp_dt, fp_op, fp_val
    cdef Py_ssize_t fp_count[9]
    cdef int fp_root[9]

    def __init__(self, sh, Node node, group, recorder, done, make_fp, kernel_of, ufunc_of,
                 tuning, int64_t budget_ns, bint push, bint crowded, Py_ssize_t small_max,
                 waiting, tag_ub, int tag_bits):
        """``make_fp(what, op, root, dtype, count)``: a fingerprint of the engine's form;
        ``kernel_of(op, dtype)``: the compiled fold (0: none); ``ufunc_of(op, array)``:
        numpy's (None: not an Op; raises for a dtype the op does not take);
        ``tag_ub``, ``tag_bits``: the sequence numbers' range (a call's generation
        counts their wraps, as ``NodeShm.start`` does)."""
        self.tag_ub, self.tag_bits = tag_ub, tag_bits
        self.sh, self.node, self.group = sh, node, group
        self.next_seq, self.check_open = group.next_seq, group.check_open
        self.rec, self.done, self.make_fp = recorder, done, make_fp
        self.kernel_of, self.ufunc_of, self.tuning = kernel_of, ufunc_of, tuning
        self.budget, self.push, self.crowded = budget_ns, push, crowded
        self.small_max, self.waiting = small_max, waiting
        self.check = group.check
        self.rank, self.size, self.cid = group.rank, group.size, group.cid
        self.members = tuple(group.members)
        self.fp_dt, self.fp_op, self.fp_val = [None] * 9, [None] * 9, [None] * 9
        self.last_kernel = -1

    cdef char *_ptr(self, object arr, bint writable, Py_ssize_t *nbytes, Py_ssize_t *isz):
        """The first byte of ``arr`` when it is a C-contiguous numpy array of plain
        data (writable where asked), its bytes and item size; NULL: not one."""
        cdef Py_buffer v
        if type(arr) is not _ndarray or arr.dtype.hasobject:
            return NULL
        try:
            PyObject_GetBuffer(arr, &v, PyBUF_C_CONTIGUOUS
                               | (PyBUF_WRITABLE if writable else PyBUF_SIMPLE))
        except (BufferError, TypeError, ValueError):
            return NULL
        cdef char *out = <char *>v.buf
        nbytes[0], isz[0] = v.len, v.itemsize
        PyBuffer_Release(&v)
        return out if out != NULL else <char *>1

    cdef bint _fits(self, int kind, Py_ssize_t nbytes, bint fold) except -1:
        """Whether a message of ``nbytes`` is in the engine's range for ``kind``."""
        if nbytes <= (0 if kind >= K_GATHER else self.small_max):
            return False
        if nbytes > self.tuning[_LIMITS[kind]]:
            return False
        return not (fold and self.crowded and nbytes > self.tuning["shm_max_fold_crowded"])

    cdef object _fp(self, int kind, int root, object dt, Py_ssize_t count, object op):
        if (self.fp_dt[kind] is dt and self.fp_op[kind] is op and self.fp_root[kind] == root
                and self.fp_count[kind] == count):
            return self.fp_val[kind]
        fp = self.make_fp(_NAMES[kind], op, root, dt, count)
        self.fp_dt[kind], self.fp_op[kind], self.fp_val[kind] = dt, op, fp
        self.fp_root[kind], self.fp_count[kind] = root, count
        return fp

    cdef int _fold(self, object op, object arr) except -2:
        """The compiled fold of ``op`` on ``arr``'s dtype (0: numpy's, in
        ``last_ufunc``); -1: not an Op (the Python entry's error)."""
        dt = arr.dtype
        if op is not self.last_op or dt is not self.last_dt:
            ufunc = self.ufunc_of(op, arr)
            if ufunc is None:
                return -1
            self.last_kernel = self.kernel_of(op, dt)
            self.last_ufunc, self.last_op, self.last_dt = ufunc, op, dt
        return self.last_kernel

    cdef object _go(self, int kind, object send, char *sp, object recv, char *rp,
                    Py_ssize_t n, int root, object op, Py_ssize_t count, Py_ssize_t nbytes):
        cdef int kernel = 0
        cdef Call call
        sh = self.sh
        if (sh._busy is not None or not sh._mapped or sh._own_path is not None
                or sh.off is not None or sh._node is not self.node):
            return None
        ufunc = None
        if op is not None:
            kernel = self._fold(op, recv)
            if kernel < 0:
                return None
            ufunc = self.last_ufunc
        dt = recv.dtype
        fp = self._fp(kind, root, dt, count, op) if self.check else None
        self.check_open()
        seq = self.next_seq()
        gen = ((self.group.seq_wraps - (seq == self.tag_ub)) << self.tag_bits | seq) + 1
        self.node.push_min = self.tuning["shm_push_min"] if self.push else 0
        call = Call.__new__(Call)
        call._setup(self.node, gen, kind, fp, send, sp, recv, rp, dt, n, root, kernel,
                    ufunc, nbytes >= self.tuning["shm_direct_min"])
        st = call.advance(self.budget)
        what = _NAMES[kind]
        if st == DONE:  # (its flight record, as the compiled paths write)
            self.rec.end(self.rec.start(what, self.waiting, self.cid, self.rank, self.size,
                                        seq, root if root >= 0 else -2,
                                        self.members[root] if root >= 0 else -2))
            return self.done
        return sh._after(call, what, seq, fp, st)

    def bcast(self, buf, root):
        cdef Py_ssize_t nb, isz
        if type(root) is not int or not 0 <= root < self.size:
            return None
        cdef char *p = self._ptr(buf, root != self.rank, &nb, &isz)
        if p == NULL or not self._fits(K_BCAST, nb, False):
            return None
        return self._go(K_BCAST, buf, p, buf, p, nb, root, None, nb // isz, nb)

    def allgather(self, send, recv):
        cdef Py_ssize_t nb, rnb, isz, risz
        cdef char *sp = self._ptr(send, False, &nb, &isz)
        if sp == NULL or not self._fits(K_ALLGATHER, nb, False):
            return None
        cdef char *rp = self._ptr(recv, True, &rnb, &risz)
        if rp == NULL or rnb != nb * self.size or send.dtype is not recv.dtype:
            return None
        return self._go(K_ALLGATHER, send, sp, recv, rp, nb, -1, None, nb // isz, nb)

    def alltoall(self, send, recv):
        cdef Py_ssize_t nb, rnb, isz, risz
        cdef char *sp = self._ptr(send, False, &nb, &isz)
        if sp == NULL or nb % (self.size * isz):
            return None
        nb //= self.size
        if not self._fits(K_ALLTOALL, nb, False):
            return None
        cdef char *rp = self._ptr(recv, True, &rnb, &risz)
        if rp == NULL or rnb != nb * self.size or send.dtype is not recv.dtype:
            return None
        return self._go(K_ALLTOALL, send, sp, recv, rp, nb, -1, None, rnb // risz, nb)

    def reduce_scatter_block(self, send, recv, op):
        cdef Py_ssize_t nb, snb, isz, sisz
        cdef char *rp = self._ptr(recv, True, &nb, &isz)
        if rp == NULL or not self._fits(K_RSB, nb, True):
            return None
        cdef char *sp = self._ptr(send, False, &snb, &sisz)
        if sp == NULL or snb != nb * self.size or send.dtype is not recv.dtype:
            return None
        return self._go(K_RSB, send, sp, recv, rp, nb, -1, op, snb // sisz, nb)

    def allreduce(self, send, recv, op):
        cdef Py_ssize_t nb, snb, isz, sisz
        cdef char *rp = self._ptr(recv, True, &nb, &isz)
        if rp == NULL or not self._fits(K_ALLREDUCE, nb, True):
            return None
        if (self.size >= 4 and nb % (self.size * isz) == 0
                and nb >= self.tuning["shm_allreduce_stages_min"]):
            return None  # (two stages: the Python entry)
        cdef char *sp = rp
        if send is not recv:  # (IN_PLACE arrives as recv)
            sp = self._ptr(send, False, &snb, &sisz)
            if sp == NULL or snb != nb or send.dtype is not recv.dtype:
                return None
        return self._go(K_ALLREDUCE, send, sp, recv, rp, nb, -1, op, nb // isz, nb)

    cdef object _rooted(self, int kind, object mine, object other, object root,
                        object op, Py_ssize_t mult):
        """Gather, Scatter or Reduce: ``mine`` this rank's buffer (the block it sends;
        a Scatter's receive buffer), ``other`` the root's buffer of ``mult`` blocks
        (the receive buffer; a Scatter's send buffer)."""
        cdef Py_ssize_t nb, onb, isz, oisz
        cdef bint scatter = kind == K_SCATTER
        if type(root) is not int or not 0 <= root < self.size:
            return None
        cdef char *mp = self._ptr(mine, scatter, &nb, &isz)
        if mp == NULL or not self._fits(kind, nb, op is not None):
            return None
        if (kind == K_REDUCE and self.size >= 4 and nb % (self.size * isz) == 0
                and nb >= self.tuning["shm_reduce_stages_min"]):
            return None  # (two stages: the Python entry)
        cdef char *op_ = mp
        if root == self.rank:
            op_ = self._ptr(other, not scatter, &onb, &oisz)
            if op_ == NULL or onb != nb * mult or mine.dtype is not other.dtype:
                return None
        else:
            other = mine
        if scatter:
            return self._go(kind, other, op_, mine, mp, nb, root, op, nb // isz, nb)
        return self._go(kind, mine, mp, other, op_, nb, root, op, nb // isz, nb)

    def gather(self, send, recv, root):
        return self._rooted(K_GATHER, send, recv, root, None, self.size)

    def scatter(self, send, recv, root):
        return self._rooted(K_SCATTER, recv, send, root, None, self.size)

    def reduce(self, send, recv, op, root):
        return self._rooted(K_REDUCE, send, recv, root, op, 1)
