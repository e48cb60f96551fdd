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
#include "ds_native.h"
#include <float.h>
#include <string.h>

#define QB 128                         /* fp8-block128 block side (quantize.BLOCK) */
#define MXB 32                         /* mxfp8 block length (quantize.MX_BLOCK) */
#define INV_E4M3_MAX_BITS 0x3B124925u  /* float32(1/448) (quantize.INV_E4M3_MAX_BITS) */
#define AMAX_FLOOR_BITS 0x38D1B717u    /* float32(1e-4) (quantize.AMAX_FLOOR) */
#define E4M3_NAN 0x7Fu
#define E8M0_NAN 0xFFu
#define F32_NAN_BITS 0x7FC00000u

/* Input kinds, in the order of quantize.INPUT_DTYPES. */
enum { K_BF16 = 0, K_F16 = 1, K_F32 = 2 };

static inline float f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint32_t u32(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* float16 to float32, exactly (subnormals included; NaN payloads kept). */
static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return f32(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 0x1p-24f; /* exact: m < 2**10 */
        return f32(sign | u32(v));
    }
    return f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* The float32 bits of p to an E4M3 (float8_e4m3fn) code: nearest, ties to even; beyond 448
 * (Inf too) saturates to ±448; NaN is 0x7F; the sign of zero is kept (quantize.encode_e4m3). */
static inline uint8_t e4m3(uint32_t b) {
    /* branch-free, selects by masks, so that the loops calling it vectorize */
    uint32_t sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
    /* 2**-6 and above: rebias the exponent (127 -> 7) and round the 20 dropped bits to
     * nearest-even by adding just under half, plus one when the kept bits are odd */
    uint32_t c = (a + 0x7FFFFu + ((a >> 20) & 1u) - (120u << 23)) >> 20;
    /* below 2**-6: multiples of 2**-9; adding 2**14 (exactly) rounds to them, to nearest-even */
    uint32_t small = 0u - (uint32_t)(a < 0x3C800000u);
    uint32_t tiny = u32(f32(a & small) + 16384.0f) - 0x46800000u;
    c = (tiny & small) | (c & ~small);
    uint32_t big = 0u - (uint32_t)(a > 0x43E00000u); /* beyond 448, Inf too: saturate */
    c = (0x7Eu & big) | (c & ~big);
    uint32_t nan = 0u - (uint32_t)(a > 0x7F800000u);
    return (uint8_t)((E4M3_NAN & nan) | ((c | sign) & ~nan));
}

/* e4m3 for |p| <= 464 and not NaN, what every element of a finite block is (|p| stays within
 * 448·(1 + 2**-22)): the same codes without the saturation and NaN selects. */
static inline uint8_t e4m3_finite(uint32_t b) {
    uint32_t sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
    uint32_t c = (a + 0x7FFFFu + ((a >> 20) & 1u) - (120u << 23)) >> 20;
    uint32_t small = 0u - (uint32_t)(a < 0x3C800000u);
    uint32_t tiny = u32(f32(a & small) + 16384.0f) - 0x46800000u;
    return (uint8_t)(((tiny & small) | (c & ~small)) | sign);
}

/* |x|'s bits (order as the values do; a NaN's exceed every other), and back to float32. */
#define ABS16(p, i) ((uint32_t)(((const uint16_t *)(p))[i] & 0x7FFFu))
#define ABS32(p, i) (((const uint32_t *)(p))[i] & 0x7FFFFFFFu)

static inline float amax_value(uint32_t bits, int kind) {
    if (kind == K_BF16) return f32(bits << 16);
    if (kind == K_F16) return half_to_f32((uint16_t)bits);
    return f32(bits);
}

/* The functions with the element loops are built for AVX-512 (x86-64-v4, GCC 12+), AVX2 and
 * the baseline on x86-64 Linux, and the loader picks one per CPU (ifunc): more lanes per
 * instruction, and AVX-512's narrowing stores. Every clone computes the same bits: the same
 * binary32 operations, none contracted into an FMA (no product feeds an add). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define DS_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__linux__) && defined(__clang__) && __clang_major__ >= 14
#define DS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DS_CLONES
#endif

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
                                    float *scales) {
    const float floor_ = f32(AMAX_FLOOR_BITS), inv = f32(INV_E4M3_MAX_BITS);
    size_t nbc = (cols + QB - 1) / QB, r0 = bi * QB, r1 = r0 + QB < rows ? r0 + QB : rows;
    for (size_t j = 0; j < nbc; j++) {
        size_t c0 = j * QB, c1 = c0 + QB < cols ? c0 + QB : cols;
        uint32_t m = 0;
        for (size_t r = r0; r < r1; r++) m = amax_span(src, kind, r * cols + c0, r * cols + c1, m);
        float a = amax_value(m, kind);
        float s = a != a ? f32(F32_NAN_BITS) : (a > floor_ ? a : floor_) * inv; /* a NaN in the block: NaN */
        float rec = 1.0f / s; /* an Inf scale gives 0: finite elements ±0, infinities NaN */
        scales[bi * nbc + j] = s;
        int finite = s - s == 0.0f; /* false for Inf and NaN */
        for (size_t r = r0; r < r1; r++) scale_span(src, kind, r * cols + c0, r * cols + c1, rec, q, finite);
    }
}

/* mxfp8 of row r. */
DS_CLONES static void mx_row(const void *src, int kind, size_t cols, size_t r, uint8_t *q, uint8_t *scales) {
    const float inv = f32(INV_E4M3_MAX_BITS);
    size_t nb = cols / MXB;
    for (size_t j = 0; j < nb; j++) {
        size_t i0 = r * cols + j * MXB;
        uint32_t rb = u32(amax_value(amax_span(src, kind, i0, i0 + MXB, 0), kind) * inv);
        uint32_t exp = (rb >> 23) & 0xFFu, mant = rb & 0x7FFFFFu;
        if (exp == 0xFF) { /* a NaN or an infinity in the block: all NaN */
            scales[r * nb + j] = E8M0_NAN;
            memset(q + i0, E4M3_NAN, MXB);
            continue;
        }
        uint32_t e = exp + (exp == 0 ? mant > 0x400000u : mant != 0); /* the power of two at or above */
        scales[r * nb + j] = (uint8_t)e;
        scale_span(src, kind, i0, i0 + MXB, f32((254u - e) << 23), q, 1); /* × 2**(127-e), exact */
    }
}

typedef struct {
    Py_buffer src, q, s;
    int have_src, have_q, have_s;
} bufs;

static void release(bufs *b) {
    if (b->have_src) PyBuffer_Release(&b->src);
    if (b->have_q) PyBuffer_Release(&b->q);
    if (b->have_s) PyBuffer_Release(&b->s);
}

/* Parse (src, kind, rows, cols, q, scales, first, last) and check every size against the
 * tensor: `scale_bytes` is the size scales must have. Returns 0, or -1 with an error set. */
static int parse(PyObject *args, bufs *b, int *kind, Py_ssize_t *rows, Py_ssize_t *cols, Py_ssize_t *first,
                 Py_ssize_t *last, Py_ssize_t (*scale_bytes)(Py_ssize_t, Py_ssize_t), Py_ssize_t units_of) {
    PyObject *src, *q, *s;
    memset(b, 0, sizeof(*b));
    if (!PyArg_ParseTuple(args, "OinnOOnn", &src, kind, rows, cols, &q, &s, first, last)) return -1;
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
"quantize_fp8_block128(src, kind, rows, cols, q, scales, first, last)\n\n"
"fp8-block128 of block rows [first, last) of a C-contiguous [rows, cols] tensor whose bytes are\n"
"`src` (kind 0 bfloat16, 1 float16, 2 float32): E4M3 codes into `q` (rows*cols bytes) and the\n"
"float32 scales (dequantization multipliers) into `scales` ([ceil(rows/128), ceil(cols/128)]).\n"
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
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t bi = first; bi < last; bi++)
        fp8_block_row(src, kind, (size_t)rows, (size_t)cols, (size_t)bi, q, scales);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(quantize_mxfp8_doc,
"quantize_mxfp8(src, kind, rows, cols, q, scales, first, last)\n\n"
"mxfp8 of rows [first, last) of a C-contiguous [rows, cols] tensor (cols a multiple of 32) whose\n"
"bytes are `src` (kind as quantize_fp8_block128): E4M3 codes into `q` and the E8M0 exponents into\n"
"`scales` (uint8 [rows, cols/32]). What deltastore.serving.quantize.quantize_mxfp8 writes.\n"
"Releases the GIL.");

static PyObject *py_quantize_mxfp8(PyObject *self, PyObject *args) {
    (void)self;
    bufs b;
    int kind;
    Py_ssize_t rows, cols, first, last;
    if (parse(args, &b, &kind, &rows, &cols, &first, &last, mx_scale_bytes, 1) < 0) return NULL;
    const void *src = b.src.buf;
    uint8_t *q = (uint8_t *)b.q.buf, *scales = (uint8_t *)b.s.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = first; r < last; r++) mx_row(src, kind, (size_t)cols, (size_t)r, q, scales);
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
