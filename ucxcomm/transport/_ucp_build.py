"""cffi (API mode) build script for ``ucxcomm.transport._ucp``, a thin layer over ``ucp.h``.

Built at install time against the headers of the ``libucx`` wheel (or of the UCX named
by ``UCXCOMM_UCX_PREFIX``). The extension links ``libucp``/``libucs`` by soname only
(no rpath): at run time it binds to whichever libucp ucxx already loaded, so a system
UCX with verbs loaded via ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` replaces the
wheel's without rebuilding.
"""

from __future__ import annotations

import os

from cffi import FFI

CDEF = r"""
typedef int... ucs_status_t;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_context *ucp_context_h;

typedef struct {
    const char *transport_name;
    const char *device_name;
    ...;
} ucp_transport_entry_t;

typedef struct {
    ucp_transport_entry_t *entries;
    unsigned num_entries;
    size_t entry_size;
    ...;
} ucp_transports_t;

typedef struct {
    uint64_t field_mask;
    ucp_transports_t transports;
    ...;
} ucp_ep_attr_t;

#define UCP_EP_ATTR_FIELD_TRANSPORTS ...
#define UCP_API_MAJOR ...
#define UCP_API_MINOR ...

void ucp_get_version(unsigned *major_version, unsigned *minor_version,
                     unsigned *release_number);
const char *ucp_get_version_string(void);
ucs_status_t ucp_ep_query(ucp_ep_h ep, ucp_ep_attr_t *attr);
const char *ucs_status_string(ucs_status_t status);

unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
void ucp_request_cancel(ucp_worker_h worker, void *request);

/* helpers defined below */
int ucxcomm_ep_transports(uintptr_t ep, char *out, size_t outlen);
const char *ucxcomm_libucp_path(void);
int ucxcomm_tag_send(uintptr_t ep, const void *buf, size_t n, uint64_t tag, int fast,
                     void **req);
int ucxcomm_tag_recv(uintptr_t worker, void *buf, size_t n, uint64_t tag, uint64_t mask,
                     void **req, uint64_t *sender_tag, size_t *length);
int ucxcomm_tag_probe(uintptr_t worker, uint64_t tag, uint64_t mask, int remove,
                      void **msg, uint64_t *sender_tag, size_t *length);
int ucxcomm_msg_recv(uintptr_t worker, void *buf, size_t n, void *msg, void **req,
                     uint64_t *sender_tag, size_t *length);
int ucxcomm_test(void *req, int is_recv, uint64_t *sender_tag, size_t *length);
int ucxcomm_stream_send(uintptr_t ep, const void *buf, size_t n, void **req);
int ucxcomm_stream_recv(uintptr_t ep, void *buf, size_t n, void **req);
unsigned ucxcomm_progress(uintptr_t worker);
int ucxcomm_arm(uintptr_t worker);
void ucxcomm_cancel(uintptr_t worker, void *req);
/* RMA engine: its own context and thread-safe worker, progressed by a thread */
int ucxcomm_rma_create(int proto_v1, double spin_s, void **out, char *err, size_t errlen);
void ucxcomm_rma_destroy(void *eng);
int ucxcomm_rma_address(void *eng, char *buf, size_t buflen, size_t *len);
int ucxcomm_rma_connect(void *eng, const void *addr, uintptr_t *ep);
void ucxcomm_rma_ep_close(void *eng, uintptr_t ep);
int ucxcomm_rma_mem_map(void *eng, void *addr, size_t len, void **memh);
int ucxcomm_rma_mem_unmap(void *eng, void *memh);
int ucxcomm_rma_rkey_pack(void *eng, void *memh, char *buf, size_t buflen, size_t *len);
int ucxcomm_rma_rkey_unpack(uintptr_t ep, const void *buf, void **rkey);
void ucxcomm_rma_rkey_destroy(void *rkey);
int ucxcomm_rma_put(uintptr_t ep, const void *buf, size_t n, uint64_t raddr, void *rkey,
                    void **req);
int ucxcomm_rma_get(uintptr_t ep, void *buf, size_t n, uint64_t raddr, void *rkey,
                    void **req);
int ucxcomm_rma_atomic(uintptr_t ep, int op, const void *value, void *reply, size_t size,
                       uint64_t raddr, void *rkey, void **req);
int ucxcomm_rma_flush(uintptr_t ep, void **req);
unsigned ucxcomm_rma_progress(void *eng);
int ucxcomm_rma_test(void *req);
void ucxcomm_rma_wake(void *eng);
static const int UCXCOMM_AMO_ADD;
static const int UCXCOMM_AMO_SWAP;
static const int UCXCOMM_AMO_CSWAP;
static const int UCXCOMM_AMO_AND;
static const int UCXCOMM_AMO_OR;
static const int UCXCOMM_AMO_XOR;
#define UCXCOMM_INPROGRESS ...
static const int UCS_ERR_CANCELED;
static const int UCS_ERR_MESSAGE_TRUNCATED;
static const int UCS_ERR_CONNECTION_RESET;
static const int UCS_ERR_ENDPOINT_TIMEOUT;
static const int UCS_ERR_UNREACHABLE;
static const int UCS_ERR_NOT_CONNECTED;
static const int UCS_ERR_REJECTED;
static const int UCS_ERR_IO_ERROR;
static const int UCS_ERR_SHMEM_SEGMENT;
static const int UCS_ERR_TIMED_OUT;
"""

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <ucp/api/ucp.h>

/* Writes "tls/dev;tls/dev;..." for an endpoint's lanes. Returns a ucs_status_t. */
static int ucxcomm_ep_transports(uintptr_t ep, char *out, size_t outlen)
{
    ucp_transport_entry_t entries[32];
    ucp_ep_attr_t attr;
    size_t used = 0;
    unsigned i;
    ucs_status_t st;

    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 32;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    st = ucp_ep_query((ucp_ep_h)ep, &attr);
    if (st != UCS_OK) {
        return (int)st;
    }
    if (outlen > 0) {
        out[0] = '\0';
    }
    for (i = 0; i < attr.transports.num_entries && used < outlen; ++i) {
        int n = snprintf(out + used, outlen - used, "%s%s/%s", i ? ";" : "",
                         entries[i].transport_name, entries[i].device_name);
        if (n < 0) {
            break;
        }
        used += (size_t)n;
    }
    return (int)UCS_OK;
}

#define UCXCOMM_INPROGRESS 1

/*
 * The tag hot path. Requests are created without callbacks and polled with
 * ucxcomm_test(), which frees them once complete. Return values are ucs_status_t
 * (UCS_OK = 0 done, negative = error) or UCXCOMM_INPROGRESS with *req set.
 */
static int ucxcomm_status_ptr(ucs_status_ptr_t sp, void **req)
{
    if (sp == NULL) {
        *req = NULL;
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        *req = NULL;
        return (int)UCS_PTR_STATUS(sp);
    }
    *req = sp;
    return UCXCOMM_INPROGRESS;
}

static int ucxcomm_tag_send(uintptr_t ep, const void *buf, size_t n, uint64_t tag,
                            int fast, void **req)
{
    ucp_request_param_t param;
    /* fast: ask for fast local completion, which makes UCX pick multi-fragment eager up
     * to 256 KiB on shared memory instead of rendezvous from ~5 KiB (the caller decides
     * per endpoint and size; measured in docs/design.md). */
    param.op_attr_mask = fast ? UCP_OP_ATTR_FLAG_FAST_CMPL : 0;
    return ucxcomm_status_ptr(ucp_tag_send_nbx((ucp_ep_h)ep, buf, n, tag, &param), req);
}

static int ucxcomm_tag_recv(uintptr_t worker, void *buf, size_t n, uint64_t tag,
                            uint64_t mask, void **req, uint64_t *sender_tag,
                            size_t *length)
{
    ucp_tag_recv_info_t info;
    ucp_request_param_t param;
    int st;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
    param.recv_info.tag_info = &info;
    st = ucxcomm_status_ptr(ucp_tag_recv_nbx((ucp_worker_h)worker, buf, n, tag, mask,
                                             &param), req);
    if (st == UCS_OK) {
        *sender_tag = info.sender_tag;
        *length = info.length;
    }
    return st;
}

static int ucxcomm_tag_probe(uintptr_t worker, uint64_t tag, uint64_t mask, int remove,
                             void **msg, uint64_t *sender_tag, size_t *length)
{
    ucp_tag_recv_info_t info;
    ucp_tag_message_h m = ucp_tag_probe_nb((ucp_worker_h)worker, tag, mask, remove, &info);
    if (m == NULL) {
        return 0;
    }
    *msg = m;
    *sender_tag = info.sender_tag;
    *length = info.length;
    return 1;
}

static int ucxcomm_msg_recv(uintptr_t worker, void *buf, size_t n, void *msg, void **req,
                            uint64_t *sender_tag, size_t *length)
{
    ucp_tag_recv_info_t info;
    ucp_request_param_t param;
    int st;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
    param.recv_info.tag_info = &info;
    st = ucxcomm_status_ptr(ucp_tag_msg_recv_nbx((ucp_worker_h)worker, buf, n,
                                                 (ucp_tag_message_h)msg, &param), req);
    if (st == UCS_OK) {
        *sender_tag = info.sender_tag;
        *length = info.length;
    }
    return st;
}

/* UCXCOMM_INPROGRESS, or the final status (the request is then freed). */
static int ucxcomm_test(void *req, int is_recv, uint64_t *sender_tag, size_t *length)
{
    ucs_status_t st;
    if (is_recv) {
        ucp_tag_recv_info_t info;
        st = ucp_tag_recv_request_test(req, &info);
        if (st == UCS_INPROGRESS) {
            return UCXCOMM_INPROGRESS;
        }
        *sender_tag = info.sender_tag;
        *length = info.length;
    } else {
        st = ucp_request_check_status(req);
        if (st == UCS_INPROGRESS) {
            return UCXCOMM_INPROGRESS;
        }
    }
    ucp_request_free(req);
    return (int)st;
}

/* Stream messages (used for the connection handshake): recv waits for all n bytes. */
static int ucxcomm_stream_send(uintptr_t ep, const void *buf, size_t n, void **req)
{
    ucp_request_param_t param;
    param.op_attr_mask = 0;
    return ucxcomm_status_ptr(ucp_stream_send_nbx((ucp_ep_h)ep, buf, n, &param), req);
}

static int ucxcomm_stream_recv(uintptr_t ep, void *buf, size_t n, void **req)
{
    ucp_request_param_t param;
    size_t length = 0;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
    return ucxcomm_status_ptr(ucp_stream_recv_nbx((ucp_ep_h)ep, buf, n, &length, &param),
                              req);
}

static unsigned ucxcomm_progress(uintptr_t worker)
{
    return ucp_worker_progress((ucp_worker_h)worker);
}

/* 1 when armed (safe to sleep on the event fd), 0 when events are pending. */
static int ucxcomm_arm(uintptr_t worker)
{
    ucs_status_t st = ucp_worker_arm((ucp_worker_h)worker);
    if (st == UCS_ERR_BUSY) {
        return 0;
    }
    return st == UCS_OK ? 1 : (int)st;
}

static void ucxcomm_cancel(uintptr_t worker, void *req)
{
    ucp_request_cancel((ucp_worker_h)worker, req);
}

/* ------------------------------------------------------------------ RMA engine
 * One-sided operations run on a dedicated UCP context + worker (thread mode MULTI), so
 * that (1) a thread can keep progressing it while Python computes (UCX emulates RMA and
 * atomics over TCP/shared memory with active messages that the *target* must serve),
 * and (2) UCX_PROTO_ENABLE=n (needed for emulated atomics) affects RMA only. */
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <stdlib.h>
#include <stdint.h>

static const int UCXCOMM_AMO_ADD = UCP_ATOMIC_OP_ADD;
static const int UCXCOMM_AMO_SWAP = UCP_ATOMIC_OP_SWAP;
static const int UCXCOMM_AMO_CSWAP = UCP_ATOMIC_OP_CSWAP;
static const int UCXCOMM_AMO_AND = UCP_ATOMIC_OP_AND;
static const int UCXCOMM_AMO_OR = UCP_ATOMIC_OP_OR;
static const int UCXCOMM_AMO_XOR = UCP_ATOMIC_OP_XOR;

typedef struct {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int wfd;
    int stop_fd;
    pthread_t thread;
    int running;
    volatile int stop;
    double spin_s;
} ucxcomm_rma_t;

static void *ucxcomm_rma_loop(void *arg)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)arg;
    struct pollfd fds[2];
    ucs_status_t st;

    struct timespec now;
    double last = 0, t;

    fds[0].fd = e->wfd;
    fds[0].events = POLLIN;
    fds[1].fd = e->stop_fd;
    fds[1].events = POLLIN;
    while (!e->stop) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        t = now.tv_sec + now.tv_nsec * 1e-9;
        if (ucp_worker_progress(e->worker)) {
            last = t;
            continue;
        }
        if (t - last < e->spin_s) {
            sched_yield();  /* stay hot for a while after activity (latency) */
            continue;
        }
        st = ucp_worker_arm(e->worker);
        if (st == UCS_ERR_BUSY) {
            continue;
        }
        if (st != UCS_OK) {
            usleep(100);
            continue;
        }
        fds[0].revents = fds[1].revents = 0;
        (void)poll(fds, 2, 100);
    }
    return NULL;
}

static int ucxcomm_rma_create(int proto_v1, double spin_s, void **out, char *err,
                              size_t errlen)
{
    ucp_config_t *cfg = NULL;
    ucp_params_t params;
    ucp_worker_params_t wparams;
    ucxcomm_rma_t *e;
    ucs_status_t st;

    e = (ucxcomm_rma_t *)calloc(1, sizeof(*e));
    if (e == NULL) {
        snprintf(err, errlen, "out of memory");
        return (int)UCS_ERR_NO_MEMORY;
    }
    e->wfd = e->stop_fd = -1;
    e->spin_s = spin_s;
    st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_config_read");
        goto fail;
    }
    if (proto_v1) {
        st = ucp_config_modify(cfg, "PROTO_ENABLE", "n");
        if (st != UCS_OK) {
            snprintf(err, errlen, "ucp_config_modify(PROTO_ENABLE)");
            goto fail;
        }
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64 |
                      UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    st = ucp_init(&params, cfg, &e->ctx);
    ucp_config_release(cfg);
    cfg = NULL;
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_init");
        goto fail;
    }
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    wparams.thread_mode = UCS_THREAD_MODE_MULTI;
    wparams.events = UCP_WAKEUP_RMA | UCP_WAKEUP_AMO | UCP_WAKEUP_TX | UCP_WAKEUP_RX;
    st = ucp_worker_create(e->ctx, &wparams, &e->worker);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_create");
        goto fail;
    }
    st = ucp_worker_get_efd(e->worker, &e->wfd);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_get_efd");
        goto fail;
    }
    e->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->stop_fd < 0 || pthread_create(&e->thread, NULL, ucxcomm_rma_loop, e) != 0) {
        snprintf(err, errlen, "progress thread");
        st = UCS_ERR_IO_ERROR;
        goto fail;
    }
    e->running = 1;
    *out = e;
    return (int)UCS_OK;
fail:
    if (cfg != NULL) {
        ucp_config_release(cfg);
    }
    if (e->stop_fd >= 0) {
        close(e->stop_fd);
    }
    if (e->worker != NULL) {
        ucp_worker_destroy(e->worker);
    }
    if (e->ctx != NULL) {
        ucp_cleanup(e->ctx);
    }
    free(e);
    return (int)st;
}

static void ucxcomm_rma_destroy(void *eng)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    uint64_t one = 1;
    if (e->running) {
        e->stop = 1;
        (void)write(e->stop_fd, &one, sizeof(one));
        pthread_join(e->thread, NULL);
    }
    close(e->stop_fd);
    ucp_worker_destroy(e->worker);
    ucp_cleanup(e->ctx);
    free(e);
}

static int ucxcomm_rma_address(void *eng, char *buf, size_t buflen, size_t *len)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_address_t *addr;
    size_t n;
    ucs_status_t st = ucp_worker_get_address(e->worker, &addr, &n);
    if (st != UCS_OK) {
        return (int)st;
    }
    *len = n;
    if (n <= buflen) {
        memcpy(buf, addr, n);
    }
    ucp_worker_release_address(e->worker, addr);
    return n <= buflen ? (int)UCS_OK : (int)UCS_ERR_BUFFER_TOO_SMALL;
}

static int ucxcomm_rma_connect(void *eng, const void *addr, uintptr_t *ep)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_ep_params_t params;
    ucp_ep_h h;
    ucs_status_t st;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)addr;
    st = ucp_ep_create(e->worker, &params, &h);
    *ep = (uintptr_t)h;
    return (int)st;
}

static void ucxcomm_rma_ep_close(void *eng, uintptr_t ep)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    sp = ucp_ep_close_nbx((ucp_ep_h)ep, &param);
    if (sp != NULL && !UCS_PTR_IS_ERR(sp)) {
        while (ucp_request_check_status(sp) == UCS_INPROGRESS) {
            ucp_worker_progress(e->worker);
        }
        ucp_request_free(sp);
    }
}

static int ucxcomm_rma_mem_map(void *eng, void *addr, size_t len, void **memh)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_mem_map_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = addr;
    params.length = len;
    return (int)ucp_mem_map(e->ctx, &params, (ucp_mem_h *)memh);
}

static int ucxcomm_rma_mem_unmap(void *eng, void *memh)
{
    return (int)ucp_mem_unmap(((ucxcomm_rma_t *)eng)->ctx, (ucp_mem_h)memh);
}

static int ucxcomm_rma_rkey_pack(void *eng, void *memh, char *buf, size_t buflen,
                                 size_t *len)
{
    void *rb;
    size_t n;
    ucs_status_t st = ucp_rkey_pack(((ucxcomm_rma_t *)eng)->ctx, (ucp_mem_h)memh, &rb, &n);
    if (st != UCS_OK) {
        return (int)st;
    }
    *len = n;
    if (n <= buflen) {
        memcpy(buf, rb, n);
    }
    ucp_rkey_buffer_release(rb);
    return n <= buflen ? (int)UCS_OK : (int)UCS_ERR_BUFFER_TOO_SMALL;
}

static int ucxcomm_rma_rkey_unpack(uintptr_t ep, const void *buf, void **rkey)
{
    return (int)ucp_ep_rkey_unpack((ucp_ep_h)ep, buf, (ucp_rkey_h *)rkey);
}

static void ucxcomm_rma_rkey_destroy(void *rkey)
{
    ucp_rkey_destroy((ucp_rkey_h)rkey);
}

static int ucxcomm_rma_put(uintptr_t ep, const void *buf, size_t n, uint64_t raddr,
                           void *rkey, void **req)
{
    ucp_request_param_t param;
    param.op_attr_mask = 0;
    return ucxcomm_status_ptr(ucp_put_nbx((ucp_ep_h)ep, buf, n, raddr, (ucp_rkey_h)rkey,
                                          &param), req);
}

static int ucxcomm_rma_get(uintptr_t ep, void *buf, size_t n, uint64_t raddr, void *rkey,
                           void **req)
{
    ucp_request_param_t param;
    param.op_attr_mask = 0;
    return ucxcomm_status_ptr(ucp_get_nbx((ucp_ep_h)ep, buf, n, raddr, (ucp_rkey_h)rkey,
                                          &param), req);
}

/* reply != NULL: fetching (for CSWAP it holds the compare value on entry). */
static int ucxcomm_rma_atomic(uintptr_t ep, int op, const void *value, void *reply,
                              size_t size, uint64_t raddr, void *rkey, void **req)
{
    ucp_request_param_t param;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_contig(size);
    if (reply != NULL) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_REPLY_BUFFER;
        param.reply_buffer = reply;
    }
    return ucxcomm_status_ptr(ucp_atomic_op_nbx((ucp_ep_h)ep, (ucp_atomic_op_t)op, value, 1,
                                                raddr, (ucp_rkey_h)rkey, &param), req);
}

static int ucxcomm_rma_flush(uintptr_t ep, void **req)
{
    ucp_request_param_t param;
    param.op_attr_mask = 0;
    return ucxcomm_status_ptr(ucp_ep_flush_nbx((ucp_ep_h)ep, &param), req);
}

static unsigned ucxcomm_rma_progress(void *eng)
{
    return ucp_worker_progress(((ucxcomm_rma_t *)eng)->worker);
}

/* UCXCOMM_INPROGRESS, or the final status (the request is then freed). */
static int ucxcomm_rma_test(void *req)
{
    ucs_status_t st = ucp_request_check_status(req);
    if (st == UCS_INPROGRESS) {
        return UCXCOMM_INPROGRESS;
    }
    ucp_request_free(req);
    return (int)st;
}

static void ucxcomm_rma_wake(void *eng)
{
    ucp_worker_signal(((ucxcomm_rma_t *)eng)->worker);
}

/* The file libucp was actually loaded from (wheel or system). */
static const char *ucxcomm_libucp_path(void)
{
    Dl_info info;
    if (dladdr((void *)&ucp_get_version_string, &info) && info.dli_fname) {
        return info.dli_fname;
    }
    return "";
}
"""


def _ucx_prefix() -> str:
    prefix = os.environ.get("UCXCOMM_UCX_PREFIX")
    if prefix:
        return prefix
    import libucx  # the wheel that ucxx-cu12 depends on

    return os.path.dirname(libucx.__file__)


def make_ffibuilder() -> FFI:
    prefix = _ucx_prefix()
    ffibuilder = FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(
        "ucxcomm.transport._ucp",
        SOURCE,
        include_dirs=[os.path.join(prefix, "include")],
        library_dirs=[os.path.join(prefix, "lib")],
        libraries=["ucp", "ucs", "dl", "pthread"],
        extra_compile_args=["-O2"],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
