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

/* helpers defined below */
int ucxcomm_ep_transports(uintptr_t ep, char *out, size_t outlen);
const char *ucxcomm_libucp_path(void);
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
