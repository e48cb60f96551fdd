/* Tensor groups (design 007): copy a range of a group row's elements out of its member tensors
 * (gather, publish) or into them (scatter, pull), in one call per group chunk instead of one
 * numpy slice assignment per member.
 *
 * A member table is two arrays: `ptrs` (uint64, one host address per member: the first element
 * of a contiguous CPU tensor, held alive by the caller for the call) and `starts` (int64, one
 * more than the members: member i holds elements [starts[i], starts[i+1]) of the row). The
 * table is checked on every call (starts from 0, never decreasing, the range inside the row),
 * so a wrong table raises ValueError instead of reading out of range; the addresses themselves
 * are the caller's contract (deltastore.layout.groups builds them from tensors whose shapes the layout
 * check matched to the members). The numpy fallback in deltastore.layout.groups copies the same bytes
 * (tests/layout/test_groups.py). */
#include "ds_native.h"
#include <string.h>

typedef struct {
    Py_buffer buf, ptrs, starts;
    int have_buf, have_ptrs, have_starts;
} tables;

static void release(tables *t) {
    if (t->have_buf) PyBuffer_Release(&t->buf);
    if (t->have_ptrs) PyBuffer_Release(&t->ptrs);
    if (t->have_starts) PyBuffer_Release(&t->starts);
}

/* Parse (buf, ptrs, starts, width, a); check every size. Returns the element width, or -1 with
 * a Python error set (buffers released). */
static int parse(PyObject *args, tables *t, int writable, Py_ssize_t *first, Py_ssize_t *n_members) {
    PyObject *buf, *ptrs, *starts;
    long width;
    Py_ssize_t a;
    memset(t, 0, sizeof(*t));
    if (!PyArg_ParseTuple(args, "OOOln", &buf, &ptrs, &starts, &width, &a)) return -1;
    int w = ds_check_width(width);
    if (w < 0) return -1;
    if (ds_get_buffer(buf, &t->buf, writable, "buf") < 0) goto fail;
    t->have_buf = 1;
    if (ds_get_buffer(ptrs, &t->ptrs, 0, "ptrs") < 0) goto fail;
    t->have_ptrs = 1;
    if (ds_get_buffer(starts, &t->starts, 0, "starts") < 0) goto fail;
    t->have_starts = 1;
    if (t->buf.len % w != 0 || t->ptrs.len % 8 != 0 || t->starts.len % 8 != 0 ||
        t->starts.len != t->ptrs.len + 8) {
        PyErr_SetString(PyExc_ValueError, "member table: buf must hold whole elements and starts one entry more than ptrs");
        goto fail;
    }
    Py_ssize_t n = t->ptrs.len / 8;
    const int64_t *s = (const int64_t *)t->starts.buf;
    if (s[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "member table: starts[0] must be 0");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i + 1] < s[i]) {
            PyErr_Format(PyExc_ValueError, "member table: starts decrease at member %zd", i);
            goto fail;
        }
    }
    Py_ssize_t count = t->buf.len / w;
    if (a < 0 || count > s[n] || a > s[n] - count) {
        PyErr_Format(PyExc_ValueError, "elements [%zd, %zd) are outside the group's %lld", a, a + count, (long long)s[n]);
        goto fail;
    }
    *first = a;
    *n_members = n;
    return w;
fail:
    release(t);
    return -1;
}

/* Copy elements [a, a + count) of the row between `row` (the caller's buffer, element a at
 * row[0]) and the members; to_row: gather, else scatter. */
static void copy_range(char *row, const uint64_t *ptrs, const int64_t *s, Py_ssize_t n, int w, Py_ssize_t a,
                       Py_ssize_t count, int to_row) {
    Py_ssize_t b = a + count;
    /* first member whose range ends after a (binary search over the non-decreasing starts) */
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (s[mid + 1] <= a) lo = mid + 1; else hi = mid;
    }
    for (Py_ssize_t i = lo; i < n && s[i] < b; i++) {
        int64_t from = s[i] > a ? s[i] : a, to = s[i + 1] < b ? s[i + 1] : b;
        if (from >= to) continue;
        char *member = (char *)(uintptr_t)ptrs[i] + (size_t)(from - s[i]) * w;
        char *here = row + (size_t)(from - a) * w;
        size_t len = (size_t)(to - from) * w;
        if (to_row) memcpy(here, member, len); else memmove(member, here, len);
    }
}

static PyObject *run(PyObject *args, int to_row) {
    tables t;
    Py_ssize_t a, n;
    int w = parse(args, &t, to_row, &a, &n);
    if (w < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_range((char *)t.buf.buf, (const uint64_t *)t.ptrs.buf, (const int64_t *)t.starts.buf, n, w, a, t.buf.len / w,
               to_row);
    Py_END_ALLOW_THREADS
    release(&t);
    Py_RETURN_NONE;
}

static PyObject *gather_members(PyObject *self, PyObject *args) {
    (void)self;
    return run(args, 1);
}

static PyObject *scatter_members(PyObject *self, PyObject *args) {
    (void)self;
    return run(args, 0);
}

/* One pass over a list of tensors reading what the per-member checks need (tensors.TensorScan):
 * layout, dtype, is_cpu, is_contiguous() and shape for every tensor; data_ptr() for strided ones
 * (a sparse tensor's raises); is_meta for those not on the CPU. Why native: at 20,000 group
 * members, one Python-level pass per attribute (map over the getter) costs the getter plus
 * ~0.1-0.3 µs of lookup, iteration and result objects per tensor and attribute, and six passes
 * walk the tensors six times.
 *
 * The getters are torch's own Python attributes (getset and method descriptors of
 * torch._C.TensorBase, passed in by the caller), called as `getattr` would call them, so their
 * results are those of the public API; only objects whose type is exactly one of `types`
 * (torch.Tensor, torch.nn.Parameter: no Python-level overrides of these attributes) are read.
 * Anything else, or any getter raising, returns None: the caller then reads the attributes in
 * Python (the same values), and reports problems from there. */
enum { SCAN_LAYOUT, SCAN_DTYPE, SCAN_IS_CPU, SCAN_CONTIGUOUS, SCAN_SHAPE, SCAN_DATA_PTR, SCAN_IS_META, SCAN_N };
enum { FLAG_STRIDED = 1, FLAG_CPU = 2, FLAG_CONTIGUOUS = 4, FLAG_META = 8 };

/* The attribute `d` (a getset or method descriptor, checked by the caller) of tensor `t`. */
static PyObject *get_attr(PyObject *d, PyObject *t) {
    if (Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
        PyGetSetDef *g = ((PyGetSetDescrObject *)d)->d_getset;
        return g->get(t, g->closure);
    }
    return PyObject_Vectorcall(d, &t, 1, NULL); /* method_descriptor: checks t's type itself */
}

/* 1 or 0 for a bool result (consumed), -1 on an error or a non-bool. */
static int take_bool(PyObject *r) {
    if (r == NULL) return -1;
    int v = r == Py_True ? 1 : r == Py_False ? 0 : -1;
    Py_DECREF(r);
    return v;
}

static PyObject *scan_tensors(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *types, *strided, *descrs;
    if (!PyArg_ParseTuple(args, "O!O!OO!", &PyList_Type, &tensors, &PyTuple_Type, &types, &strided, &PyTuple_Type,
                          &descrs))
        return NULL;
    if (PyTuple_GET_SIZE(descrs) != SCAN_N) {
        PyErr_SetString(PyExc_ValueError, "scan_tensors: descrs must hold 7 descriptors");
        return NULL;
    }
    PyObject *d[SCAN_N];
    for (int k = 0; k < SCAN_N; k++) {
        d[k] = PyTuple_GET_ITEM(descrs, k);
        if (!Py_IS_TYPE(d[k], &PyGetSetDescr_Type) && !Py_IS_TYPE(d[k], &PyMethodDescr_Type)) {
            PyErr_SetString(PyExc_TypeError, "scan_tensors: descrs must be getset or method descriptors");
            return NULL;
        }
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(types); j++) {
        PyObject *tp = PyTuple_GET_ITEM(types, j);
        /* every type must be one whose instances the getset descriptors accept */
        for (int k = 0; k < SCAN_N; k++) {
            if (!PyType_Check(tp) ||
                (Py_IS_TYPE(d[k], &PyGetSetDescr_Type) &&
                 !PyType_IsSubtype((PyTypeObject *)tp, ((PyDescrObject *)d[k])->d_type))) {
                PyErr_SetString(PyExc_TypeError, "scan_tensors: types must be subtypes of the descriptors' type");
                return NULL;
            }
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *dtypes = PyList_New(n);
    PyObject *flags = PyBytes_FromStringAndSize(NULL, n);
    PyObject *ptrs = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *ndims = PyBytes_FromStringAndSize(NULL, n * 8);
    int64_t *dims = NULL;
    Py_ssize_t n_dims = 0, cap = 0;
    PyObject *out = NULL;
    if (dtypes == NULL || flags == NULL || ptrs == NULL || ndims == NULL) goto done;
    uint8_t *f = (uint8_t *)PyBytes_AS_STRING(flags);
    uint64_t *p = (uint64_t *)PyBytes_AS_STRING(ptrs);
    int64_t *nd = (int64_t *)PyBytes_AS_STRING(ndims);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(dtypes, i, Py_NewRef(Py_None));
        f[i] = 0;
        p[i] = 0;
        nd[i] = -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the list may be changed by a getter (torch function modes run Python): re-read it */
        if (i >= PyList_GET_SIZE(tensors)) goto unsupported;
        PyObject *t = PyList_GET_ITEM(tensors, i);
        Py_INCREF(t);
        int known = 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(types); j++) known |= (PyObject *)Py_TYPE(t) == PyTuple_GET_ITEM(types, j);
        if (!known) {
            Py_DECREF(t);
            goto unsupported;
        }
        PyObject *layout = get_attr(d[SCAN_LAYOUT], t);
        PyObject *dtype = layout ? get_attr(d[SCAN_DTYPE], t) : NULL;
        int cpu = dtype ? take_bool(get_attr(d[SCAN_IS_CPU], t)) : -1;
        int contiguous = cpu >= 0 ? take_bool(get_attr(d[SCAN_CONTIGUOUS], t)) : -1;
        int is_strided = layout == strided;
        Py_XDECREF(layout);
        if (dtype == NULL || cpu < 0 || contiguous < 0) {
            Py_XDECREF(dtype);
            Py_DECREF(t);
            goto unsupported;
        }
        PyObject *old = PyList_GET_ITEM(dtypes, i);
        PyList_SET_ITEM(dtypes, i, dtype);
        Py_DECREF(old);
        f[i] = (uint8_t)((is_strided ? FLAG_STRIDED : 0) | (cpu ? FLAG_CPU : 0) | (contiguous ? FLAG_CONTIGUOUS : 0));
        if (!cpu) {
            int meta = take_bool(get_attr(d[SCAN_IS_META], t));
            if (meta < 0) {
                Py_DECREF(t);
                goto unsupported;
            }
            f[i] |= meta ? FLAG_META : 0;
        }
        PyObject *shape = get_attr(d[SCAN_SHAPE], t);
        PyObject *ptr = shape && is_strided ? get_attr(d[SCAN_DATA_PTR], t) : NULL;
        Py_DECREF(t);
        if (shape == NULL || !PyTuple_Check(shape) || (is_strided && (ptr == NULL || !PyLong_Check(ptr)))) {
            Py_XDECREF(shape);
            Py_XDECREF(ptr);
            goto unsupported;
        }
        if (ptr != NULL) {
            p[i] = (uint64_t)PyLong_AsUnsignedLongLongMask(ptr);
            Py_DECREF(ptr);
        }
        Py_ssize_t k = PyTuple_GET_SIZE(shape);
        if (n_dims + k > cap) {
            Py_ssize_t want = (cap ? cap * 2 : 1024) + k;
            int64_t *grown = PyMem_Realloc(dims, (size_t)want * sizeof(int64_t));
            if (grown == NULL) {
                Py_DECREF(shape);
                PyErr_NoMemory();
                goto done;
            }
            dims = grown;
            cap = want;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(shape);
                goto unsupported;
            }
            dims[n_dims + j] = (int64_t)v;
        }
        n_dims += k;
        nd[i] = (int64_t)k;
        Py_DECREF(shape);
    }
    {
        PyObject *flat = PyBytes_FromStringAndSize((const char *)dims, n_dims * (Py_ssize_t)sizeof(int64_t));
        if (flat != NULL) out = PyTuple_Pack(5, dtypes, flags, ptrs, ndims, flat);
        Py_XDECREF(flat);
    }
    goto done;
unsupported:
    PyErr_Clear();
    out = Py_NewRef(Py_None);
done:
    PyMem_Free(dims);
    Py_XDECREF(dtypes);
    Py_XDECREF(flags);
    Py_XDECREF(ptrs);
    Py_XDECREF(ndims);
    return out;
}

PyMethodDef ds_groups_methods[] = {
    {"gather_members", gather_members, METH_VARARGS,
     "gather_members(out, ptrs, starts, width, a): elements [a, a + len(out) / width) of a group row "
     "copied out of its members into the writable buffer out (GIL released)."},
    {"scatter_members", scatter_members, METH_VARARGS,
     "scatter_members(src, ptrs, starts, width, a): the elements in src written to elements "
     "[a, a + len(src) / width) of a group row, into its members (GIL released)."},
    {"scan_tensors", scan_tensors, METH_VARARGS,
     "scan_tensors(tensors, types, strided, descrs) -> (dtypes, flags, ptrs, ndims, dims) or None: one pass "
     "reading layout, dtype, is_cpu, is_contiguous(), shape, data_ptr() and is_meta (descrs, in that order) of "
     "every tensor of the list. flags: a byte per tensor (1 strided, 2 CPU, 4 contiguous, 8 meta); ptrs: "
     "uint64 per tensor (0 unless strided); ndims: int64 per tensor; dims: the tensors' sizes, "
     "concatenated (int64). None when a tensor's type is not exactly one of types or a getter "
     "raised (the caller reads the attributes in Python instead)."},
    {NULL, NULL, 0, NULL},
};
