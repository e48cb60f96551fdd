/* deltastore._native: module init and the helpers every kernel file shares. */
#include "ds_native.h"

PyObject *ds_hex128(uint64_t high, uint64_t low) {
    static const char digits[] = "0123456789abcdef";
    char out[32];
    for (int i = 0; i < 16; i++) {
        out[i] = digits[(high >> (60 - 4 * i)) & 15];
        out[16 + i] = digits[(low >> (60 - 4 * i)) & 15];
    }
    return PyUnicode_FromStringAndSize(out, 32);
}

int ds_get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

int ds_check_width(long width) {
    if (width == 1 || width == 2 || width == 4 || width == 8) return (int)width;
    PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8, got %ld", width);
    return -1;
}

PyDoc_STRVAR(untrack_doc,
"untrack(objects: list) -> None\n\n"
"Take each object of the list out of the cyclic collector's sets (PyObject_GC_UnTrack; a\n"
"non-container or an object already untracked is left as it is). For immutable, acyclic\n"
"trees of objects that live long (a cached manifest's chunk table): the collector then\n"
"never walks them. Only objects that can be in no reference cycle may be passed: a cycle\n"
"through an untracked object is never collected.");

static PyObject *py_untrack(PyObject *self, PyObject *objects) {
    (void)self;
    if (!PyList_CheckExact(objects)) {
        PyErr_SetString(PyExc_TypeError, "untrack takes a list");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); i++) {
        PyObject *o = PyList_GET_ITEM(objects, i);
        if (PyObject_IS_GC(o)) PyObject_GC_UnTrack(o);  /* a no-op when not tracked */
    }
    Py_RETURN_NONE;
}

/* Large output buffers kept for reuse (ds_pool_get / ds_pool_put, under the GIL): a kernel that
 * hands its output to Python (ds_buffer_take) gets the memory of an earlier, released output
 * back, already faulted in, instead of fresh pages (a page fault and its zeroing per 4 KiB cost
 * the change lists a third of the scan that writes them). */
#define POOL_MAX 64
#define POOL_MIN_CAP (64 * 1024)
/* What the pool may hold in all: after a version that changed much, it keeps no more than this. */
#define POOL_MAX_BYTES ((size_t)256 * 1024 * 1024)
static struct {
    void *p;
    size_t cap;
} pool[POOL_MAX];
static int pool_n;
static size_t pool_bytes;

void *ds_pool_get(size_t *cap) {
    if (pool_n == 0) {
        *cap = 0;
        return NULL;
    }
    pool_n--;
    *cap = pool[pool_n].cap;
    pool_bytes -= *cap;
    return pool[pool_n].p;
}

void ds_pool_put(void *p, size_t cap) {
    if (p != NULL && cap >= POOL_MIN_CAP && pool_n < POOL_MAX && pool_bytes + cap <= POOL_MAX_BYTES) {
        pool[pool_n].p = p;
        pool[pool_n].cap = cap;
        pool_n++;
        pool_bytes += cap;
    } else {
        free(p);
    }
}

/* A read-only buffer over memory a kernel allocated with malloc, returned to the pool with the
 * object: a kernel's large output handed to Python without copying it into a bytes object. */
typedef struct {
    PyObject_HEAD
    void *p;
    Py_ssize_t len;
    size_t cap;
} ds_buffer;

static int ds_buffer_getbuffer(PyObject *o, Py_buffer *view, int flags) {
    ds_buffer *b = (ds_buffer *)o;
    static char empty[1];
    return PyBuffer_FillInfo(view, o, b->p != NULL ? b->p : empty, b->len, 1, flags);
}

static void ds_buffer_dealloc(PyObject *o) {
    ds_pool_put(((ds_buffer *)o)->p, ((ds_buffer *)o)->cap);
    Py_TYPE(o)->tp_free(o);
}

static Py_ssize_t ds_buffer_length(PyObject *o) { return ((ds_buffer *)o)->len; }

static PyBufferProcs ds_buffer_as_buffer = {ds_buffer_getbuffer, NULL};
static PySequenceMethods ds_buffer_as_sequence = {.sq_length = ds_buffer_length};

static PyTypeObject ds_buffer_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deltastore._native.Buffer",
    .tp_basicsize = sizeof(ds_buffer),
    .tp_dealloc = ds_buffer_dealloc,
    .tp_as_buffer = &ds_buffer_as_buffer,
    .tp_as_sequence = &ds_buffer_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Read-only bytes a kernel produced (the buffer protocol; len() is its size in bytes).",
};

PyObject *ds_buffer_take(void *p, size_t len, size_t cap) {
    ds_buffer *b = PyObject_New(ds_buffer, &ds_buffer_type);
    if (b == NULL) {
        free(p);
        return NULL;
    }
    b->p = p;
    b->len = (Py_ssize_t)len;
    b->cap = cap;
    return (PyObject *)b;
}

static PyMethodDef ds_module_methods[] = {
    {"untrack", py_untrack, METH_O, untrack_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ds_module = {
    PyModuleDef_HEAD_INIT,
    "deltastore._native",
    "Native kernels of deltastore's codec (import them through deltastore._util.kernels).",
    -1,
    ds_module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ds_buffer_type) < 0) return NULL;
    PyObject *m = PyModule_Create(&ds_module);
    if (m == NULL) return NULL;
    if (PyModule_AddFunctions(m, ds_encode_methods) < 0 || PyModule_AddFunctions(m, ds_apply_methods) < 0 ||
        PyModule_AddFunctions(m, ds_ctx_methods) < 0 ||
        PyModule_AddFunctions(m, ds_planes_methods) < 0 || PyModule_AddFunctions(m, ds_groups_methods) < 0 ||
        PyModule_AddFunctions(m, ds_zstd_methods) < 0 || PyModule_AddFunctions(m, ds_full_methods) < 0 ||
        PyModule_AddFunctions(m, ds_quant_methods) < 0 || PyModule_AddFunctions(m, ds_requant_methods) < 0 ||
        PyModule_AddIntConstant(m, "ABI", DS_NATIVE_ABI) < 0 ||
        PyModule_AddIntConstant(m, "GAP_ESCAPE", DS_GAP_ESCAPE) < 0 ||
        PyModule_AddIntConstant(m, "NIBBLE_ESCAPE", DS_NIBBLE_ESCAPE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
