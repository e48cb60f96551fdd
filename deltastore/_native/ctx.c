/* Conditioned-codec kernels (benchmarks/conditioned.py; built only with that codec). Stub: an empty table. */
#include "ds_native.h"

PyMethodDef ds_ctx_methods[] = {
    {NULL, NULL, 0, NULL},
};
