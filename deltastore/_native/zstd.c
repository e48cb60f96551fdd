/* zstd frames decoded in one call without the GIL, through the system's libzstd (loaded at run
 * time: nothing to build against, nothing to install).
 *
 * Decoded one python-zstandard call each, a segment's zstd sections gave the GIL up and waited
 * to take it back once per section, a cost that adds up on several apply threads
 * (docs/design/006-native-kernels.md). `zstd_decompress` decodes all of a segment's frames in
 * one GIL release. Decoding is fixed by the zstd format (RFC 8878),
 * so any libzstd gives the bytes python-zstandard's bundled one gives; the checks below are the
 * ones deltastore.codec.planes.decode_sections makes around python-zstandard (declared content
 * size, exactly one frame and no trailing bytes, exactly the raw size out), and the output
 * buffer is the raw size the section table declares: a frame that would write more fails
 * without writing past it. Without a libzstd (or on Windows) `zstd_version()` is None and the
 * Python path decodes. */
#include "ds_native.h"

#if !defined(_WIN32)
#include <dlfcn.h>
#include <pthread.h>
#define DS_HAVE_DLOPEN 1
#endif

/* The libzstd API used (stable since zstd 1.3.0; 1.4.0 or newer is required below). */
#define DS_ZSTD_CONTENTSIZE_UNKNOWN (0ULL - 1)
#define DS_ZSTD_CONTENTSIZE_ERROR (0ULL - 2)
typedef void *(*create_dctx_fn)(void);
typedef size_t (*free_dctx_fn)(void *);
typedef size_t (*decompress_dctx_fn)(void *, void *, size_t, const void *, size_t);
typedef unsigned long long (*frame_content_size_fn)(const void *, size_t);
typedef size_t (*find_frame_size_fn)(const void *, size_t);
typedef unsigned (*is_error_fn)(size_t);
typedef const char *(*error_name_fn)(size_t);
typedef unsigned (*version_fn)(void);
typedef struct { const void *src; size_t size; size_t pos; } ds_in_t;  /* ZSTD_inBuffer */
typedef struct { void *dst; size_t size; size_t pos; } ds_out_t;       /* ZSTD_outBuffer */
typedef size_t (*decompress_stream_fn)(void *, ds_out_t *, ds_in_t *);
typedef size_t (*set_parameter_fn)(void *, int, int);
typedef void *(*create_cctx_fn)(void);
typedef size_t (*free_cctx_fn)(void *);
typedef size_t (*compress2_fn)(void *, void *, size_t, const void *, size_t);
typedef size_t (*compress_bound_fn)(size_t);

static struct {
    int tried;
    unsigned version; /* 0: not loaded */
    create_dctx_fn create_dctx;
    free_dctx_fn free_dctx;
    decompress_dctx_fn decompress_dctx;
    frame_content_size_fn frame_content_size;
    find_frame_size_fn find_frame_size;
    is_error_fn is_error;
    error_name_fn error_name;
    decompress_stream_fn decompress_stream;
    set_parameter_fn set_parameter;
    /* compression (planes.c's add_sparse_segment), when the library has it */
    int compresses;
    create_cctx_fn create_cctx;
    free_cctx_fn free_cctx;
    set_parameter_fn cctx_set_parameter;
    compress2_fn compress2;
    compress_bound_fn compress_bound;
} Z;

/* The byte planes' compression parameters, deltastore.codec.planes.ZSTD_PLANE_PARAMS (ZSTD_c_*
 * ids, stable since zstd 1.4.0): windowLog, hashLog, chainLog, searchLog, minMatch,
 * targetLength, strategy. zstd_plane_params() returns them; the Python side compares them and
 * the frames written here with python-zstandard's before it uses them. */
static const int plane_params[7][2] = {{101, 17}, {102, 6}, {103, 0}, {104, 1}, {105, 7}, {106, 0}, {107, 1}};

/* ZSTD_d_windowLogMax (stable since zstd 1.4.0). */
#define DS_ZSTD_D_WINDOWLOGMAX 100

#ifdef DS_HAVE_DLOPEN
static pthread_key_t dctx_key, cctx_key;

static void free_dctx(void *d) {
    if (d) Z.free_dctx(d);
}

static void free_cctx(void *c) {
    if (c) Z.free_cctx(c);
}

/* Called with the GIL held (module functions only), so once. */
static void zstd_load(void) {
    if (Z.tried) return;
    Z.tried = 1;
    static const char *const names[] = {"libzstd.so.1", "libzstd.1.dylib", "libzstd.so", "libzstd.dylib"};
    void *h = NULL;
    for (size_t i = 0; i < sizeof names / sizeof *names && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    version_fn version = (version_fn)dlsym(h, "ZSTD_versionNumber");
    Z.create_dctx = (create_dctx_fn)dlsym(h, "ZSTD_createDCtx");
    Z.free_dctx = (free_dctx_fn)dlsym(h, "ZSTD_freeDCtx");
    Z.decompress_dctx = (decompress_dctx_fn)dlsym(h, "ZSTD_decompressDCtx");
    Z.frame_content_size = (frame_content_size_fn)dlsym(h, "ZSTD_getFrameContentSize");
    Z.find_frame_size = (find_frame_size_fn)dlsym(h, "ZSTD_findFrameCompressedSize");
    Z.is_error = (is_error_fn)dlsym(h, "ZSTD_isError");
    Z.error_name = (error_name_fn)dlsym(h, "ZSTD_getErrorName");
    Z.decompress_stream = (decompress_stream_fn)dlsym(h, "ZSTD_decompressStream");
    Z.set_parameter = (set_parameter_fn)dlsym(h, "ZSTD_DCtx_setParameter");
    if (!version || !Z.create_dctx || !Z.free_dctx || !Z.decompress_dctx || !Z.frame_content_size ||
        !Z.find_frame_size || !Z.is_error || !Z.error_name || !Z.decompress_stream || !Z.set_parameter ||
        version() < 10400 ||
        pthread_key_create(&dctx_key, free_dctx) != 0) {
        dlclose(h);
        return;
    }
    Z.version = version(); /* the handle stays open for the process's life */
    Z.create_cctx = (create_cctx_fn)dlsym(h, "ZSTD_createCCtx");
    Z.free_cctx = (free_cctx_fn)dlsym(h, "ZSTD_freeCCtx");
    Z.cctx_set_parameter = (set_parameter_fn)dlsym(h, "ZSTD_CCtx_setParameter");
    Z.compress2 = (compress2_fn)dlsym(h, "ZSTD_compress2");
    Z.compress_bound = (compress_bound_fn)dlsym(h, "ZSTD_compressBound");
    Z.compresses = Z.create_cctx && Z.free_cctx && Z.cctx_set_parameter && Z.compress2 && Z.compress_bound &&
                   pthread_key_create(&cctx_key, free_cctx) == 0;
}

/* This thread's compression context with the planes' parameters (freed when the thread ends),
 * or NULL. */
static void *thread_cctx(void) {
    void *c = pthread_getspecific(cctx_key);
    if (c) return c;
    if ((c = Z.create_cctx()) == NULL) return NULL;
    for (int i = 0; i < 7; i++)
        if (Z.is_error(Z.cctx_set_parameter(c, plane_params[i][0], plane_params[i][1]))) {
            Z.free_cctx(c);
            return NULL;
        }
    if (pthread_setspecific(cctx_key, c) != 0) {
        Z.free_cctx(c);
        return NULL;
    }
    return c;
}

/* This thread's decompression context (freed when the thread ends), or NULL. */
static void *thread_dctx(void) {
    void *d = pthread_getspecific(dctx_key);
    if (!d && (d = Z.create_dctx()) != NULL && pthread_setspecific(dctx_key, d) != 0) {
        Z.free_dctx(d);
        d = NULL;
    }
    return d;
}
#else
static void zstd_load(void) { Z.tried = 1; }
static void *thread_dctx(void) { return NULL; }
static void *thread_cctx(void) { return NULL; }
#endif

PyDoc_STRVAR(zstd_version_doc,
"zstd_version() -> int | None\n\n"
"The version number of the libzstd zstd_decompress uses (e.g. 10504), or None when none was\n"
"loaded (no libzstd.so.1 on the library path, older than 1.4.0, or Windows).");

static PyObject *py_zstd_version(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    zstd_load();
    if (!Z.version) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(Z.version);
}

int ds_zstd_ready(void) {
    zstd_load();
    return Z.version != 0;
}

int ds_zstd_compresses(void) {
    zstd_load();
    return Z.version != 0 && Z.compresses;
}

size_t ds_zstd_bound(size_t n) { return Z.compress_bound(n); }

int ds_zstd_compress(const void *src, size_t n, void *dst, size_t cap, size_t *out) {
    void *c = thread_cctx();
    if (!c) return -1;
    size_t r = Z.compress2(c, dst, cap, src, n);
    if (Z.is_error(r)) return -1;
    *out = r;
    return 0;
}

PyDoc_STRVAR(zstd_plane_params_doc,
"zstd_plane_params() -> tuple | None\n\n"
"The compression parameters add_sparse_segment gives libzstd (window_log, hash_log, chain_log,\n"
"search_log, min_match, target_length, strategy), or None when it cannot compress (no libzstd,\n"
"or one without the compression API).");

static PyObject *py_zstd_plane_params(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!ds_zstd_compresses()) Py_RETURN_NONE;
    return Py_BuildValue("(iiiiiii)", plane_params[0][1], plane_params[1][1], plane_params[2][1], plane_params[3][1],
                         plane_params[4][1], plane_params[5][1], plane_params[6][1]);
}

/* A frame's checks before any byte is decoded, shared by the one-call and the streamed decoder:
 * a frame header whose content size, when declared, is `cap`, and exactly one frame in `len`. */
static int check_frame(const void *src, size_t len, size_t cap, unsigned long long *value, const char **message) {
    unsigned long long declared = Z.frame_content_size(src, len);
    size_t r;
    if (declared == DS_ZSTD_CONTENTSIZE_ERROR) return DS_ZE_NOT_FRAME;
    if (declared != DS_ZSTD_CONTENTSIZE_UNKNOWN && declared != cap) {
        *value = declared;
        return DS_ZE_CLAIMS;
    }
    if (Z.is_error(r = Z.find_frame_size(src, len))) {
        *message = Z.error_name(r);
        return DS_ZE_BAD_FRAME;
    }
    if (r != len) {
        *message = "bytes after the frame";
        return DS_ZE_BAD_FRAME;
    }
    return 0;
}

int ds_zstd_decode(const void *src, size_t len, void *dst, size_t cap, unsigned long long *value,
                   const char **message) {
    void *dctx = thread_dctx();
    *value = 0;
    *message = "";
    if (!dctx) {
        *message = "cannot allocate a zstd decompression context";
        return DS_ZE_BAD_FRAME;
    }
    int k = check_frame(src, len, cap, value, message);
    size_t r;
    if (k) return k;
    if (Z.is_error(r = Z.decompress_dctx(dctx, dst, cap, src, len))) {
        *message = Z.error_name(r);
        return DS_ZE_BAD_FRAME;
    }
    if (r != cap) {
        *value = r;
        return DS_ZE_SIZE;
    }
    return 0;
}

struct ds_zstream {
    void *dctx;
    ds_in_t in;
    size_t done;  /* bytes decoded so far */
    int finished; /* the frame ended (its checksum checked) */
};

int ds_zstream_open(ds_zstream **out, const void *src, size_t len, size_t cap, int window_log_max,
                    unsigned long long *value, const char **message) {
    *out = NULL;
    *value = 0;
    *message = "";
    int k = check_frame(src, len, cap, value, message);
    if (k) return k;
    ds_zstream *s = (ds_zstream *)calloc(1, sizeof *s);
    if (!s || !(s->dctx = Z.create_dctx())) {
        free(s);
        *message = "cannot allocate a zstd decompression context";
        return DS_ZE_BAD_FRAME;
    }
    size_t r = Z.set_parameter(s->dctx, DS_ZSTD_D_WINDOWLOGMAX, window_log_max);
    if (Z.is_error(r)) {
        Z.free_dctx(s->dctx);
        free(s);
        *message = Z.error_name(r);
        return DS_ZE_BAD_FRAME;
    }
    s->in.src = src;
    s->in.size = len;
    *out = s;
    return 0;
}

int ds_zstream_read(ds_zstream *s, void *dst, size_t n, unsigned long long *value, const char **message) {
    ds_out_t o = {dst, n, 0};
    *value = 0;
    *message = "";
    while (o.pos < o.size) {
        size_t in0 = s->in.pos, out0 = o.pos;
        size_t r = s->finished ? 0 : Z.decompress_stream(s->dctx, &o, &s->in);
        if (Z.is_error(r)) {
            *message = Z.error_name(r);
            return DS_ZE_BAD_FRAME;
        }
        s->finished = r == 0;
        /* the frame ended early, or its input did (no progress: a frame cut short) */
        if ((r == 0 && o.pos < o.size) || (s->in.pos == in0 && o.pos == out0)) {
            *value = s->done + o.pos;
            return DS_ZE_SIZE;
        }
    }
    s->done += n;
    return 0;
}

int ds_zstream_end(ds_zstream *s, unsigned long long *value, const char **message) {
    uint8_t extra;
    *value = 0;
    *message = "";
    while (!s->finished) { /* the frame's last block and checksum, and nothing more */
        ds_out_t o = {&extra, 1, 0};
        size_t in0 = s->in.pos;
        size_t r = Z.decompress_stream(s->dctx, &o, &s->in);
        if (Z.is_error(r)) {
            *message = Z.error_name(r);
            return DS_ZE_BAD_FRAME;
        }
        if (o.pos) {
            *message = "Destination buffer is too small";
            return DS_ZE_BAD_FRAME;
        }
        s->finished = r == 0;
        if (!s->finished && s->in.pos == in0) {
            *value = s->done;
            return DS_ZE_SIZE;
        }
    }
    return 0;
}

void ds_zstream_free(ds_zstream *s) {
    if (!s) return;
    Z.free_dctx(s->dctx);
    free(s);
}

PyDoc_STRVAR(zstd_decompress_doc,
"zstd_decompress(frames: list, sizes: list) -> list[bytes] | tuple[int, int, int, str]\n\n"
"Decode frames[i] (a bytes-like object holding exactly one zstd frame) into sizes[i] bytes,\n"
"all without the GIL. Returns the list of outputs, or at the first frame that fails\n"
"(i, kind, value, message): kind 1, not a zstd frame; 2, its header claims `value` bytes;\n"
"3, the frame is bad (zstd's message; also bytes after the frame); 4, it decoded to `value`\n"
"bytes. Nothing is written past an output's size. RuntimeError when no libzstd is loaded.");

static PyObject *py_zstd_decompress(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *frames, *sizes;
    if (!PyArg_ParseTuple(args, "O!O!:zstd_decompress", &PyList_Type, &frames, &PyList_Type, &sizes)) return NULL;
    if (!ds_zstd_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "no libzstd loaded (zstd_version() is None)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(frames);
    if (PyList_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "frames and sizes differ in length");
        return NULL;
    }
    Py_buffer *in = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    PyObject *out = PyList_New(n);
    PyObject *result = NULL;
    Py_ssize_t got = 0; /* buffers acquired */
    if (!in || !out) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyList_GET_ITEM(sizes, got));
        if (size < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sizes must be non-negative");
            goto done;
        }
        PyObject *b = PyBytes_FromStringAndSize(NULL, size);
        if (!b) goto done;
        PyList_SET_ITEM(out, got, b);
        if (PyObject_GetBuffer(PyList_GET_ITEM(frames, got), &in[got], PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_SetString(PyExc_ValueError, "frames must be C-contiguous buffers");
            goto done;
        }
    }
    Py_ssize_t bad = -1;
    int kind = 0;
    unsigned long long value = 0;
    const char *message = "";
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && bad < 0; i++) {
        PyObject *b = PyList_GET_ITEM(out, i);
        kind = ds_zstd_decode(in[i].buf, (size_t)in[i].len, PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b), &value,
                              &message);
        if (kind) bad = i;
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        result = Py_BuildValue("(niKs)", bad, kind, value, message);
    } else {
        result = out;
        out = NULL;
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&in[i]);
    PyMem_Free(in);
    Py_XDECREF(out);
    return result;
}

PyMethodDef ds_zstd_methods[] = {
    {"zstd_version", py_zstd_version, METH_NOARGS, zstd_version_doc},
    {"zstd_plane_params", py_zstd_plane_params, METH_NOARGS, zstd_plane_params_doc},
    {"zstd_decompress", py_zstd_decompress, METH_VARARGS, zstd_decompress_doc},
    {NULL, NULL, 0, NULL},
};
