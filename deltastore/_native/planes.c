/* deltastore._native: the anchor (full/2) encoder's byte planes (deltastore/codec/full.py), and
 * the helper that judges a plane from a sample before it is entropy coded
 * (deltastore/codec/planes.py, byte_counts). */
#include "ds_buf.h"

#include <string.h>

/* --- the full codec's byte planes ------------------------------------------------------ */

#define DEFINE_SPLIT(T, W)                                                                   \
    static void split_##W(const uint8_t *src, uint8_t *dst, size_t n, int rot) {            \
        for (size_t i = 0; i < n; i++) {                                                     \
            T v;                                                                             \
            memcpy(&v, src + i * W, W);                                                      \
            if (rot) v = (T)((T)(v << 1) | (T)(v >> (8 * W - 1)));                           \
            for (int k = 0; k < W; k++) dst[(size_t)k * n + i] = (uint8_t)(v >> (8 * k));    \
        }                                                                                    \
    }

DEFINE_SPLIT(uint16_t, 2)
DEFINE_SPLIT(uint32_t, 4)
DEFINE_SPLIT(uint64_t, 8)

PyDoc_STRVAR(split_planes_doc,
"split_planes(values, out, width, rotate)\n\n"
"Byte planes of `width`-byte little-endian elements in one pass: plane k (byte k of every\n"
"element, after rotating each element left by one bit when `rotate`) goes to\n"
"out[k*n:(k+1)*n]. `out` is writable and as long as `values`. Releases the GIL.");

static PyObject *py_split_planes(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    long width;
    int rot;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOlp:split_planes", &src_obj, &dst_obj, &width, &rot)) return NULL;
    int w = ds_check_width(width);
    if (w < 0) return NULL;
    Py_buffer sb, db;
    if (ds_get_buffer(src_obj, &sb, 0, "values") < 0) return NULL;
    if (ds_get_buffer(dst_obj, &db, 1, "out") < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    const char *err = NULL;
    if (sb.len != db.len)
        err = "values and out differ in length";
    else if (sb.len % w)
        err = "buffer length is not a multiple of the element width";
    else if ((const char *)sb.buf < (const char *)db.buf + db.len && (const char *)db.buf < (const char *)sb.buf + sb.len)
        err = "values and out overlap";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
    } else {
        size_t n = (size_t)(sb.len / w);
        const uint8_t *src = (const uint8_t *)sb.buf;
        uint8_t *dst = (uint8_t *)db.buf;
        Py_BEGIN_ALLOW_THREADS
        switch (w) {
        case 1:
            for (size_t i = 0; i < n; i++) dst[i] = rot ? (uint8_t)((src[i] << 1) | (src[i] >> 7)) : src[i];
            break;
        case 2: split_2(src, dst, n, rot); break;
        case 4: split_4(src, dst, n, rot); break;
        default: split_8(src, dst, n, rot); break;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&sb);
    PyBuffer_Release(&db);
    if (err) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pair_codes_doc,
"pair_codes(top, low, escape, out) -> bytes\n\n"
"full/2's paired exponent form in one pass: code = (top[i] - low) mod 256 when below `escape`,\n"
"else `escape` (and top[i] appended to the returned escapes); two codes per byte of `out`\n"
"(low nibble first, a 0 code pads an odd count). `out` holds (len(top) + 1) // 2 bytes.\n"
"Releases the GIL.");

/* Pairs of exponent codes per block: 128 bytes of `top`, a few vector iterations. */
#define PAIR_BLOCK 64

static int collect_escapes(const uint8_t *top, size_t m, uint8_t lo, uint8_t es, dsbuf *esc) {
    for (size_t i = 0; i < m; i++) {
        if ((uint8_t)(top[i] - lo) < es) continue;
        if (reserve(esc, 1)) return -1;
        esc->p[esc->len++] = top[i];
    }
    return 0;
}

static PyObject *py_pair_codes(PyObject *self, PyObject *args) {
    PyObject *top_obj, *out_obj;
    int low, escape;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiiO:pair_codes", &top_obj, &low, &escape, &out_obj)) return NULL;
    if (low < 0 || low > 255 || escape < 1 || escape > 15) {
        PyErr_SetString(PyExc_ValueError, "low must be 0..255 and escape 1..15");
        return NULL;
    }
    Py_buffer tb, ob;
    if (ds_get_buffer(top_obj, &tb, 0, "top") < 0) return NULL;
    if (ds_get_buffer(out_obj, &ob, 1, "out") < 0) {
        PyBuffer_Release(&tb);
        return NULL;
    }
    size_t n = (size_t)tb.len;
    if ((size_t)ob.len != (n + 1) / 2) {
        PyErr_SetString(PyExc_ValueError, "out must hold (len(top) + 1) // 2 bytes");
        PyBuffer_Release(&tb);
        PyBuffer_Release(&ob);
        return NULL;
    }
    dsbuf esc = {NULL, 0, 0};
    int oom = 0;
    const uint8_t *top = (const uint8_t *)tb.buf;
    uint8_t *out = (uint8_t *)ob.buf;
    Py_BEGIN_ALLOW_THREADS
    const uint8_t lo = (uint8_t)low, es = (uint8_t)escape;
    /* per block of PAIR_BLOCK pairs: the codes branch-free (vectorized) with a byte flag for
     * escapes, then, only in a block that has one (rare: ~0.03 % of bf16 exponents escape),
     * a scalar pass collecting them while the block is in cache */
    size_t half = n / 2;
    for (size_t b = 0; b < half && !oom; b += PAIR_BLOCK) {
        size_t e = half - b > PAIR_BLOCK ? b + PAIR_BLOCK : half;
        uint8_t any = 0;
        for (size_t i = b; i < e; i++) {
            uint8_t c0 = (uint8_t)(top[2 * i] - lo), c1 = (uint8_t)(top[2 * i + 1] - lo);
            any |= (uint8_t)((c0 >= es) | (c1 >= es));
            c0 = c0 < es ? c0 : es;
            c1 = c1 < es ? c1 : es;
            out[i] = (uint8_t)(c0 | (c1 << 4));
        }
        if (any && collect_escapes(top + 2 * b, 2 * (e - b), lo, es, &esc) < 0) oom = 1;
    }
    if ((n & 1) && !oom) {
        uint8_t c0 = (uint8_t)(top[n - 1] - lo);
        out[half] = c0 < es ? c0 : es;
        if (c0 >= es && collect_escapes(top + n - 1, 1, lo, es, &esc) < 0) oom = 1;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ob);
    PyObject *r = oom ? PyErr_NoMemory() : buf_bytes(&esc);
    free(esc.p);
    return r;
}


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
    {"split_planes", py_split_planes, METH_VARARGS, split_planes_doc},
    {"pair_codes", py_pair_codes, METH_VARARGS, pair_codes_doc},
    {NULL, NULL, 0, NULL},
};
