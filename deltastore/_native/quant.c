/* The quantizers of the serving formats (deltastore/serving/quantize.py; docs/SPEC.md "Serving
 * formats: quantizers"): fp8-block128 and mxfp8 in one pass per block, without float32 copies of
 * the tensor, over a range of block rows (rows) so that the caller splits a tensor between
 * threads. They write the bits of the PyTorch path and of the numpy reference
 * (tests/serving/test_quantize.py compares them).
 *
 * Bit-exactness rests on every float operation being one IEEE-754 binary32 operation rounded to
 * nearest-even: no -ffast-math, and no excess precision (FLT_EVAL_METHOD 0; elsewhere, e.g. x87,
 * the table below is empty and the PyTorch path runs). No expression here is a multiply feeding
 * an add, so contraction to FMA cannot change a result. */
#include "ds_quant.h"

/* Element i of the tensor as float32, exactly. */
#define LOAD(src, kind, i)                                                                      \
    ((kind) == K_BF16  ? f32((uint32_t)((const uint16_t *)(src))[i] << 16)                      \
     : (kind) == K_F16 ? half_to_f32(((const uint16_t *)(src))[i])                             \
                       : ((const float *)(src))[i])

/* Elements [i0, i1) of the tensor times `mult`, encoded into q; `finite`: the block holds no
 * NaN or infinity (the fast encoder). Specialized per kind so that the bfloat16 and float32
 * loops vectorize. */
#define SCALE_LOOP(KIND, ENC) \
    for (size_t i = i0; i < i1; i++) q[i] = ENC(u32(LOAD(src, KIND, i) * mult))

static inline void scale_span(const void *src, int kind, size_t i0, size_t i1, float mult, uint8_t *q, int finite) {
    if (kind == K_BF16) {
        if (finite) SCALE_LOOP(K_BF16, e4m3_finite); else SCALE_LOOP(K_BF16, e4m3);
    } else if (kind == K_F16) {
        if (finite) SCALE_LOOP(K_F16, e4m3_finite); else SCALE_LOOP(K_F16, e4m3);
    } else {
        if (finite) SCALE_LOOP(K_F32, e4m3_finite); else SCALE_LOOP(K_F32, e4m3);
    }
}

/* max |x| bits over elements [i0, i1), starting from m. */
static inline uint32_t amax_span(const void *src, int kind, size_t i0, size_t i1, uint32_t m) {
    if (kind == K_F32) {
        for (size_t i = i0; i < i1; i++) m = ABS32(src, i) > m ? ABS32(src, i) : m;
    } else {
        for (size_t i = i0; i < i1; i++) m = ABS16(src, i) > m ? ABS16(src, i) : m;
    }
    return m;
}

/* fp8-block128 of block row bi, one 128×128 block at a time: its second pass reads it from L1. */
DS_CLONES static void fp8_block_row(const void *src, int kind, size_t rows, size_t cols, size_t bi, uint8_t *q,
                                    float *scales, uint16_t *amax) {
    size_t nbc = (cols + QB - 1) / QB, r0 = bi * QB, r1 = r0 + QB < rows ? r0 + QB : rows;
    for (size_t j = 0; j < nbc; j++) {
        size_t c0 = j * QB, c1 = c0 + QB < cols ? c0 + QB : cols;
        uint32_t m = 0;
        for (size_t r = r0; r < r1; r++) m = amax_span(src, kind, r * cols + c0, r * cols + c1, m);
        if (amax) amax[bi * nbc + j] = (uint16_t)m; /* bfloat16 input only (checked) */
        float s = fp8_block_scale(amax_value(m, kind)); /* a NaN in the block: NaN */
        float rec = 1.0f / s; /* an Inf scale gives 0: finite elements ±0, infinities NaN */
        scales[bi * nbc + j] = s;
        int finite = s - s == 0.0f; /* false for Inf and NaN */
        for (size_t r = r0; r < r1; r++) scale_span(src, kind, r * cols + c0, r * cols + c1, rec, q, finite);
    }
}

/* mxfp8 of row r. */
DS_CLONES static void mx_row(const void *src, int kind, size_t cols, size_t r, uint8_t *q, uint8_t *scales,
                             uint16_t *amax) {
    size_t nb = cols / MXB;
    for (size_t j = 0; j < nb; j++) {
        size_t i0 = r * cols + j * MXB;
        uint32_t m = amax_span(src, kind, i0, i0 + MXB, 0);
        if (amax) amax[r * nb + j] = (uint16_t)m; /* bfloat16 input only (checked) */
        uint8_t e = mx_scale_code(amax_value(m, kind));
        scales[r * nb + j] = e;
        if (e == E8M0_NAN) { /* a NaN or an infinity in the block: all NaN */
            memset(q + i0, E4M3_NAN, MXB);
            continue;
        }
        scale_span(src, kind, i0, i0 + MXB, mx_multiplier(e), q, 1); /* × 2**(127-e), exact */
    }
}

typedef struct {
    Py_buffer src, q, s, a;
    int have_src, have_q, have_s, have_a;
} bufs;

static void release(bufs *b) {
    if (b->have_src) PyBuffer_Release(&b->src);
    if (b->have_q) PyBuffer_Release(&b->q);
    if (b->have_s) PyBuffer_Release(&b->s);
    if (b->have_a) PyBuffer_Release(&b->a);
}

/* Parse (src, kind, rows, cols, q, scales, first, last[, amax]) and check every size against the
 * tensor: `scale_bytes` is the size scales must have; amax (bfloat16 input only) holds a uint16
 * per scale. Returns 0, or -1 with an error set. */
static int parse(PyObject *args, bufs *b, int *kind, Py_ssize_t *rows, Py_ssize_t *cols, Py_ssize_t *first,
                 Py_ssize_t *last, Py_ssize_t (*scale_bytes)(Py_ssize_t, Py_ssize_t), Py_ssize_t units_of) {
    PyObject *src, *q, *s, *a = Py_None;
    memset(b, 0, sizeof(*b));
    if (!PyArg_ParseTuple(args, "OinnOOnn|O", &src, kind, rows, cols, &q, &s, first, last, &a)) return -1;
    if (*kind < K_BF16 || *kind > K_F32 || *rows < 0 || *cols < 0) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (bfloat16), 1 (float16) or 2 (float32); rows, cols >= 0");
        return -1;
    }
    Py_ssize_t units = units_of == QB ? (*rows + QB - 1) / QB : *rows;
    if (*first < 0 || *last < *first || *last > units) {
        PyErr_Format(PyExc_ValueError, "range [%zd, %zd) is not within [0, %zd)", *first, *last, units);
        return -1;
    }
    if (*cols > 0 && *rows > PY_SSIZE_T_MAX / 4 / *cols) {
        PyErr_SetString(PyExc_ValueError, "tensor too large");
        return -1;
    }
    if (ds_get_buffer(src, &b->src, 0, "src") < 0) goto fail;
    b->have_src = 1;
    if (ds_get_buffer(q, &b->q, 1, "q") < 0) goto fail;
    b->have_q = 1;
    if (ds_get_buffer(s, &b->s, 1, "scales") < 0) goto fail;
    b->have_s = 1;
    Py_ssize_t n = *rows * *cols, width = *kind == K_F32 ? 4 : 2;
    if (b->src.len != n * width || b->q.len != n || b->s.len != scale_bytes(*rows, *cols)) {
        PyErr_SetString(PyExc_ValueError, "src, q and scales must hold exactly the tensor's elements and scales");
        goto fail;
    }
    if (a != Py_None) {
        if (ds_get_buffer(a, &b->a, 1, "amax") < 0) goto fail;
        b->have_a = 1;
        Py_ssize_t per = units_of == QB ? 4 : 1; /* scale bytes per scale */
        if (*kind != K_BF16 || b->a.len != b->s.len / per * 2) {
            PyErr_SetString(PyExc_ValueError, "amax is for bfloat16 input, one uint16 per scale");
            goto fail;
        }
    }
    return 0;
fail:
    release(b);
    return -1;
}

static Py_ssize_t fp8_scale_bytes(Py_ssize_t rows, Py_ssize_t cols) {
    return ((rows + QB - 1) / QB) * ((cols + QB - 1) / QB) * 4;
}

static Py_ssize_t mx_scale_bytes(Py_ssize_t rows, Py_ssize_t cols) {
    return cols % MXB ? -1 : rows * (cols / MXB);
}

PyDoc_STRVAR(quantize_fp8_block128_doc,
"quantize_fp8_block128(src, kind, rows, cols, q, scales, first, last, amax=None)\n\n"
"fp8-block128 of block rows [first, last) of a C-contiguous [rows, cols] tensor whose bytes are\n"
"`src` (kind 0 bfloat16, 1 float16, 2 float32): E4M3 codes into `q` (rows*cols bytes) and the\n"
"float32 scales (dequantization multipliers) into `scales` ([ceil(rows/128), ceil(cols/128)]),\n"
"and with bfloat16 input each block's max |x| bits into `amax` (uint16 per scale) if given.\n"
"What deltastore.serving.quantize.quantize_fp8_block128 writes. Releases the GIL.");

static PyObject *py_quantize_fp8_block128(PyObject *self, PyObject *args) {
    (void)self;
    bufs b;
    int kind;
    Py_ssize_t rows, cols, first, last;
    if (parse(args, &b, &kind, &rows, &cols, &first, &last, fp8_scale_bytes, QB) < 0) return NULL;
    const void *src = b.src.buf;
    uint8_t *q = (uint8_t *)b.q.buf;
    float *scales = (float *)b.s.buf;
    uint16_t *amax = b.have_a ? (uint16_t *)b.a.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t bi = first; bi < last; bi++)
        fp8_block_row(src, kind, (size_t)rows, (size_t)cols, (size_t)bi, q, scales, amax);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(quantize_mxfp8_doc,
"quantize_mxfp8(src, kind, rows, cols, q, scales, first, last, amax=None)\n\n"
"mxfp8 of rows [first, last) of a C-contiguous [rows, cols] tensor (cols a multiple of 32) whose\n"
"bytes are `src` (kind as quantize_fp8_block128): E4M3 codes into `q` and the E8M0 exponents into\n"
"`scales` (uint8 [rows, cols/32]), and amax as quantize_fp8_block128. What\n"
"deltastore.serving.quantize.quantize_mxfp8 writes.\n"
"Releases the GIL.");

static PyObject *py_quantize_mxfp8(PyObject *self, PyObject *args) {
    (void)self;
    bufs b;
    int kind;
    Py_ssize_t rows, cols, first, last;
    if (parse(args, &b, &kind, &rows, &cols, &first, &last, mx_scale_bytes, 1) < 0) return NULL;
    const void *src = b.src.buf;
    uint8_t *q = (uint8_t *)b.q.buf, *scales = (uint8_t *)b.s.buf;
    uint16_t *amax = b.have_a ? (uint16_t *)b.a.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = first; r < last; r++) mx_row(src, kind, (size_t)cols, (size_t)r, q, scales, amax);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

PyMethodDef ds_quant_methods[] = {
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
    {"quantize_fp8_block128", py_quantize_fp8_block128, METH_VARARGS, quantize_fp8_block128_doc},
    {"quantize_mxfp8", py_quantize_mxfp8, METH_VARARGS, quantize_mxfp8_doc},
#endif
    {NULL, NULL, 0, NULL},
};
