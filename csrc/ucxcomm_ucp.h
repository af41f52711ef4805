/*
 * ucxcomm's C helpers over UCP (libucp), linked into the Cython extension
 * ucxcomm.transport._ucp (ucxcomm/transport/_ucp.pyx, built by tools/build_ucp.py).
 *
 * Handles cross this boundary as integers or void pointers, so callers need no UCX
 * header. _ucp.pyx declares the same prototypes for Cython; the generated C includes this
 * header, so the compiler checks the two against each other. Return values are
 * ucs_status_t values (UCS_OK == 0, errors < 0) or UCXCOMM_INPROGRESS with *req set,
 * unless a function says otherwise.
 */
#ifndef UCXCOMM_UCP_H
#define UCXCOMM_UCP_H

#include <stddef.h>
#include <stdint.h>

#define UCXCOMM_INPROGRESS 1

/* Sends ask UCX for fast completion (UCP_OP_ATTR_FLAG_FAST_CMPL) up to
 * UCXCOMM_FAST_SMALL_MAX bytes on every endpoint, and below UCXCOMM_FAST_SEND_MAX on an
 * endpoint whose lanes are all shared memory or self ("fast lanes"). Above that UCX
 * uses rendezvous either way, and over TCP the fast-completion variant cut 64 MiB
 * bandwidth from ~2.2 to 0.7 GB/s. Up to FAST_SMALL_MAX on every endpoint: over TCP
 * the plain request sends 1 B to 16 KiB by zero-copy (an iovec send and its
 * completion); with the flag UCX sends up to 8184 bytes as eager short (8 B TCP
 * latency 4.9 -> 4.7-4.8 us here, A/B, 3 runs each). RDMA lanes: not measured (UCX's
 * small-message choice there is eager short or copy either way). */
#define UCXCOMM_FAST_SMALL_MAX 8184
#define UCXCOMM_FAST_SEND_MAX 262144

/* Whether a send of n bytes asks for fast completion (fast_lanes: see above). */
static inline int ucxcomm_fast_send(int fast_lanes, size_t n)
{
    return n <= UCXCOMM_FAST_SMALL_MAX || (fast_lanes && n < UCXCOMM_FAST_SEND_MAX);
}

/* ---- info.c: library facts and constants */
typedef struct {
    const char *name;
    long value;
} ucxcomm_const_t;

/* The UCX constants Python needs (statuses, atomic opcodes), by their UCX names. */
const ucxcomm_const_t *ucxcomm_constants(size_t *count);
const char *ucxcomm_status_string(int status);
const char *ucxcomm_version_string(void);
/* The file libucp was actually loaded from (wheel or system library). */
const char *ucxcomm_libucp_path(void);
/* Writes "tl/dev;tl/dev;..." for an endpoint's lanes (ucp_ep_query). */
int ucxcomm_ep_transports(uintptr_t ep, char *out, size_t outlen);
/* Writes UCX's description of an endpoint (ucp_ep_print_info: its lanes and, with
 * protocols v2, the protocol table per operation and size range), NUL-terminated and
 * cut at outlen; returns its full length, or -1. */
long ucxcomm_ep_info(uintptr_t ep, char *out, size_t outlen);
/* Swallow UCX's warnings and errors until the matching pop, which returns how many it
 * swallowed (around a call whose failure is reported as an exception anyway). Calls
 * that may log meanwhile from other threads are swallowed too: keep the span short. */
void ucxcomm_log_quiet_push(void);
unsigned ucxcomm_log_quiet_pop(void);
/* The i-th swallowed message (the first 8 are kept), or NULL. */
const char *ucxcomm_log_quieted(unsigned i);
/* From now on (once installed, for good), drop ucxx's own line about an endpoint error
 * ("UCXX ERROR ucxx::Endpoint::endpointErrorCallback ..."): the endpoint's owner
 * reports the failure itself (PeerFailure). The second returns how many were dropped. */
void ucxcomm_log_drop_ucxx_ep_errors(void);
unsigned long ucxcomm_log_ucxx_ep_errors(void);
/* After a peer failed: drop UCX's "not returned to mpool" and "destroying inuse
 * region" warnings (requests to that peer that UCX cannot purge, and their buffers'
 * registrations, reported when the worker is destroyed); installed
 * once, for the rest of the process. */
void ucxcomm_log_drop_lost_requests(void);
unsigned long ucxcomm_log_lost_requests(void);

/* ---- tag.c: the tag message path on a ucxx-owned worker, polled requests */
int ucxcomm_tag_send(uintptr_t ep, const void *buf, size_t n, uint64_t tag, int fast,
                     void **req);
int ucxcomm_tag_recv(uintptr_t worker, void *buf, size_t n, uint64_t tag, uint64_t mask,
                     void **req, uint64_t *sender_tag, size_t *length);
/* 1 and *msg set when a message matches, else 0. */
int ucxcomm_tag_probe(uintptr_t worker, uint64_t tag, uint64_t mask, int remove,
                      void **msg, uint64_t *sender_tag, size_t *length);
int ucxcomm_msg_recv(uintptr_t worker, void *buf, size_t n, void *msg, void **req,
                     uint64_t *sender_tag, size_t *length);
/* UCXCOMM_INPROGRESS, or the final status (the request is then freed). */
int ucxcomm_test(void *req, int is_recv, uint64_t *sender_tag, size_t *length);
unsigned ucxcomm_progress(uintptr_t worker);
/* 1 when armed (safe to sleep on the worker's event fd), 0 when events are pending. */
int ucxcomm_arm(uintptr_t worker);
void ucxcomm_cancel(uintptr_t worker, void *req);
/* Give an endpoint created without UCX error handling (ucxx's, from a worker address)
 * an error callback. Without one UCX aborts the process when a transport reports the
 * peer gone, e.g. CMA's process_vm_readv failing mid-copy because the peer died; with
 * one, the endpoint's requests fail with an error status instead. */
int ucxcomm_ep_catch_errors(uintptr_t ep);
/* How many endpoint failures the callback saw (in this process). */
unsigned long ucxcomm_ep_failures(void);
/* 1 if the callback saw this endpoint fail (among the last 64 failures), else 0;
 * forget: clear the record (call it so when closing the endpoint). */
int ucxcomm_ep_failed(uintptr_t ep, int forget);

/* ---- stats.c: traffic counters of a tag engine, per peer slot (slot 0: messages no
 * route names). A message is tallied under the row of UCX's protocol table (per
 * variant: 0 plain, 1 fast completion) whose size range holds its size, given as the
 * rows' first sizes (ucxcomm_stats_set_rows, from ucp_ep_print_info); without rows,
 * or for device memory, under UCXCOMM_STATS_UNCLASSIFIED. */
#define UCXCOMM_STATS_ROWS 8
#define UCXCOMM_STATS_UNCLASSIFIED (2 * UCXCOMM_STATS_ROWS)
typedef struct {
    uint64_t messages;
    uint64_t bytes;
} ucxcomm_tally_t;
typedef struct {
    ucxcomm_tally_t sent[2 * UCXCOMM_STATS_ROWS + 1]; /* [variant * ROWS + row] */
    ucxcomm_tally_t recv[2 * UCXCOMM_STATS_ROWS + 1];
    ucxcomm_tally_t unexpected; /* receives that found their message already here */
    size_t first[2][UCXCOMM_STATS_ROWS];
    unsigned rows[2];
    int fast; /* the endpoint's lanes are fast lanes (see ucxcomm_fast_send) */
} ucxcomm_peer_stats_t;
typedef struct ucxcomm_stats ucxcomm_stats_t;
ucxcomm_stats_t *ucxcomm_stats_new(void);
void ucxcomm_stats_free(ucxcomm_stats_t *s);
/* A new peer slot (its index), or -1 (out of memory). */
int ucxcomm_stats_peer(ucxcomm_stats_t *s);
const ucxcomm_peer_stats_t *ucxcomm_stats_get(const ucxcomm_stats_t *s, int slot);
/* Sends on endpoint ep count to slot (> 0); 0, or -1 (bad slot, out of memory). */
int ucxcomm_stats_route_ep(ucxcomm_stats_t *s, uintptr_t ep, int slot, int fast);
/* Received messages whose sender tag >> shift == prefix count to slot (> 0); every
 * route of an engine has the same shift. 0, or -1. */
int ucxcomm_stats_route_src(ucxcomm_stats_t *s, unsigned shift, uint64_t prefix, int slot);
int ucxcomm_stats_set_rows(ucxcomm_stats_t *s, int slot, int variant, const size_t *first,
                           unsigned rows);
/* variant: 0 plain, 1 fast completion (what the send asked for), -1 unclassified. */
void ucxcomm_count_send(ucxcomm_stats_t *s, uintptr_t ep, size_t n, int variant);
void ucxcomm_count_recv(ucxcomm_stats_t *s, uint64_t sender_tag, size_t n, int unexpected,
                        int device);

/* ---- rma.c: the RMA engine, a UCP context + thread-safe worker of its own whose
 * progress thread serves peers' emulated RMA/atomics while Python computes. */
/* The context gets UCX's configuration (environment) plus the nopts key/value
 * options (keys without the UCX_ prefix), exactly like the main context. */
int ucxcomm_rma_create(const char *const *keys, const char *const *values, size_t nopts,
                       double spin_s, void **out, char *err, size_t errlen);
void ucxcomm_rma_destroy(void *eng);
int ucxcomm_rma_address(void *eng, char *buf, size_t buflen, size_t *len);
int ucxcomm_rma_connect(void *eng, const void *addr, uintptr_t *ep);
void ucxcomm_rma_ep_close(void *eng, uintptr_t ep);
int ucxcomm_rma_mem_map(void *eng, void *addr, size_t len, void **memh);
/* Memory allocated by UCX (shared-memory capable where a transport can attach it: peers
 * on the host then copy and do atomics on it directly), mapped for remote access; *addr
 * receives its address. ucxcomm_rma_mem_unmap releases it. */
int ucxcomm_rma_mem_alloc(void *eng, size_t len, void **memh, void **addr);
int ucxcomm_rma_mem_unmap(void *eng, void *memh);
int ucxcomm_rma_rkey_pack(void *eng, void *memh, char *buf, size_t buflen, size_t *len);
int ucxcomm_rma_rkey_unpack(uintptr_t ep, const void *buf, void **rkey);
/* Where the remote address is mapped in this process (memory UCX allocated, reached
 * over shared memory), else UCS_ERR_UNREACHABLE. */
int ucxcomm_rma_rkey_ptr(void *rkey, uint64_t raddr, uintptr_t *ptr);
void ucxcomm_rma_rkey_destroy(void *rkey);
int ucxcomm_rma_put(void *eng, uintptr_t ep, const void *buf, size_t n, uint64_t raddr,
                    void *rkey, void **req);
int ucxcomm_rma_get(void *eng, uintptr_t ep, void *buf, size_t n, uint64_t raddr,
                    void *rkey, void **req);
/* reply != NULL: fetching (for compare-and-swap it holds the new value on entry and
 * value points at the compare value). */
int ucxcomm_rma_atomic(void *eng, uintptr_t ep, int op, const void *value, void *reply,
                       size_t size, uint64_t raddr, void *rkey, void **req);
int ucxcomm_rma_flush(void *eng, uintptr_t ep, void **req);
unsigned ucxcomm_rma_progress(void *eng);
/* UCXCOMM_INPROGRESS, or the final status (the request is then freed). */
int ucxcomm_rma_test(void *req);
/* Completion notices for a sleeping waiter: after ucxcomm_rma_arm() (which also wakes
 * the progress thread) the next request that completes makes the descriptor readable;
 * ucxcomm_rma_disarm() drains it. */
int ucxcomm_rma_notify_fd(void *eng);
void ucxcomm_rma_arm(void *eng);
void ucxcomm_rma_disarm(void *eng);

#endif /* UCXCOMM_UCP_H */
