/*
 * The tag message path on a ucxx-owned worker and its endpoints. Requests are created
 * without callbacks and polled with ucxcomm_test(), which frees them once complete:
 * completions are consumed by the Python progress engine, no callback thread involved.
 */
#include <string.h>

#include "ucxcomm_internal.h"

int ucxcomm_tag_send(uintptr_t ep, const void *buf, size_t n, uint64_t tag, int fast,
                     void **req)
{
    ucp_request_param_t param;
    /* fast: ask for fast local completion, which makes UCX pick multi-fragment eager up
     * to 256 KiB on shared memory instead of rendezvous from ~5 KiB (the caller decides
     * per endpoint and size; measured in docs/design.md). */
    param.op_attr_mask = fast ? UCP_OP_ATTR_FLAG_FAST_CMPL : 0;
    return ucxcomm_status_ptr(ucp_tag_send_nbx((ucp_ep_h)ep, buf, n, tag, &param), req);
}

int ucxcomm_tag_recv(uintptr_t worker, void *buf, size_t n, uint64_t tag, uint64_t mask,
                     void **req, uint64_t *sender_tag, size_t *length)
{
    ucp_tag_recv_info_t info;
    ucp_request_param_t param;
    int st;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
    param.recv_info.tag_info = &info;
    info.sender_tag = 0;
    info.length = 0;
    st = ucxcomm_status_ptr(ucp_tag_recv_nbx((ucp_worker_h)worker, buf, n, tag, mask,
                                             &param), req);
    if (st == UCS_OK || st == UCS_ERR_MESSAGE_TRUNCATED) {
        *sender_tag = info.sender_tag;
        *length = info.length;
    }
    return st;
}

int ucxcomm_tag_probe(uintptr_t worker, uint64_t tag, uint64_t mask, int remove,
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

int ucxcomm_msg_recv(uintptr_t worker, void *buf, size_t n, void *msg, void **req,
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

int ucxcomm_test(void *req, int is_recv, uint64_t *sender_tag, size_t *length)
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

unsigned ucxcomm_progress(uintptr_t worker)
{
    return ucp_worker_progress((ucp_worker_h)worker);
}

int ucxcomm_arm(uintptr_t worker)
{
    ucs_status_t st = ucp_worker_arm((ucp_worker_h)worker);
    if (st == UCS_ERR_BUSY) {
        return 0;
    }
    return st == UCS_OK ? 1 : (int)st;
}

void ucxcomm_cancel(uintptr_t worker, void *req)
{
    ucp_request_cancel((ucp_worker_h)worker, req);
}

/* Endpoint failures UCX reported to us (ucxcomm_ep_catch_errors): a count, and the
 * last few endpoints (a ring), so that closing one knows UCX failed it. */
#define FAILED_EPS_KEPT 64
static unsigned long ucxcomm_ep_failures_seen;
static uintptr_t ucxcomm_failed_eps[FAILED_EPS_KEPT];

static void ucxcomm_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    unsigned long n;
    (void)arg;
    (void)status;
    /* Nothing else to do: UCX already failed the endpoint's requests with the error,
     * and the peer's death reaches the Python side through the bootstrap store too. */
    n = __atomic_fetch_add(&ucxcomm_ep_failures_seen, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&ucxcomm_failed_eps[n % FAILED_EPS_KEPT], (uintptr_t)ep,
                     __ATOMIC_RELAXED);
}

int ucxcomm_ep_catch_errors(uintptr_t ep)
{
    ucp_ep_params_t params;
    ucs_status_ptr_t sp;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = ucxcomm_ep_err_cb;
    params.err_handler.arg = NULL;
    sp = ucp_ep_modify_nb((ucp_ep_h)ep, &params);
    if (sp == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        return (int)UCS_PTR_STATUS(sp);
    }
    ucp_request_free(sp); /* (UCX 1.21 completes it in place; not reached) */
    return UCS_OK;
}

void ucxcomm_ep_catch_errors_params(ucp_ep_params_t *params)
{
    params->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params->err_handler.cb = ucxcomm_ep_err_cb;
    params->err_handler.arg = NULL;
}

unsigned long ucxcomm_ep_failures(void)
{
    return __atomic_load_n(&ucxcomm_ep_failures_seen, __ATOMIC_RELAXED);
}

int ucxcomm_ep_failed(uintptr_t ep, int forget)
{
    size_t i;
    if (ep == 0) { /* (a closed ucxx endpoint's handle; also what empty slots hold) */
        return 0;
    }
    for (i = 0; i < FAILED_EPS_KEPT; i++) {
        if (__atomic_load_n(&ucxcomm_failed_eps[i], __ATOMIC_RELAXED) == ep) {
            if (forget) { /* (the handle may be reused once the endpoint is closed) */
                __atomic_store_n(&ucxcomm_failed_eps[i], 0, __ATOMIC_RELAXED);
            }
            return 1;
        }
    }
    return 0;
}
