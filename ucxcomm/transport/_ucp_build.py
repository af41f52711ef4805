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
#define UCXCOMM_INPROGRESS ...
static const int UCS_ERR_CANCELED;
static const int UCS_ERR_MESSAGE_TRUNCATED;
static const int UCS_ERR_CONNECTION_RESET;
static const int UCS_ERR_ENDPOINT_TIMEOUT;
static const int UCS_ERR_UNREACHABLE;
static const int UCS_ERR_NOT_CONNECTED;
static const int UCS_ERR_REJECTED;
static const int UCS_ERR_IO_ERROR;
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
        libraries=["ucp", "ucs", "dl"],
        extra_compile_args=["-O2"],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
