/* Decode of full segments (full/1, full/2) straight into the caller's array, a piece at a time.
 *
 * The numpy decoder builds the chunk from whole planes: every section decoded to a chunk-sized
 * plane, the planes joined into a new array, the rotation undone through two more chunk-sized
 * temporaries, and the result copied into the tensor: ~3.4x the chunk at its peak, whatever the
 * chunk's size (a hostile store declares one 2 GiB chunk in a few KB of packs). This kernel
 * writes the chunk where it belongs, `piece` elements at a time: each plane's next piece
 * (a RAW plane is read in place, a CONST one is a byte, a small zstd section is decoded in one
 * call, a large one is streamed in a context whose window is capped), the exponent codes of
 * transform 2 turned into the top plane's piece, the planes interleaved and rotated into `out`,
 * and the piece hashed (XXH3-128) while it is in cache. Memory: the small sections, one piece
 * per plane and the streams' windows, not the chunk.
 *
 * Contract (table ds_full_methods, merged into deltastore._native by module.c):
 *
 *   decode_full(out, width, transform, exp_low, n_escaped, sections, digest, stream_min, piece,
 *               window_log_max) -> (err, a, b, c, d)
 *
 *   out        writable C-contiguous buffer of count * width bytes (little-endian elements)
 *   transform  0 none (full/1, full/2), 1 rotated left by one bit, 2 rotated with paired
 *              exponent codes (full/2)
 *   sections   tuple, in segment order, of bytes-like planes, ints 0..255 (CONST sections) or
 *              (frame,) for a zstd section: width planes of count bytes; with transform 2, width
 *              - 1 planes, the (count + 1) // 2 bytes of codes and, when n_escaped, the escapes
 *   digest     whether to hash the result
 *   stream_min zstd sections of more bytes than this are streamed, the others decoded in one call
 *   piece      elements per step (even, >= 2)
 *   err        0: c is the XXH3-128 hex of out (or None); 1: the padding code is not 0; 2: a
 *              escapes declared, b codes 15 found; 3: an escaped exponent lies inside the window;
 *              9: zstd section a failed (b its value, c the failure kind, d zstd's message).
 *              On an error out holds unspecified bits.
 *
 * Checks are reported in the numpy decoder's order: zstd failures first (they stop the decode),
 * then the padding, the escape count and escapes inside the window (found on the way, reported
 * at the end). Sizes that disagree with the header fields (a caller bug: read_header checked
 * them) raise ValueError. The GIL is released around the whole decode.
 */
#include "ds_native.h"

#include <string.h>

#include "ds_xxh.h"

/* At most width planes, or width - 1 planes + codes + escapes (width 8, transform 2: 9). */
#define MAX_SECTIONS 9

enum { T_NONE = 0, T_ROTL1 = 1, T_PAIRS = 2 };
enum { F_PADDING = 1, F_ESC_COUNT = 2, F_ESC_WINDOW = 3, F_ZSTD = 9 };
enum { S_CONST, S_MEM, S_STREAM };

/* One section as a source of consecutive bytes. */
typedef struct {
    int kind;
    const uint8_t *p;   /* S_MEM: the plane (RAW in place, or a small zstd section decoded whole) */
    size_t pos;         /* S_MEM: next byte */
    uint8_t *buf;       /* S_CONST: `piece + 1` copies of the byte; S_STREAM: the next piece */
    uint8_t *whole;     /* a small zstd section, decoded here (freed at the end) */
    ds_zstream *z;      /* S_STREAM */
    Py_buffer view;     /* RAW bytes or the zstd frame */
    int has_view;
    size_t len;         /* the section's decoded size */
} src_t;

/* The next n bytes of s (n <= the buffers' size), or NULL with the zstd failure in *kind. */
static const uint8_t *take(src_t *s, size_t n, int *kind, unsigned long long *value, const char **message) {
    if (s->kind == S_CONST) return s->buf;
    if (s->kind == S_MEM) {
        const uint8_t *p = s->p + s->pos;
        s->pos += n;
        return p;
    }
    if (n && (*kind = ds_zstream_read(s->z, s->buf, n, value, message)) != 0) return NULL;
    return s->buf;
}

/* Interleave `width` planes of m bytes into m little-endian elements at o, undoing the rotation
 * (right by one bit) when asked. One loop per width and rotation, so that each vectorizes. */
#define DS_JOIN(T, W)                                                                                 \
    static void join_##W(const uint8_t *const *pl, uint8_t *o, size_t m, int rot) {                  \
        if (rot) {                                                                                   \
            for (size_t i = 0; i < m; i++) {                                                         \
                T v = 0;                                                                             \
                for (int k = 0; k < W; k++) v |= (T)((T)pl[k][i] << (8 * k));                        \
                v = (T)((T)(v >> 1) | (T)(v << (8 * W - 1)));                                        \
                memcpy(o + i * W, &v, W);                                                            \
            }                                                                                        \
        } else {                                                                                     \
            for (size_t i = 0; i < m; i++) {                                                         \
                T v = 0;                                                                             \
                for (int k = 0; k < W; k++) v |= (T)((T)pl[k][i] << (8 * k));                        \
                memcpy(o + i * W, &v, W);                                                            \
            }                                                                                        \
        }                                                                                            \
    }

/* Width 2 and 4 spelled out: the planes' pointers in locals, which gcc keeps in registers. */
static void join_2(const uint8_t *const *pl, uint8_t *o, size_t m, int rot) {
    const uint8_t *a = pl[0], *b = pl[1];
    if (rot) {
        for (size_t i = 0; i < m; i++) {
            uint16_t v = (uint16_t)(a[i] | (uint16_t)b[i] << 8);
            v = (uint16_t)((v >> 1) | (uint16_t)(v << 15));
            memcpy(o + 2 * i, &v, 2);
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint16_t v = (uint16_t)(a[i] | (uint16_t)b[i] << 8);
            memcpy(o + 2 * i, &v, 2);
        }
    }
}

static void join_4(const uint8_t *const *pl, uint8_t *o, size_t m, int rot) {
    const uint8_t *a = pl[0], *b = pl[1], *c = pl[2], *d = pl[3];
    if (rot) {
        for (size_t i = 0; i < m; i++) {
            uint32_t v = (uint32_t)a[i] | (uint32_t)b[i] << 8 | (uint32_t)c[i] << 16 | (uint32_t)d[i] << 24;
            v = (v >> 1) | (v << 31);
            memcpy(o + 4 * i, &v, 4);
        }
    } else {
        for (size_t i = 0; i < m; i++) {
            uint32_t v = (uint32_t)a[i] | (uint32_t)b[i] << 8 | (uint32_t)c[i] << 16 | (uint32_t)d[i] << 24;
            memcpy(o + 4 * i, &v, 4);
        }
    }
}

DS_JOIN(uint64_t, 8)

static void join_1(const uint8_t *const *pl, uint8_t *o, size_t m, int rot) {
    const uint8_t *a = pl[0];
    if (rot)
        for (size_t i = 0; i < m; i++) o[i] = (uint8_t)((a[i] >> 1) | (a[i] << 7));
    else
        memcpy(o, a, m);
}

/* The top plane of elements [0, m) of a step from its exponent codes (two per byte, low nibble
 * first): low + code, code 15 standing for the next escaped byte. Returns the codes 15 seen. */
static uint64_t unpair(const uint8_t *codes, size_t m, uint8_t lo, uint8_t *top, int *padding) {
    uint64_t esc = 0;
    size_t half = m / 2;
    for (size_t j = 0; j < half; j++) {
        uint8_t c = codes[j], c0 = c & 15u, c1 = c >> 4;
        top[2 * j] = (uint8_t)(lo + c0);
        top[2 * j + 1] = (uint8_t)(lo + c1);
        esc += (uint64_t)(c0 == DS_NIBBLE_ESCAPE) + (uint64_t)(c1 == DS_NIBBLE_ESCAPE);
    }
    if (m & 1) { /* the last element of an odd count: its byte's high nibble pads */
        uint8_t c = codes[half], c0 = c & 15u;
        top[m - 1] = (uint8_t)(lo + c0);
        esc += c0 == DS_NIBBLE_ESCAPE;
        if (c >> 4) *padding = 1;
    }
    return esc;
}

/* Put the k escaped bytes at ep in place of the codes 15 of the step (in order); returns
 * whether one of them lies inside the window (it would have been coded). */
static int place_escapes(const uint8_t *codes, size_t m, uint8_t lo, const uint8_t *ep, uint64_t k, uint8_t *top) {
    int inside = 0;
    uint64_t e = 0;
    for (size_t j = 0; j < m && e < k; j++) {
        unsigned c = (codes[j >> 1] >> ((j & 1) * 4)) & 15u;
        if (c != DS_NIBBLE_ESCAPE) continue;
        uint8_t v = ep[e++];
        inside |= (uint8_t)(v - lo) < DS_NIBBLE_ESCAPE;
        top[j] = v;
    }
    return inside;
}

PyDoc_STRVAR(decode_full_doc,
"decode_full(out, width, transform, exp_low, n_escaped, sections, digest, stream_min, piece,\n"
"            window_log_max) -> (err, a, b, c, d)\n\n"
"Decode a full/1 or full/2 segment's sections into out, piece elements at a time, hashing\n"
"the result (XXH3-128) as it is written when digest is true. Sections: a CONST section's byte,\n"
"a RAW section's bytes, a zstd section as (frame,) (decoded here: in one call up to\n"
"stream_min bytes, else streamed in a context whose window is at most 2**window_log_max\n"
"bytes). err 0: c the hex digest or None; 1: padding code not 0; 2: a escapes declared, b\n"
"codes 15 found; 3: an escape inside the exponent window; 9: zstd section a failed (b the\n"
"value, c the kind, d zstd's message, as zstd_decompress reports them). On an error out\n"
"holds unspecified bits. Needs a loaded libzstd for zstd sections. Releases the GIL.");

static PyObject *decode_full(PyObject *self, PyObject *args) {
    PyObject *out, *sections;
    int width, transform, exp_low, digest, window_log_max;
    unsigned long long n_escaped;
    Py_ssize_t stream_min, piece;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiiiKO!pnni:decode_full", &out, &width, &transform, &exp_low, &n_escaped,
                          &PyTuple_Type, &sections, &digest, &stream_min, &piece, &window_log_max))
        return NULL;
    if (ds_check_width(width) < 0) return NULL;
    if (transform < T_NONE || transform > T_PAIRS || (transform == T_PAIRS && width < 2))
        return PyErr_Format(PyExc_ValueError, "transform %d with width %d", transform, width);
    if (exp_low < 0 || exp_low > 255) return PyErr_Format(PyExc_ValueError, "exp_low %d is not a byte", exp_low);
    if (piece < 2 || piece % 2 || stream_min < 0)
        return PyErr_Format(PyExc_ValueError, "piece must be even and >= 2, stream_min >= 0");
    Py_buffer ov;
    if (ds_get_buffer(out, &ov, 1, "out") < 0) return NULL;

    src_t src[MAX_SECTIONS];
    memset(src, 0, sizeof src);
    int n = 0;
    uint8_t *top = NULL;
    XXH3_state_t *st = NULL;
    PyObject *result = NULL;
    uint64_t count = (uint64_t)ov.len / (uint64_t)width;
    int nplanes = transform == T_PAIRS ? width - 1 : width;
    int want = nplanes + (transform == T_PAIRS ? 1 + (n_escaped ? 1 : 0) : 0);
    if ((uint64_t)ov.len % (uint64_t)width) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, not a multiple of width %d", ov.len, width);
        goto done;
    }
    if (transform == T_PAIRS ? n_escaped > count : n_escaped != 0) {
        PyErr_SetString(PyExc_ValueError, "n_escaped exceeds the element count or does not apply");
        goto done;
    }
    if (PyTuple_GET_SIZE(sections) != want) {
        PyErr_Format(PyExc_ValueError, "segment has %zd sections, its header implies %d", PyTuple_GET_SIZE(sections), want);
        goto done;
    }
    size_t cap = (size_t)piece + 1; /* a step's bytes of any section, the odd code byte included */
    for (int i = 0; i < want; i++) {
        src_t *s = &src[i];
        PyObject *o = PyTuple_GET_ITEM(sections, i);
        n = i + 1;
        s->len = i < nplanes ? count : i == nplanes ? (count + 1) / 2 : n_escaped;
        if (PyLong_Check(o)) {
            long v = PyLong_AsLong(o);
            if (v < 0 || v > 255 || s->len == 0) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "const section %d is not a byte or stands for 0 bytes", i);
                goto done;
            }
            s->kind = S_CONST;
            if (!(s->buf = PyMem_RawMalloc(cap))) {
                PyErr_NoMemory();
                goto done;
            }
            memset(s->buf, (int)v, cap);
            continue;
        }
        int zstd = PyTuple_Check(o);
        if (zstd && (PyTuple_GET_SIZE(o) != 1 || !ds_zstd_ready())) {
            PyErr_Format(PyExc_ValueError, "section %d: a zstd frame is passed as (frame,), with a libzstd loaded", i);
            goto done;
        }
        if (PyObject_GetBuffer(zstd ? PyTuple_GET_ITEM(o, 0) : o, &s->view, PyBUF_C_CONTIGUOUS) < 0) goto done;
        s->has_view = 1;
        if (!zstd) {
            if ((uint64_t)s->view.len != s->len) {
                PyErr_Format(PyExc_ValueError, "section %d has %zd bytes, its header implies %llu", i, s->view.len,
                             (unsigned long long)s->len);
                goto done;
            }
            s->kind = S_MEM;
            s->p = (const uint8_t *)s->view.buf;
            continue;
        }
        if (s->len == 0) {
            PyErr_Format(PyExc_ValueError, "zstd section %d stands for 0 bytes", i);
            goto done;
        }
        if (s->len <= (uint64_t)stream_min) {
            s->kind = S_MEM;
            if (!(s->whole = PyMem_RawMalloc(s->len))) {
                PyErr_NoMemory();
                goto done;
            }
            s->p = s->whole;
        } else {
            s->kind = S_STREAM;
            if (!(s->buf = PyMem_RawMalloc(cap))) {
                PyErr_NoMemory();
                goto done;
            }
        }
    }
    if (transform == T_PAIRS && !(top = PyMem_RawMalloc((size_t)piece))) {
        PyErr_NoMemory();
        goto done;
    }
    if (digest) {
        if (!(st = XXH3_createState())) {
            PyErr_NoMemory();
            goto done;
        }
        XXH3_128bits_reset(st);
    }

    int err = 0, padding = 0, inside = 0, zkind = 0;
    uint64_t ea = 0, eb = 0, used = 0, held = 0;
    unsigned long long zvalue = 0;
    const char *zmsg = "";
    uint8_t *dst = (uint8_t *)ov.buf;
    const uint8_t lo = (uint8_t)exp_low;
    Py_BEGIN_ALLOW_THREADS
    /* sections in order: a small zstd one decoded whole, a large one's frame checked and opened */
    for (int i = 0; i < n && !err; i++) {
        src_t *s = &src[i];
        int k = 0;
        if (s->whole)
            k = ds_zstd_decode(s->view.buf, (size_t)s->view.len, s->whole, s->len, &zvalue, &zmsg);
        else if (s->kind == S_STREAM)
            k = ds_zstream_open(&s->z, s->view.buf, (size_t)s->view.len, s->len, window_log_max, &zvalue, &zmsg);
        if (k) {
            err = F_ZSTD;
            ea = (uint64_t)i;
            zkind = k;
        }
    }
    for (uint64_t i = 0; i < count && !err;) {
        size_t m = count - i > (uint64_t)piece ? (size_t)piece : (size_t)(count - i);
        const uint8_t *pl[8];
        int k = 0;
        for (int j = 0; j < nplanes && !err; j++)
            if (!(pl[j] = take(&src[j], m, &k, &zvalue, &zmsg))) err = F_ZSTD, ea = (uint64_t)j, zkind = k;
        if (!err && transform == T_PAIRS) {
            const uint8_t *codes = take(&src[nplanes], (m + 1) / 2, &k, &zvalue, &zmsg);
            if (!codes) {
                err = F_ZSTD, ea = (uint64_t)nplanes, zkind = k;
                break;
            }
            uint64_t e = unpair(codes, m, lo, top, &padding);
            uint64_t t = e < n_escaped - used ? e : n_escaped - used; /* more than declared: counted only */
            if (t) {
                const uint8_t *ep = take(&src[nplanes + 1], (size_t)t, &k, &zvalue, &zmsg);
                if (!ep) {
                    err = F_ZSTD, ea = (uint64_t)nplanes + 1, zkind = k;
                    break;
                }
                inside |= place_escapes(codes, m, lo, ep, t, top);
            }
            used += t;
            held += e;
            pl[nplanes] = top;
        }
        if (err) break;
        uint8_t *o = dst + i * (uint64_t)width;
        int rot = transform != T_NONE;
        switch (width) {
        case 1: join_1(pl, o, m, rot); break;
        case 2: join_2(pl, o, m, rot); break;
        case 4: join_4(pl, o, m, rot); break;
        default: join_8(pl, o, m, rot); break;
        }
        if (st) XXH3_128bits_update(st, o, m * (size_t)width);
        i += m;
    }
    /* every stream read to its end must end there; escapes left unread are the count's error */
    for (int i = 0; i < n && !err; i++) {
        if (src[i].kind != S_STREAM || (transform == T_PAIRS && i == nplanes + 1 && used != n_escaped)) continue;
        int k = ds_zstream_end(src[i].z, &zvalue, &zmsg);
        if (k) err = F_ZSTD, ea = (uint64_t)i, zkind = k;
    }
    if (!err && padding) err = F_PADDING;
    if (!err && transform == T_PAIRS && held != n_escaped) err = F_ESC_COUNT, ea = n_escaped, eb = held;
    if (!err && inside) err = F_ESC_WINDOW;
    if (err == F_ZSTD) eb = zvalue;
    Py_END_ALLOW_THREADS

    PyObject *c = NULL, *d = NULL;
    if (err == F_ZSTD) {
        c = PyLong_FromLong(zkind);
        d = PyUnicode_FromString(zmsg);
    } else {
        if (!err && st) {
            XXH128_hash_t h = XXH3_128bits_digest(st);
            c = ds_hex128(h.high64, h.low64);
        } else {
            c = Py_NewRef(Py_None);
        }
        d = Py_NewRef(Py_None);
    }
    if (c && d) result = Py_BuildValue("(iKKNN)", err, (unsigned long long)ea, (unsigned long long)eb, c, d);
    else {
        Py_XDECREF(c);
        Py_XDECREF(d);
    }
done:
    for (int i = 0; i < n; i++) {
        ds_zstream_free(src[i].z);
        PyMem_RawFree(src[i].buf);
        PyMem_RawFree(src[i].whole);
        if (src[i].has_view) PyBuffer_Release(&src[i].view);
    }
    PyMem_RawFree(top);
    XXH3_freeState(st);
    PyBuffer_Release(&ov);
    return result;
}

PyMethodDef ds_full_methods[] = {
    {"decode_full", decode_full, METH_VARARGS, decode_full_doc},
    {NULL, NULL, 0, NULL},
};
