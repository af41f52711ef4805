/* Library facts for Python: UCX constants by name, version, library path, lanes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucs/debug/log_def.h>

#include "ucxcomm_internal.h"

#define UCXCOMM_CONST(name) {#name, (long)(name)}

/* Everything Python maps or passes (ucxcomm/transport/_ucx.py reads these by name). */
static const ucxcomm_const_t ucxcomm_const_table[] = {
    UCXCOMM_CONST(UCS_OK),
    UCXCOMM_CONST(UCS_ERR_CANCELED),
    UCXCOMM_CONST(UCS_ERR_MESSAGE_TRUNCATED),
    UCXCOMM_CONST(UCS_ERR_CONNECTION_RESET),
    UCXCOMM_CONST(UCS_ERR_ENDPOINT_TIMEOUT),
    UCXCOMM_CONST(UCS_ERR_UNREACHABLE),
    UCXCOMM_CONST(UCS_ERR_NOT_CONNECTED),
    UCXCOMM_CONST(UCS_ERR_REJECTED),
    UCXCOMM_CONST(UCS_ERR_IO_ERROR),
    UCXCOMM_CONST(UCS_ERR_SHMEM_SEGMENT),
    UCXCOMM_CONST(UCS_ERR_TIMED_OUT),
    UCXCOMM_CONST(UCS_ERR_BUFFER_TOO_SMALL),
    UCXCOMM_CONST(UCS_ERR_NO_MEMORY),
    UCXCOMM_CONST(UCP_ATOMIC_OP_ADD),
    UCXCOMM_CONST(UCP_ATOMIC_OP_SWAP),
    UCXCOMM_CONST(UCP_ATOMIC_OP_CSWAP),
    UCXCOMM_CONST(UCP_ATOMIC_OP_AND),
    UCXCOMM_CONST(UCP_ATOMIC_OP_OR),
    UCXCOMM_CONST(UCP_ATOMIC_OP_XOR),
};

const ucxcomm_const_t *ucxcomm_constants(size_t *count)
{
    *count = sizeof(ucxcomm_const_table) / sizeof(ucxcomm_const_table[0]);
    return ucxcomm_const_table;
}

const char *ucxcomm_status_string(int status)
{
    return ucs_status_string((ucs_status_t)status);
}

const char *ucxcomm_version_string(void)
{
    return ucp_get_version_string();
}

const char *ucxcomm_libucp_path(void)
{
    Dl_info info;
    if (dladdr((void *)&ucp_get_version_string, &info) && info.dli_fname) {
        return info.dli_fname;
    }
    return "";
}

int ucxcomm_ep_transports(uintptr_t ep, char *out, size_t outlen)
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

long ucxcomm_ep_info(uintptr_t ep, char *out, size_t outlen)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f == NULL) {
        return -1;
    }
    ucp_ep_print_info((ucp_ep_h)ep, f);
    if (fclose(f) != 0 || text == NULL) {
        free(text);
        return -1;
    }
    if (outlen > 0) {
        size_t n = len < outlen - 1 ? len : outlen - 1;
        memcpy(out, text, n);
        out[n] = '\0';
    }
    free(text);
    return (long)len;
}

/* ---- quieting UCX's log while an expected failure may happen */
#define QUIET_KEEP 8
static unsigned quieted; /* messages swallowed since the last push */
static char quiet_text[QUIET_KEEP][256]; /* the first of them, formatted */

static ucs_log_func_rc_t quiet_handler(const char *file, unsigned line,
                                       const char *function, ucs_log_level_t level,
                                       const ucs_log_component_config_t *comp_conf,
                                       const char *message, va_list ap)
{
    (void)function;
    (void)comp_conf;
    if (level > UCS_LOG_LEVEL_WARN) {
        return UCS_LOG_FUNC_RC_CONTINUE;
    }
    if (quieted < QUIET_KEEP) {
        char *out = quiet_text[quieted];
        int n = snprintf(out, sizeof(quiet_text[0]), "%s:%u %s ", file, line,
                         ucs_log_level_names[level]);
        if (n >= 0 && (size_t)n < sizeof(quiet_text[0])) {
            va_list copy;
            va_copy(copy, ap);
            vsnprintf(out + n, sizeof(quiet_text[0]) - (size_t)n, message, copy);
            va_end(copy);
        }
    }
    ++quieted;
    return UCS_LOG_FUNC_RC_STOP;
}

const char *ucxcomm_log_quieted(unsigned i)
{
    return i < quieted && i < QUIET_KEEP ? quiet_text[i] : NULL;
}

void ucxcomm_log_quiet_push(void)
{
    quieted = 0;
    ucs_log_push_handler(quiet_handler);
}

unsigned ucxcomm_log_quiet_pop(void)
{
    ucs_log_pop_handler();
    return quieted;
}


/* ---- ucxx's report of an endpoint error (ucxx::Endpoint::endpointErrorCallback) */
static unsigned long ucxx_ep_errors; /* reports dropped */

static ucs_log_func_rc_t ucxx_ep_error_handler(const char *file, unsigned line,
                                               const char *function,
                                               ucs_log_level_t level,
                                               const ucs_log_component_config_t *comp_conf,
                                               const char *message, va_list ap)
{
    (void)file;
    (void)line;
    (void)level;
    (void)message;
    (void)ap;
    if (comp_conf != NULL && strcmp(comp_conf->name, "UCXX") == 0 && function != NULL &&
        strcmp(function, "endpointErrorCallback") == 0) {
        __atomic_add_fetch(&ucxx_ep_errors, 1, __ATOMIC_RELAXED);
        return UCS_LOG_FUNC_RC_STOP;
    }
    return UCS_LOG_FUNC_RC_CONTINUE;
}

void ucxcomm_log_drop_ucxx_ep_errors(void)
{
    static int installed;
    if (!installed) {
        installed = 1;
        ucs_log_push_handler(ucxx_ep_error_handler);
    }
}

unsigned long ucxcomm_log_ucxx_ep_errors(void)
{
    return __atomic_load_n(&ucxx_ep_errors, __ATOMIC_RELAXED);
}


/* ---- UCX's report, at worker teardown, of requests it could not purge: after a peer
 * died in the middle of a rendezvous send on an endpoint without UCX error handling,
 * the send waits for an acknowledgement that never comes and UCX refuses a forced close
 * there, so the request (and the registration of its buffer) is still out when the
 * worker goes ("... was not returned to mpool ucp_requests", "ucp_rcache: destroying
 * inuse region"). Once a peer failed, those lines say nothing new: dropped. */
static unsigned long lost_requests; /* lines dropped */

static ucs_log_func_rc_t lost_requests_handler(const char *file, unsigned line,
                                               const char *function,
                                               ucs_log_level_t level,
                                               const ucs_log_component_config_t *comp_conf,
                                               const char *message, va_list ap)
{
    char text[256];
    va_list copy;
    (void)file;
    (void)line;
    (void)function;
    (void)comp_conf;
    if (level != UCS_LOG_LEVEL_WARN) {
        return UCS_LOG_FUNC_RC_CONTINUE;
    }
    va_copy(copy, ap);
    vsnprintf(text, sizeof(text), message, copy);
    va_end(copy);
    if (strstr(text, "not returned to mpool") == NULL &&
        strstr(text, "destroying inuse region") == NULL) {
        return UCS_LOG_FUNC_RC_CONTINUE;
    }
    __atomic_add_fetch(&lost_requests, 1, __ATOMIC_RELAXED);
    return UCS_LOG_FUNC_RC_STOP;
}

void ucxcomm_log_drop_lost_requests(void)
{
    static int installed;
    if (!installed) {
        installed = 1;
        ucs_log_push_handler(lost_requests_handler);
    }
}

unsigned long ucxcomm_log_lost_requests(void)
{
    return __atomic_load_n(&lost_requests, __ATOMIC_RELAXED);
}
