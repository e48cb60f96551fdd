/* deltastore._native: the anchor (full/2) encoder's byte planes (deltastore/codec/full.py), the
 * helper that judges a plane from a sample before it is entropy coded
 * (deltastore/codec/planes.py, byte_counts), and a delta's add-sparse/1 segment built from the
 * encoder's raw planes through the system's libzstd (deltastore/codec/delta.py,
 * add_segments_from_planes). */
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

/* The byte planes of n `w`-byte elements (w 1, 2, 4 or 8) into dst: plane k at dst + k * n. */
static void split_any(const uint8_t *src, uint8_t *dst, size_t n, int w, int rot) {
    switch (w) {
    case 1:
        for (size_t i = 0; i < n; i++) dst[i] = rot ? (uint8_t)((src[i] << 1) | (src[i] >> 7)) : src[i];
        break;
    case 2: split_2(src, dst, n, rot); break;
    case 4: split_4(src, dst, n, rot); break;
    default: split_8(src, dst, n, rot); break;
    }
}

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
        split_any(src, dst, n, w, rot);
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

/* --- an add-sparse/1 segment from the encoder's raw planes ------------------------------- */

/* deltastore/codec/container.py: section kinds, the header ("<4sBBBBIIIIB") and a section's
 * table entry ("<BI"); planes.MIN_ZSTD_INPUT. */
enum { KIND_RAW = 0, KIND_ZSTD = 1, KIND_CONST = 2 };
#define SEG_HEADER 25
#define SEG_ENTRY 5
#define MIN_ZSTD_INPUT 32

typedef struct {
    const uint8_t *p; /* the plane */
    size_t n;
    int kind;
    const uint8_t *stored;
    size_t stored_n;
} section;

/* planes.encode_byte_sections' choice for one plane: CONST when every byte is equal, RAW when
 * shorter than MIN_ZSTD_INPUT, else ZSTD when the frame is smaller, else RAW. The frame is
 * written at *out (advanced past it when used). -1: compression failed. */
static int choose_section(section *s, uint8_t **out, uint8_t *end) {
    size_t n = s->n;
    const uint8_t *p = s->p;
    if (n && p[0] == p[n - 1]) { /* differing ends: not CONST at once */
        size_t i = 1;
        while (i < n && p[i] == p[0]) i++;
        if (i == n) {
            s->kind = KIND_CONST;
            s->stored = p;
            s->stored_n = 1;
            return 0;
        }
    }
    s->kind = KIND_RAW;
    s->stored = p;
    s->stored_n = n;
    if (n < MIN_ZSTD_INPUT) return 0;
    size_t z;
    if (ds_zstd_compress(p, n, *out, (size_t)(end - *out), &z) < 0) return -1;
    if (z < n) {
        s->kind = KIND_ZSTD;
        s->stored = *out;
        s->stored_n = z;
        *out += z;
    }
    return 0;
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

PyDoc_STRVAR(add_sparse_segment_doc,
"add_sparse_segment(count, width, k, syms, rest, max_rest, codes, esc) -> bytes | None\n\n"
"The bytes of deltastore.codec.delta.add_segment_from_planes(count, width, k, syms, rest,\n"
"max_rest, codes, esc) for a sparse segment (the caller keeps the dense case), its planes\n"
"compressed by the system's libzstd with the byte planes' parameters (zstd_plane_params), without\n"
"the GIL. None when libzstd cannot compress. The same bytes only where libzstd writes the frames\n"
"python-zstandard writes: deltastore.codec.delta checks that before it calls this.");

static PyObject *py_add_sparse_segment(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t count, width, k;
    unsigned long max_rest;
    Py_buffer syms, rest, codes, esc;
    if (!PyArg_ParseTuple(args, "nnny*y*ky*y*:add_sparse_segment", &count, &width, &k, &syms, &rest, &max_rest, &codes,
                          &esc))
        return NULL;
    PyObject *result = NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "add_sparse_segment: width must be 1, 2, 4 or 8");
        goto out;
    }
    if (count < 0 || count > 0xFFFFFFFFLL || k < 0 || k > count || rest.len % 4 || esc.len % width ||
        syms.len != k || codes.len != (k + 1) / 2) {
        PyErr_SetString(PyExc_ValueError, "add_sparse_segment: planes that do not fit the counts");
        goto out;
    }
    if (!ds_zstd_compresses()) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    {
        size_t n_rest = (size_t)rest.len / 4, n_esc = (size_t)esc.len / (size_t)width;
        int gw = !n_rest ? 1 : max_rest < 0x100ul ? 1 : max_rest < 0x10000ul ? 2 : 4; /* container.GAP_WIDTHS */
        section sec[1 + 4 + 1 + 8]; /* symbols, gap rests (gw <= 4), codes, escapes (width <= 8) */
        int ns = 0;
        /* the byte planes of the rests and escapes (split_any), and room for every frame (a bound
         * per plane) */
        uint8_t *split = (uint8_t *)malloc(4 * n_rest + (size_t)esc.len + 1);
        size_t cap = ds_zstd_bound((size_t)syms.len) + ds_zstd_bound((size_t)codes.len), seg_n = 0;
        if (n_rest) cap += (size_t)gw * ds_zstd_bound(n_rest);
        if (n_esc) cap += (size_t)width * ds_zstd_bound(n_esc);
        uint8_t *frames = (uint8_t *)malloc(cap);
        if (split == NULL || frames == NULL) {
            free(split);
            free(frames);
            PyErr_NoMemory();
            goto out;
        }
        int rc = 0;
        Py_BEGIN_ALLOW_THREADS
        uint8_t *f = frames;
        sec[ns++] = (section){(const uint8_t *)syms.buf, (size_t)syms.len, 0, NULL, 0};
        if (n_rest) { /* each rest < 2**(8 gw): its low gw bytes */
            split_any((const uint8_t *)rest.buf, split, n_rest, 4, 0);
            for (int b = 0; b < gw; b++) sec[ns++] = (section){split + (size_t)b * n_rest, n_rest, 0, NULL, 0};
        }
        sec[ns++] = (section){(const uint8_t *)codes.buf, (size_t)codes.len, 0, NULL, 0};
        if (n_esc) {
            const uint8_t *planes = (const uint8_t *)esc.buf;
            if (width > 1) {
                split_any(planes, split + 4 * n_rest, n_esc, (int)width, 0);
                planes = split + 4 * n_rest;
            }
            for (Py_ssize_t b = 0; b < width; b++) sec[ns++] = (section){planes + (size_t)b * n_esc, n_esc, 0, NULL, 0};
        }
        for (int i = 0; i < ns && rc == 0; i++) {
            rc = choose_section(&sec[i], &f, frames + cap);
            seg_n += sec[i].stored_n;
        }
        Py_END_ALLOW_THREADS
        seg_n += SEG_HEADER + (size_t)ns * SEG_ENTRY;
        /* packed straight into the result (the frames are its only copy besides) */
        if (rc < 0)
            PyErr_SetString(PyExc_RuntimeError, "add_sparse_segment: libzstd failed to compress a plane");
        else if ((result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)seg_n)) != NULL) {
            uint8_t *o = (uint8_t *)PyBytes_AS_STRING(result);
            memcpy(o, "DSG2", 4);
            o[4] = 4; /* container.CODEC_IDS[add-sparse/1] */
            o[5] = 1;
            o[6] = (uint8_t)width;
            o[7] = (uint8_t)gw;
            put_u32(o + 8, (uint32_t)count);
            put_u32(o + 12, (uint32_t)k);
            put_u32(o + 16, (uint32_t)n_rest);
            put_u32(o + 20, (uint32_t)n_esc);
            o[24] = (uint8_t)ns;
            o += SEG_HEADER;
            for (int i = 0; i < ns; i++, o += SEG_ENTRY) {
                o[0] = (uint8_t)sec[i].kind;
                put_u32(o + 1, (uint32_t)sec[i].stored_n);
            }
            for (int i = 0; i < ns; i++) {
                memcpy(o, sec[i].stored, sec[i].stored_n);
                o += sec[i].stored_n;
            }
        }
        free(split);
        free(frames);
    }
out:
    PyBuffer_Release(&syms);
    PyBuffer_Release(&rest);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&esc);
    return result;
}

PyMethodDef ds_planes_methods[] = {
    {"add_sparse_segment", py_add_sparse_segment, METH_VARARGS, add_sparse_segment_doc},
    {"byte_histogram", py_byte_histogram, METH_VARARGS, byte_histogram_doc},
    {"split_planes", py_split_planes, METH_VARARGS, split_planes_doc},
    {"pair_codes", py_pair_codes, METH_VARARGS, pair_codes_doc},
    {NULL, NULL, 0, NULL},
};
