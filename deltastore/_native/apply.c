/* Decode/apply kernels (issue 9, N3). Stub: an empty table until they land. */
#include "ds_native.h"

PyMethodDef ds_apply_methods[] = {
    {NULL, NULL, 0, NULL},
};
