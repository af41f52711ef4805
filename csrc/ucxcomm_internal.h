/* Pieces shared by ucxcomm's C units (not part of the Python-facing API). */
#ifndef UCXCOMM_INTERNAL_H
#define UCXCOMM_INTERNAL_H

#include <ucp/api/ucp.h>

#include "ucxcomm_ucp.h"

/* A ucs_status_ptr_t as our return convention: UCS_OK (done, *req = NULL), a negative
 * status (failed), or UCXCOMM_INPROGRESS with *req set. */
static inline int ucxcomm_status_ptr(ucs_status_ptr_t sp, void **req)
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

/* The same error callback for an endpoint about to be created (rma.c). */
void ucxcomm_ep_catch_errors_params(ucp_ep_params_t *params);

#endif /* UCXCOMM_INTERNAL_H */
