/* deltastore._native: helpers of the anchor (full/2) encoder that judge a byte plane from a
 * sample before it is entropy coded (deltastore/codec/planes.py, byte_counts). */
#include "ds_native.h"

PyDoc_STRVAR(byte_histogram_doc,
"byte_histogram(plane, stride, out)\n\n"
"Counts of each byte value in plane[::stride] (what numpy.bincount(plane[::stride],\n"
"minlength=256) returns), written to `out`: a writable buffer of 256 int64. Releases the GIL.");

static PyObject *py_byte_histogram(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    Py_ssize_t stride;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnO:byte_histogram", &src_obj, &stride, &out_obj)) return NULL;
    if (stride < 1) {
        PyErr_SetString(PyExc_ValueError, "stride must be at least 1");
        return NULL;
    }
    Py_buffer sb, ob;
    if (ds_get_buffer(src_obj, &sb, 0, "plane") < 0) return NULL;
    if (ds_get_buffer(out_obj, &ob, 1, "out") < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    if (ob.len != 256 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "out must hold 256 int64 counts");
        PyBuffer_Release(&sb);
        PyBuffer_Release(&ob);
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)sb.buf;
    size_t n = (size_t)sb.len, step = (size_t)stride;
    int64_t counts[256];
    Py_BEGIN_ALLOW_THREADS
    memset(counts, 0, sizeof counts);
    for (size_t i = 0; i < n; i += step) counts[p[i]]++;
    Py_END_ALLOW_THREADS
    memcpy(ob.buf, counts, sizeof counts); /* out may be unaligned: copy, don't cast */
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

PyMethodDef ds_planes_methods[] = {
    {"byte_histogram", py_byte_histogram, METH_VARARGS, byte_histogram_doc},
    {NULL, NULL, 0, NULL},
};
