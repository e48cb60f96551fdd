/* Conditioned-codec kernels (issue 9, N4; only if that codec is built). Stub: an empty table. */
#include "ds_native.h"

PyMethodDef ds_ctx_methods[] = {
    {NULL, NULL, 0, NULL},
};
