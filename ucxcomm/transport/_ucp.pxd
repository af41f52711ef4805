# cython: language_level=3
# The compiled engine's declarations (ucxcomm/transport/_ucp.pyx), for Cython code that
# uses it at C level: `from ucxcomm.transport._ucp cimport TagEngine, Op`. The .pyx has
# the implementations and their docstrings; _ucp.pyi the Python-level types.
#
# BufRef: a held buffer export. Op: one pending tag operation. TagEngine: the pending tag
# operations of one UCX worker. EpSend: one endpoint's compiled isend and its fields.
# Finish: a receive's finish function with a C-level result for a message that fitted
# (subclassed by ucxcomm/comm/_fast.pyx). All but Finish final.
#
# The C-level API for cimporting callers is TagEngine's c_* methods: c_check(peers)
# (raise for a closed worker or dead peers), c_send / c_send_to (post a tag send: None
# when it completed, else its future), c_post_match(op, spin) (a matched-probe receive
# of a prepared Op: its (sender_tag, nbytes, capacity) or future), c_exchange (a send and
# a c_post_match in one call), c_irecv (TagEngine.irecv); and ptr_op, the receive Op
# that c_post_match takes. The _-prefixed rest is the
# engine's own; it is declared here only because Cython needs a class's whole table.

cimport cython
from libc.stdint cimport uint32_t, uint64_t, uintptr_t


@cython.final
cdef class BufRef:
    cdef Py_buffer view
    cdef bint held


@cython.final
cdef class Op:
    cdef public object future  # None only until a receive decides it must wait
    cdef void *req             # the UCP request while in flight
    cdef bint is_recv          # polled with the receive test (sender and length)
    cdef bint alloc            # matched probe that allocates the buffer on match
    cdef bint peek             # probe that only watches (does not consume)
    cdef bint device
    cdef bint has_ptr          # receives into a given buffer
    cdef bint posted           # a receive posted to UCX (matched by UCX, not probed)
    cdef bint done
    cdef object keep           # keeps memory alive while UCX may touch it
    cdef object buffer         # the allocated buffer (alloc)
    cdef uintptr_t ptr
    cdef size_t cap
    cdef size_t length
    cdef uint64_t tag
    cdef uint64_t mask
    cdef uint64_t sender_tag
    cdef object scratch        # (array, address) when a message outgrew the buffer
    cdef object settled        # a future for TagEngine.settled_future
    cdef object finish         # maps the result before the future delivers it
    cdef object peers
    # The split rendezvous (same-host messages from TagEngine._split_min bytes): 0 none;
    # a send waiting for the receiver's CTS (1) or DONE (2); a receive waiting for the
    # sender's FIN (3). Its id, the peer's world rank and process, the peer's address of
    # the message, the sender's share [0, rv_k), the receive's own copy's error (errno).
    cdef int rv
    cdef uint64_t rv_id
    cdef int rv_peer
    cdef int rv_pid
    cdef uintptr_t rv_addr
    cdef size_t rv_k
    cdef int rv_err

    cdef void mark_settled(self)


cdef class Finish:
    cdef object fitted(self, uint64_t stag, size_t nbytes, size_t cap)


cdef class EpSend


@cython.final
cdef class TagEngine:
    cdef uintptr_t _wh
    cdef list _reqs            # UCP requests in flight (order irrelevant)
    cdef list _probes          # matched-probe receives, in posting order
    cdef list _graveyard       # memory of abandoned operations
    cdef public dict _dead     # peer -> (deadline, exception); written by Worker.fail_peer
    cdef object _create_future
    cdef object _ready         # the event loop's ready queue (may be None)
    cdef object _others_ready  # Progress.others_ready (None: any ready callback counts)
    cdef double _spin_s
    cdef bint _yield           # a spin gives the core away on every turn
    cdef bint _cuda
    cdef public bint _closed
    cdef object _status_error  # _ucx.status_error
    cdef object _monotonic
    cdef int _canceled         # UCS_ERR_CANCELED
    cdef int _truncated        # UCS_ERR_MESSAGE_TRUNCATED
    cdef void *_stats          # the traffic counters (csrc/stats.c's ucxcomm_stats_t)
    cdef dict _stat_slots      # peer label -> counter slot
    # The split rendezvous (see the engine's docstring).
    cdef bint _split_rx        # this worker carries communicators: requests are handled
    cdef int _pid
    cdef int _world            # this process's world rank
    cdef object _route         # world rank -> its endpoint's EpSend (control messages)
    cdef dict _routes          # world rank -> EpSend, as _route gave it (until it closes)
    cdef dict _rv_send         # id -> send Op waiting for CTS/DONE
    cdef dict _rv_recv         # (sender world rank, id) -> receive Op waiting for FIN
    cdef dict _rv_blind        # (sender world rank, tag) -> posted receives, in order
    cdef object _route_stag    # a message's tag -> its sender's world rank (-1: unknown)
    cdef uint64_t _rv_next
    cdef void *_ctl_req        # the posted receive of control messages
    cdef char _ctl_buf[40]
    cdef list _held            # messages taken out of UCX's queue by a probe, in order
    cdef public size_t _split_min
    cdef size_t _split_post_max  # receives from this size are probed, never posted
    # Split rendezvous tallies: requests sent, requests received, shares this process
    # wrote into a receiver's buffer.
    cdef public uint64_t split_sent
    cdef public uint64_t split_received
    cdef public uint64_t split_shared

    cdef int c_check(self, object peers) except -1
    cdef object _dead_error(self, object peers)
    cdef object _error(self, int st, object peers, str what)
    cdef object c_send(self, uintptr_t ep, object obj, uint64_t tag, object peers,
                       bint fast)
    cdef object _polled_op(self, int st, void *req, object keep, object peers, str what,
                           bint is_recv, uint64_t tag)
    cdef object c_irecv(self, object obj, uint64_t tag, uint64_t mask, object peers,
                        object finish, bint spin, bint post)
    cdef object _irecv_result(self, object res, Op op)
    cdef tuple c_exchange(self, uintptr_t ep, uintptr_t ptr, size_t n, object keep,
                          uint64_t stag, object speers, bint fast, Op op)
    cdef object c_send_to(self, uintptr_t ep, uintptr_t ptr, size_t n, object keep,
                          uint64_t stag, object speers, bint fast)
    cdef object c_post_match(self, Op op, bint spin)
    cdef bint _probe_fresh(self, uint64_t tag, uint64_t mask, void **msg, uint64_t *stag,
                           size_t *nbytes) except -1
    cdef bint _progress_once(self) except -1
    cdef object _wait_op(self, Op op, bint free)
    cdef object _matched(self, Op op)
    cdef bint _overlaps(self, uint64_t tag, uint64_t mask) except -1
    cdef object _post_to_ucx(self, Op op)
    cdef void _finish_posted(self, Op op, int st, uint64_t stag, size_t length,
                             bint early) except *
    cdef bint _spin_match(self, Op op) except -1
    cdef bint _others(self, object ready) except -1
    cdef object _result(self, Op op)
    cdef bint _try_match(self, Op op, bint early) except -1
    cdef int _recv_msg(self, Op op, void *msg, uint64_t stag, size_t nbytes,
                       bint early) except -1
    cdef int _stat_slot(self, object label) except -1
    cdef int _started(self, Op op, int st, void *req) except -1
    cdef void _complete(self, Op op, int status) except *
    cdef void _copy_prefix(self, Op op) except *
    cdef int _poll_reqs(self) except -1
    cdef int _poll(self) except -1
    cdef void _abandon(self, Op op, object err) except *
    cdef object _send_view(self, uintptr_t ep, Py_buffer *view, uint64_t tag, object peers,
                           bint fast)
    cdef object c_send_ep(self, EpSend s, object obj, uint64_t tag)
    cdef object _send_split(self, EpSend s, Py_buffer *view, uint64_t tag)
    cdef int _ctl_send(self, int world, uint32_t kind, uint64_t rid, uintptr_t addr,
                       size_t k) except -1
    cdef int _ctl_post(self) except -1
    cdef int _ctl_poll(self) except -1
    cdef int _ctl_dispatch(self, const char *buf, size_t length) except -1
    cdef int _nack(self, const char *buf) except -1
    cdef int _rts_blind(self, Op op, uint64_t stag, bint early) except -1
    cdef int _rts_take(self, void *msg, uint64_t stag, size_t nbytes, char *out) except -1
    cdef int _rts_start(self, Op op, uint64_t stag, const char *rts, bint early) except -1
    cdef int _rv_finish(self, Op op, int err) except -1
    cdef void _rv_forget(self, Op op)
    cdef object _cma_error(self, int err, Op op)
    cdef void _rv_fail(self, Op op, object exc) except *
    cdef int _held_find(self, uint64_t tag, uint64_t mask) except -2
    cdef object _hold_through(self, uint64_t tag, uint64_t mask, uint64_t stag)


@cython.final
cdef class EpSend:
    cdef TagEngine eng
    cdef public uintptr_t handle
    cdef public object peers
    cdef public bint fast
    cdef public bint closed
    cdef public bint split     # same host: messages from _split_min take the split path
    cdef public int world      # the peer's world rank (split)


# A receive of the message matching (tag, mask) into cap bytes at ptr (keep holds them):
# the Op a caller prepares for TagEngine.c_post_match / c_exchange.
cdef Op ptr_op(uintptr_t ptr, size_t cap, object keep, bint device, uint64_t tag,
               uint64_t mask, object peers)
