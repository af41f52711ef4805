/*
 * The RMA engine: one-sided operations on a UCP context and thread-safe worker of
 * their own (thread mode MULTI), so that
 *  (1) a thread keeps progressing it while Python computes: without RDMA, UCX emulates
 *      RMA and atomics with active messages that the *target* must serve;
 *  (2) options that only one-sided traffic needs (UCX_PROTO_ENABLE=n for emulated
 *      atomics) stay off the tag traffic's context.
 * The context is configured like the main one: UCX's environment plus the options the
 * caller passes (the transport plan and the user's ucx_config).
 *
 * Requests are polled from Python (ucxcomm_rma_test). Their completion callback only
 * wakes a Python waiter that armed the notify descriptor before going to sleep.
 */
#define _GNU_SOURCE /* clock_gettime, usleep, eventfd with -std=c11 */
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "ucxcomm_internal.h"

typedef struct {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int wfd;       /* the worker's event descriptor (progress thread sleeps on it) */
    int stop_fd;   /* wakes the progress thread to stop */
    int notify_fd; /* readable after a completion, once armed (Python sleeps on it) */
    int notify;    /* armed? (atomic) */
    int stop;      /* atomic */
    int running;
    pthread_t thread;
    double spin_s;
} ucxcomm_rma_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void signal_fd(int fd)
{
    uint64_t one = 1;
    ssize_t n = write(fd, &one, sizeof(one));
    (void)n; /* an eventfd write only fails when the counter would overflow */
}

static void *progress_thread(void *arg)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)arg;
    struct pollfd fds[2];
    double last = 0, t;
    ucs_status_t st;

    fds[0].fd = e->wfd;
    fds[0].events = POLLIN;
    fds[1].fd = e->stop_fd;
    fds[1].events = POLLIN;
    while (!__atomic_load_n(&e->stop, __ATOMIC_ACQUIRE)) {
        t = now_s();
        if (ucp_worker_progress(e->worker)) {
            last = t;
            continue;
        }
        if (t - last < e->spin_s) {
            sched_yield(); /* stay hot for a while after activity (latency) */
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

/* Completion callback of every RMA request (runs in whichever thread progresses). */
static void request_done(void *request, ucs_status_t status, void *user_data)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)user_data;
    (void)request;
    (void)status;
    /* Pairs with ucxcomm_rma_arm: the request is marked complete before this runs, and
     * the waiter re-tests its requests after arming, so one side always sees the other. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_exchange_n(&e->notify, 0, __ATOMIC_SEQ_CST)) {
        signal_fd(e->notify_fd);
    }
}

static void set_err(char *err, size_t errlen, const char *what, const char *detail)
{
    snprintf(err, errlen, "%s%s%s", what, detail ? " " : "", detail ? detail : "");
}

static void destroy(ucxcomm_rma_t *e)
{
    if (e->running) {
        __atomic_store_n(&e->stop, 1, __ATOMIC_RELEASE);
        signal_fd(e->stop_fd);
        pthread_join(e->thread, NULL);
    }
    if (e->stop_fd >= 0) {
        close(e->stop_fd);
    }
    if (e->notify_fd >= 0) {
        close(e->notify_fd);
    }
    if (e->worker != NULL) {
        ucp_worker_destroy(e->worker);
    }
    if (e->ctx != NULL) {
        ucp_cleanup(e->ctx);
    }
    free(e);
}

int ucxcomm_rma_create(const char *const *keys, const char *const *values, size_t nopts,
                       double spin_s, void **out, char *err, size_t errlen)
{
    ucp_config_t *cfg = NULL;
    ucp_params_t params;
    ucp_worker_params_t wparams;
    ucxcomm_rma_t *e;
    ucs_status_t st;
    size_t i;

    e = (ucxcomm_rma_t *)calloc(1, sizeof(*e));
    if (e == NULL) {
        set_err(err, errlen, "out of memory", NULL);
        return (int)UCS_ERR_NO_MEMORY;
    }
    e->wfd = e->stop_fd = e->notify_fd = -1;
    e->spin_s = spin_s;
    st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_config_read", NULL);
        goto fail;
    }
    for (i = 0; i < nopts; ++i) {
        st = ucp_config_modify(cfg, keys[i], values[i]);
        if (st != UCS_OK) {
            set_err(err, errlen, "ucp_config_modify", keys[i]);
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
        set_err(err, errlen, "ucp_init", NULL);
        goto fail;
    }
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    wparams.thread_mode = UCS_THREAD_MODE_MULTI;
    wparams.events = UCP_WAKEUP_RMA | UCP_WAKEUP_AMO | UCP_WAKEUP_TX | UCP_WAKEUP_RX;
    st = ucp_worker_create(e->ctx, &wparams, &e->worker);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_worker_create", NULL);
        goto fail;
    }
    st = ucp_worker_get_efd(e->worker, &e->wfd);
    if (st != UCS_OK) {
        set_err(err, errlen, "ucp_worker_get_efd", NULL);
        goto fail;
    }
    e->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->stop_fd < 0 || e->notify_fd < 0 ||
        pthread_create(&e->thread, NULL, progress_thread, e) != 0) {
        set_err(err, errlen, "progress thread", NULL);
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
    destroy(e);
    return (int)st;
}

void ucxcomm_rma_destroy(void *eng)
{
    destroy((ucxcomm_rma_t *)eng);
}

int ucxcomm_rma_address(void *eng, char *buf, size_t buflen, size_t *len)
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

int ucxcomm_rma_connect(void *eng, const void *addr, uintptr_t *ep)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_ep_params_t params;
    ucp_ep_h h = NULL;
    ucs_status_t st;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)addr;
    st = ucp_ep_create(e->worker, &params, &h);
    *ep = (uintptr_t)h;
    return (int)st;
}

void ucxcomm_rma_ep_close(void *eng, uintptr_t ep)
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

int ucxcomm_rma_mem_map(void *eng, void *addr, size_t len, void **memh)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_mem_map_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = addr;
    params.length = len;
    return (int)ucp_mem_map(e->ctx, &params, (ucp_mem_h *)memh);
}

int ucxcomm_rma_mem_alloc(void *eng, size_t len, void **memh, void **addr)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    ucp_mem_map_params_t params;
    ucp_mem_attr_t attr;
    ucs_status_t st;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.address = NULL;
    params.length = len;
    params.flags = UCP_MEM_MAP_ALLOCATE;
    st = ucp_mem_map(e->ctx, &params, (ucp_mem_h *)memh);
    if (st != UCS_OK) {
        return (int)st;
    }
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    st = ucp_mem_query((ucp_mem_h)*memh, &attr);
    if (st != UCS_OK) {
        ucp_mem_unmap(e->ctx, (ucp_mem_h)*memh);
        return (int)st;
    }
    *addr = attr.address;
    return (int)UCS_OK;
}

int ucxcomm_rma_mem_unmap(void *eng, void *memh)
{
    return (int)ucp_mem_unmap(((ucxcomm_rma_t *)eng)->ctx, (ucp_mem_h)memh);
}

int ucxcomm_rma_rkey_pack(void *eng, void *memh, char *buf, size_t buflen, size_t *len)
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

int ucxcomm_rma_rkey_unpack(uintptr_t ep, const void *buf, void **rkey)
{
    return (int)ucp_ep_rkey_unpack((ucp_ep_h)ep, buf, (ucp_rkey_h *)rkey);
}

int ucxcomm_rma_rkey_ptr(void *rkey, uint64_t raddr, uintptr_t *ptr)
{
    void *local = NULL;
    ucs_status_t st = ucp_rkey_ptr((ucp_rkey_h)rkey, raddr, &local);
    *ptr = (uintptr_t)local;
    return (int)st;
}

void ucxcomm_rma_rkey_destroy(void *rkey)
{
    ucp_rkey_destroy((ucp_rkey_h)rkey);
}

static void request_param(ucp_request_param_t *param, ucxcomm_rma_t *e)
{
    param->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param->cb.send = request_done;
    param->user_data = e;
}

int ucxcomm_rma_put(void *eng, uintptr_t ep, const void *buf, size_t n, uint64_t raddr,
                    void *rkey, void **req)
{
    ucp_request_param_t param;
    request_param(&param, (ucxcomm_rma_t *)eng);
    return ucxcomm_status_ptr(ucp_put_nbx((ucp_ep_h)ep, buf, n, raddr, (ucp_rkey_h)rkey,
                                          &param), req);
}

int ucxcomm_rma_get(void *eng, uintptr_t ep, void *buf, size_t n, uint64_t raddr,
                    void *rkey, void **req)
{
    ucp_request_param_t param;
    request_param(&param, (ucxcomm_rma_t *)eng);
    return ucxcomm_status_ptr(ucp_get_nbx((ucp_ep_h)ep, buf, n, raddr, (ucp_rkey_h)rkey,
                                          &param), req);
}

int ucxcomm_rma_atomic(void *eng, uintptr_t ep, int op, const void *value, void *reply,
                       size_t size, uint64_t raddr, void *rkey, void **req)
{
    ucp_request_param_t param;
    request_param(&param, (ucxcomm_rma_t *)eng);
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_contig(size);
    if (reply != NULL) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_REPLY_BUFFER;
        param.reply_buffer = reply;
    }
    return ucxcomm_status_ptr(ucp_atomic_op_nbx((ucp_ep_h)ep, (ucp_atomic_op_t)op, value, 1,
                                                raddr, (ucp_rkey_h)rkey, &param), req);
}

int ucxcomm_rma_flush(void *eng, uintptr_t ep, void **req)
{
    ucp_request_param_t param;
    request_param(&param, (ucxcomm_rma_t *)eng);
    return ucxcomm_status_ptr(ucp_ep_flush_nbx((ucp_ep_h)ep, &param), req);
}

unsigned ucxcomm_rma_progress(void *eng)
{
    return ucp_worker_progress(((ucxcomm_rma_t *)eng)->worker);
}

int ucxcomm_rma_test(void *req)
{
    ucs_status_t st = ucp_request_check_status(req);
    if (st == UCS_INPROGRESS) {
        return UCXCOMM_INPROGRESS;
    }
    ucp_request_free(req);
    return (int)st;
}

int ucxcomm_rma_notify_fd(void *eng)
{
    return ((ucxcomm_rma_t *)eng)->notify_fd;
}

void ucxcomm_rma_arm(void *eng)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    __atomic_store_n(&e->notify, 1, __ATOMIC_SEQ_CST);
    /* The waiter stops progressing the worker itself: make sure the thread does. */
    ucp_worker_signal(e->worker);
}

void ucxcomm_rma_disarm(void *eng)
{
    ucxcomm_rma_t *e = (ucxcomm_rma_t *)eng;
    uint64_t value;
    ssize_t n;
    __atomic_store_n(&e->notify, 0, __ATOMIC_SEQ_CST);
    n = read(e->notify_fd, &value, sizeof(value)); /* drain (non-blocking) */
    (void)n;
}
