/* Tensor groups (design 007): copy a range of a group row's elements out of its member tensors
 * (gather, publish) or into them (scatter, pull), in one call per group chunk instead of one
 * numpy slice assignment per member.
 *
 * A member table is two arrays: `ptrs` (uint64, one host address per member: the first element
 * of a contiguous CPU tensor, held alive by the caller for the call) and `starts` (int64, one
 * more than the members: member i holds elements [starts[i], starts[i+1]) of the row). The
 * table is checked on every call (starts from 0, never decreasing, the range inside the row),
 * so a wrong table raises ValueError instead of reading out of range; the addresses themselves
 * are the caller's contract (deltastore.groups builds them from tensors whose shapes the layout
 * check matched to the members). The numpy fallback in deltastore.groups copies the same bytes
 * (tests/test_groups_native.py). */
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

PyMethodDef ds_groups_methods[] = {
    {"gather_members", gather_members, METH_VARARGS,
     "gather_members(out, ptrs, starts, width, a): elements [a, a + len(out) / width) of a group row "
     "copied out of its members into the writable buffer out (GIL released)."},
    {"scatter_members", scatter_members, METH_VARARGS,
     "scatter_members(src, ptrs, starts, width, a): the elements in src written to elements "
     "[a, a + len(src) / width) of a group row, into its members (GIL released)."},
    {NULL, NULL, 0, NULL},
};
