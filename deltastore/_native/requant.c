/* Incremental requantization (deltastore/write/requant.py): a serving stream's next version from
 * the bfloat16 elements that changed, not from the whole tensor.
 *
 * The store's encoder lists each changed element (encode_add(..., values=True): position, old
 * and new bits). A block whose max |x| stays the same keeps its scale, so only its changed
 * elements can get new codes. Per change, a block becomes *dirty* (requantized whole, scale
 * included) when the element's new |x| exceeds the block's max, when its old code is the block's
 * top code (it may have held the max, which could then fall: codes are monotone in |x|, so an
 * element below the top code was below the max), or when the block's scale is not finite. Every
 * other change is requantized alone, from its old and new bits, with the block's unchanged scale,
 * by the same operations as the full quantizers (ds_quant.h), so the result equals a full
 * quantization bit for bit.
 *
 * requant_classify classifies one chunk's changes (vectorized, a batch at a time) on the encode
 * thread that listed them, right after the scan, while the list is in cache; requant_rescale then
 * rescales the tensor's dirty blocks, and requant_delta walks one chunk of the reference codes
 * once: it emits the changed codes and the dirty blocks' elements as encode_add's raw
 * add-sparse/1 planes (encode.c; 1-byte elements), advances the reference, and hashes it: what
 * encode_add returns for the same chunk.
 * tests/write/test_requant.py proves both equalities. */
#include "ds_buf.h"
#include "ds_quant.h"
#include "ds_xxh3.h"

#include <stdlib.h>

enum { FMT_FP8 = 0, FMT_MX = 1 };

#define BF16_F32(bits) f32((uint32_t)(bits) << 16)
/* 1e-4 (AMAX_FLOOR_BITS) rounded up to bfloat16: a block max at or above it is its own floor. */
#define FLOOR_BF16 ((AMAX_FLOOR_BITS + 0xFFFFu) >> 16)

/* --- marking dirty blocks ------------------------------------------------------------- */

/* Block b's element multiplier and whether its scale is finite. */
static inline float block_mult(int fmt, const void *scales, size_t b, int *finite) {
    if (fmt == FMT_MX) {
        uint8_t e = ((const uint8_t *)scales)[b];
        *finite = e != E8M0_NAN;
        return *finite ? mx_multiplier(e) : f32(F32_NAN_BITS);
    }
    float s = ((const float *)scales)[b];
    *finite = s - s == 0.0f;
    return 1.0f / s;
}

/* Requantize dirty block b's scale and max from src (bfloat16). */
DS_CLONES static void rescale_block(int fmt, const uint16_t *src, size_t rows, size_t cols, size_t nbc, size_t b,
                          void *scales, uint16_t *amax) {
    uint32_t m = 0;
    if (fmt == FMT_MX) {
        for (size_t i = b * MXB; i < b * MXB + MXB; i++) m = ABS16(src, i) > m ? ABS16(src, i) : m;
        amax[b] = (uint16_t)m;
        ((uint8_t *)scales)[b] = mx_scale_code(BF16_F32(m));
        return;
    }
    size_t r0 = (b / nbc) * QB, r1 = r0 + QB < rows ? r0 + QB : rows;
    size_t c0 = (b % nbc) * QB, c1 = c0 + QB < cols ? c0 + QB : cols;
    for (size_t r = r0; r < r1; r++)
        for (size_t i = r * cols + c0; i < r * cols + c1; i++) m = ABS16(src, i) > m ? ABS16(src, i) : m;
    amax[b] = (uint16_t)m;
    ((float *)scales)[b] = fp8_block_scale(BF16_F32(m));
}

/* Check fmt, rows, cols and the block count; the number of blocks, or -1 with an error set. */
static Py_ssize_t n_blocks(int fmt, Py_ssize_t rows, Py_ssize_t cols) {
    if ((fmt != FMT_FP8 && fmt != FMT_MX) || rows < 0 || cols < 0 || (cols > 0 && rows > PY_SSIZE_T_MAX / 4 / cols) ||
        (fmt == FMT_MX && cols % MXB)) {
        PyErr_SetString(PyExc_ValueError, "fmt must be 0 (fp8-block128) or 1 (mxfp8, cols a multiple of 32); "
                                          "rows, cols >= 0");
        return -1;
    }
    if (fmt == FMT_MX) return rows * (cols / MXB);
    return ((rows + QB - 1) / QB) * ((cols + QB - 1) / QB);
}

/* Changes classified at a time (a few KiB of scratch per array, in L1). */
#define BATCH 1024

typedef struct {
    uint32_t blk[BATCH], top[BATCH];
    float mult[BATCH];
    uint8_t cmax[BATCH], oq[BATCH], nq[BATCH], verdict[BATCH];
    uint16_t hit[BATCH];
} batch;

enum { V_SAME = 0, V_CODE = 1, V_DIRTY = 2 };

/* The block of each of n changes at pos[i] of a chunk starting at row `row0` (branch-free, so that
 * it vectorizes). The row is p / cols by a multiply-high with m = floor(2**32 / cols): for p below
 * 2**32, p·m / 2**32 lies in (p/cols - 1, p/cols], so its floor is the row or one less, fixed by one
 * compare (cheaper than a float division where the CPU has no unsigned-to-double conversion). */
DS_CLONES static void blocks_of(batch *t, const uint32_t *pos, size_t n, int fmt, size_t start, size_t cols,
                                size_t nbc) {
    if (fmt == FMT_MX) {
        for (size_t i = 0; i < n; i++) t->blk[i] = (uint32_t)((start + pos[i]) / MXB);
        return;
    }
    const uint64_t m = ((uint64_t)1 << 32) / cols; /* cols >= 1: m <= 2**32, p·m < 2**64 */
    const uint32_t row0 = (uint32_t)(start / cols), c = (uint32_t)cols, nb = (uint32_t)nbc;
    for (size_t i = 0; i < n; i++) {
        uint32_t p = pos[i], r = (uint32_t)(((uint64_t)p * m) >> 32);
        r += p - r * c >= c; /* r·c <= p: no wrap */
        t->blk[i] = ((row0 + r) / QB) * nb + (p - r * c) / QB;
    }
}

/* Per change: V_DIRTY when its block's scale is not finite (a NaN multiplier), its new |x| exceeds
 * the block's max, or its old code reaches the block's top code (`cmax`); else V_CODE when its
 * code changed. Element-wise over the batch's arrays, branch-free: it vectorizes. `top_codes`:
 * compute each block's top code here (mxfp8: the code of its max under its scale); otherwise the
 * batch's cmax holds it (fp8-block128: one per block, block_tables). */
DS_CLONES static void classify(batch *t, const uint16_t *ov, const uint16_t *nv, size_t n, int top_codes) {
    if (top_codes)
        for (size_t i = 0; i < n; i++) t->cmax[i] = e4m3_finite(u32(BF16_F32(t->top[i]) * t->mult[i])) & 0x7Fu;
    for (size_t i = 0; i < n; i++) {
        float mult = t->mult[i];
        uint32_t top = t->top[i];
        uint32_t oq = e4m3_finite(u32(BF16_F32(ov[i]) * mult));
        uint32_t nq = e4m3_finite(u32(BF16_F32(nv[i]) * mult));
        uint32_t dirty = (uint32_t)(mult - mult != 0.0f) | (uint32_t)((nv[i] & 0x7FFFu) > top) |
                         (uint32_t)((oq & 0x7Fu) >= t->cmax[i]);
        t->oq[i] = (uint8_t)oq;
        t->nq[i] = (uint8_t)nq;
        t->verdict[i] = (uint8_t)(dirty * V_DIRTY | (1u - dirty) * (uint32_t)(nq != oq));
    }
}

/* The batch's block tables: each change's block max, multiplier and (fp8-block128) top code.
 * One loop per format, branch-free (gathers). */
DS_CLONES static void lookup_fp8(batch *t, size_t n, const float *mults, const uint8_t *cmax, const uint16_t *amax) {
    for (size_t i = 0; i < n; i++) {
        uint32_t b = t->blk[i];
        t->top[i] = amax[b];
        t->mult[i] = mults[b];
        t->cmax[i] = cmax[b];
    }
}

DS_CLONES static void lookup_mx(batch *t, size_t n, const uint8_t *escales, const uint16_t *amax) {
    for (size_t i = 0; i < n; i++) {
        uint32_t b = t->blk[i], e = escales[b];
        t->top[i] = amax[b];
        t->mult[i] = f32(e == E8M0_NAN ? F32_NAN_BITS : (254u - e) << 23);
    }
}

/* A block's dirty flag, which the chunks of one tensor classified on two threads may both set
 * (only ever to 1): a relaxed atomic store, so that the race is defined. */
#if defined(__GNUC__) || defined(__clang__)
#define SET_DIRTY(p) __atomic_store_n((p), (uint8_t)1, __ATOMIC_RELAXED)
#else
#define SET_DIRTY(p) (*(p) = 1)
#endif

/* Classify one chunk's changes (see classify): set dirty[b] for each dirty block, and append each
 * other change whose code changed to pos/oc/nc. `ps`, `ov`, `nv`: the change list (positions in
 * the chunk, old and new bfloat16 bits) of the chunk starting at element `start`. -1: no memory. */
static int classify_chunk(int fmt, const uint32_t *ps, const uint16_t *ov, const uint16_t *nv, size_t n, size_t start,
                          size_t cols, size_t nbc, const void *scales, const float *mults, const uint8_t *cmax,
                          const uint16_t *amax, uint8_t *dirty, dsbuf *pos, dsbuf *oc, dsbuf *nc, batch *t) {
    for (size_t i0 = 0; i0 < n; i0 += BATCH) {
        size_t m = n - i0 < BATCH ? n - i0 : BATCH;
        blocks_of(t, ps + i0, m, fmt, start, cols, nbc);
        if (fmt == FMT_FP8)
            lookup_fp8(t, m, mults, cmax, amax);
        else
            lookup_mx(t, m, (const uint8_t *)scales, amax);
        classify(t, ov + i0, nv + i0, m, fmt != FMT_FP8);
        size_t hits = 0; /* the changes with a verdict, gathered without a branch per change */
        for (size_t i = 0; i < m; i++) {
            t->hit[hits] = (uint16_t)i;
            hits += t->verdict[i] != V_SAME;
        }
        if (reserve(pos, 8 * hits) < 0 || reserve(oc, hits) < 0 || reserve(nc, hits) < 0) return -1;
        for (size_t h = 0; h < hits; h++) {
            size_t i = t->hit[h];
            if (t->verdict[i] == V_DIRTY) {
                SET_DIRTY(&dirty[t->blk[i]]);
                continue;
            }
            /* a change in a block found dirty (here or by another chunk) is skipped by requant_delta,
             * which requantizes that block whole */
            int64_t pp = (int64_t)(start + ps[i0 + i]);
            memcpy(pos->p + pos->len, &pp, 8);
            pos->len += 8;
            oc->p[oc->len++] = t->oq[i];
            nc->p[nc->len++] = t->nq[i];
        }
    }
    return 0;
}

/* A chunk's change list as encode_add(..., values=True) hands it over: positions (u32, increasing,
 * each below `limit`), old and new values (u16) as many. */
static int change_list_ok(const Py_buffer *positions, const Py_buffer *old_values, const Py_buffer *new_values,
                          size_t limit) {
    Py_ssize_t n = positions->len / 4;
    const uint32_t *ps = (const uint32_t *)positions->buf;
    uint32_t unordered = 0;
    for (Py_ssize_t i = 1; i < n; i++) unordered |= ps[i] <= ps[i - 1]; /* increasing (vectorizes) */
    return positions->len % 4 == 0 && old_values->len == 2 * n && new_values->len == 2 * n && !unordered &&
           (n == 0 || ps[n - 1] < limit);
}

/* fp8-block128: blocks [b0, b1)'s element multipliers, 1/s (NaN for a non-finite s), and top
 * codes: 0x7E where the block's max reaches the floor (its scale maps the max to 448), else the
 * code of its max (any value where the multiplier is NaN: such a block is dirty). */
static void block_tables(const float *scales, const uint16_t *amax, float *mults, uint8_t *cmax, size_t b0, size_t b1) {
    for (size_t b = b0; b < b1; b++) {
        float s = scales[b];
        float m = mults[b] = s - s == 0.0f ? 1.0f / s : f32(F32_NAN_BITS);
        cmax[b] = amax[b] >= FLOOR_BF16 ? 0x7Eu : e4m3_finite(u32(BF16_F32(amax[b]) * m)) & 0x7Fu;
    }
}

/* Room for block_tables' two tables of nb blocks, in one allocation: the multipliers, then the
 * top codes at *cmax. NULL when out of memory; free() the multipliers. */
static float *block_tables_alloc(Py_ssize_t nb, uint8_t **cmax) {
    size_t n = (size_t)(nb ? nb : 1);
    float *mults = (float *)malloc(n * (sizeof(float) + sizeof(uint8_t)));
    *cmax = mults ? (uint8_t *)(mults + n) : NULL;
    return mults;
}

PyDoc_STRVAR(requant_classify_doc,
"requant_classify(fmt, rows, cols, start, positions, old_values, new_values, scales, amax,\n"
"    dirty) -> (positions, old_codes, new_codes)\n\n"
"The first step of requantizing a [rows, cols] bfloat16 tensor incrementally (see requant.c), per\n"
"changed chunk: the change list encode_add(..., values=True) returned for the chunk starting at\n"
"element `start` (whole rows). `scales` (float32 per 128x128 block for fmt 0, fp8-block128;\n"
"uint8 E8M0 per 32 elements for fmt 1, mxfp8) and `amax` (each block's max |x| bits, uint16) are\n"
"the previous version's; dirty[b] (uint8 per block) is set to 1 for each block that turns dirty\n"
"(never cleared: the chunks of one tensor may be classified on several threads). Returns, for\n"
"each other changed element whose code changed, its position in the tensor (int64), old and new\n"
"code (bytes). ValueError for an inconsistent change list. Releases the GIL.");

static PyObject *py_requant_classify(PyObject *self, PyObject *args) {
    (void)self;
    int fmt;
    Py_ssize_t rows, cols, start;
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "innnOOOOOO:requant_classify", &fmt, &rows, &cols, &start, &o[0], &o[1], &o[2], &o[3],
                          &o[4], &o[5]))
        return NULL;
    Py_ssize_t nb = n_blocks(fmt, rows, cols);
    if (nb < 0) return NULL;
    static const char *const names[6] = {"positions", "old_values", "new_values", "scales", "amax", "dirty"};
    Py_buffer bf[6];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 6; held++)
        if (ds_get_buffer(o[held], &bf[held], held == 5, names[held]) < 0) goto out;
    {
        Py_ssize_t n_elems = rows * cols, sw = fmt == FMT_MX ? 1 : 4, n = bf[0].len / 4;
        const uint32_t *ps = (const uint32_t *)bf[0].buf;
        if (bf[3].len != nb * sw || bf[4].len != 2 * nb || bf[5].len != nb || start < 0 || start > n_elems ||
            (cols > 0 && start % cols)) {
            PyErr_SetString(PyExc_ValueError, "requant_classify: scales, amax or dirty does not fit the tensor, or "
                                              "start is not a row's first element within it");
            goto out;
        }
        if (!change_list_ok(&bf[0], &bf[1], &bf[2], (size_t)(n_elems - start))) {
            PyErr_SetString(PyExc_ValueError, "requant_classify: the chunk's change list is inconsistent");
            goto out;
        }
        dsbuf pos = {0}, oc = {0}, nc = {0};
        size_t nbc = fmt == FMT_MX ? 0 : (size_t)((cols + QB - 1) / QB);
        int rc = 0;
        /* fp8-block128: each block's element multiplier and top code (block_tables) */
        uint8_t *cmax = NULL;
        float *mults = fmt == FMT_FP8 ? block_tables_alloc(nb, &cmax) : NULL;
        batch *t = (batch *)malloc(sizeof(batch));
        if ((fmt == FMT_FP8 && mults == NULL) || t == NULL) rc = -1;
        Py_BEGIN_ALLOW_THREADS
        if (mults) block_tables((const float *)bf[3].buf, (const uint16_t *)bf[4].buf, mults, cmax, 0, (size_t)nb);
        if (rc == 0)
            rc = classify_chunk(fmt, ps, (const uint16_t *)bf[1].buf, (const uint16_t *)bf[2].buf, (size_t)n,
                                (size_t)start, (size_t)cols, nbc, bf[3].buf, mults, cmax, (const uint16_t *)bf[4].buf,
                                (uint8_t *)bf[5].buf, &pos, &oc, &nc, t);
        Py_END_ALLOW_THREADS
        free(mults);
        free(t);
        if (rc < 0)
            PyErr_NoMemory();
        else
            result = Py_BuildValue("(NNN)", buf_bytes(&pos), buf_bytes(&oc), buf_bytes(&nc));
        free(pos.p);
        free(oc.p);
        free(nc.p);
    }
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&bf[i]);
    return result;
}

PyDoc_STRVAR(requant_rescale_doc,
"requant_rescale(fmt, src, rows, cols, scales, amax, dirty) -> n_dirty\n\n"
"After requant_classify of every changed chunk: each dirty block's scale and max (`scales`,\n"
"`amax`, updated in place) requantized from `src`, the tensor's new bfloat16 bits. Returns the\n"
"number of dirty blocks. Releases the GIL.");

static PyObject *py_requant_rescale(PyObject *self, PyObject *args) {
    (void)self;
    int fmt;
    Py_ssize_t rows, cols;
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "iOnnOOO:requant_rescale", &fmt, &o[0], &rows, &cols, &o[1], &o[2], &o[3])) return NULL;
    Py_ssize_t nb = n_blocks(fmt, rows, cols);
    if (nb < 0) return NULL;
    static const char *const names[4] = {"src", "scales", "amax", "dirty"};
    Py_buffer bf[4];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 4; held++)
        if (ds_get_buffer(o[held], &bf[held], held == 1 || held == 2, names[held]) < 0) goto out;
    {
        Py_ssize_t sw = fmt == FMT_MX ? 1 : 4;
        if (bf[0].len != 2 * rows * cols || bf[1].len != nb * sw || bf[2].len != 2 * nb || bf[3].len != nb) {
            PyErr_SetString(PyExc_ValueError, "requant_rescale: src, scales, amax or dirty does not fit the tensor");
            goto out;
        }
        size_t n_dirty = 0, nbc = fmt == FMT_MX ? 0 : (size_t)((cols + QB - 1) / QB);
        const uint8_t *dirty = (const uint8_t *)bf[3].buf;
        Py_BEGIN_ALLOW_THREADS
        for (const uint8_t *d = dirty, *end = dirty + nb; (d = (const uint8_t *)memchr(d, 1, (size_t)(end - d)));
             d++) { /* few blocks are dirty: memchr skips the others a vector at a time */
            rescale_block(fmt, (const uint16_t *)bf[0].buf, (size_t)rows, (size_t)cols, nbc, (size_t)(d - dirty),
                          bf[1].buf, (uint16_t *)bf[2].buf);
            n_dirty++;
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSize_t(n_dirty);
    }
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&bf[i]);
    return result;
}

/* --- the delta of a chunk ---------------------------------------------------------------- */

typedef struct {
    uint8_t *syms, *codes, *esc, *rest;
    size_t k, n_esc, n_rest, cap_k, cap_rest, next;
    uint32_t max_rest;
} emitter;

static void em_free(emitter *e) {
    free(e->syms);
    free(e->codes);
    free(e->esc);
    free(e->rest);
}

/* Room for `more` changes. -1: out of memory. */
static int em_reserve(emitter *e, size_t more) {
    if (e->k + more > e->cap_k) {
        size_t nc = e->cap_k ? e->cap_k : 4096;
        while (nc < e->k + more) nc *= 2;
        uint8_t *s = (uint8_t *)realloc(e->syms, nc), *c, *x;
        if (s == NULL) return -1;
        e->syms = s;
        if ((c = (uint8_t *)realloc(e->codes, nc / 2 + 1)) == NULL) return -1;
        e->codes = c;
        if ((x = (uint8_t *)realloc(e->esc, nc)) == NULL) return -1;
        e->esc = x;
        e->cap_k = nc;
    }
    if (4 * (e->n_rest + more) > e->cap_rest) {
        size_t nc = e->cap_rest ? e->cap_rest : 1024;
        while (nc < 4 * (e->n_rest + more)) nc *= 2;
        uint8_t *r = (uint8_t *)realloc(e->rest, nc);
        if (r == NULL) return -1;
        e->rest = r;
        e->cap_rest = nc;
    }
    return 0;
}

/* One change at chunk element j (after every earlier one): encode.c's EMIT for 1-byte elements,
 * branch-free as it is (the escapes are data-dependent; a branch on them mispredicts). Needs room
 * for it (em_reserve): the escape slots are written whether or not they are kept. Called on a
 * local copy of the emitter (emit_entries), so that its fields stay in registers across the
 * byte stores. */
static inline void em_put(emitter *e, size_t j, uint8_t ov, uint8_t nv) {
    size_t gap = j - e->next;
    e->next = j + 1;
    int eg = gap >= DS_GAP_ESCAPE;
    uint32_t rr = (uint32_t)(gap - DS_GAP_ESCAPE); /* kept only when eg */
    memcpy(e->rest + 4 * e->n_rest, &rr, 4);
    e->n_rest += (size_t)eg;
    e->max_rest = eg && rr > e->max_rest ? rr : e->max_rest;
    e->syms[e->k] = eg ? (uint8_t)DS_GAP_ESCAPE : (uint8_t)gap;
    uint8_t d = (uint8_t)(nv - ov);
    uint8_t zz = (uint8_t)((uint8_t)(d << 1) ^ (uint8_t)(0 - (d >> 7)));
    int ev = zz >= DS_NIBBLE_ESCAPE;
    e->esc[e->n_esc] = zz; /* kept only when ev */
    e->n_esc += (size_t)ev;
    uint8_t code = ev ? (uint8_t)DS_NIBBLE_ESCAPE : zz;
    uint8_t *c = e->codes + (e->k >> 1);
    *c = (e->k & 1) ? (uint8_t)(*c | (code << 4)) : code;
    e->k++;
}

/* The walk of one chunk: its reference codes `old` (elements [e0, e1) of the tensor) and the
 * merged inputs. */
typedef struct {
    const uint16_t *src;
    size_t cols, e0, e1;
    const int64_t *pos;
    const uint8_t *oc, *nc, *dirty;
    size_t np, pi;
    const void *scales;
    uint8_t *old;
    emitter em;
    int out_of_step; /* an entry's old code is not the reference's */
} walk;

/* Emit entries (changed codes) before element `until`. -1: no memory or out of step. The walk's
 * fields are read into locals first: byte stores may alias any field the compiler would otherwise
 * reload after each one. */
static int emit_entries(walk *w, size_t until) {
    const int64_t *pos = w->pos;
    size_t pi = w->pi, end = pi, np = w->np, e0 = w->e0;
    while (end < np && (size_t)pos[end] < until) end++;
    if (end == pi) return 0;
    if (em_reserve(&w->em, end - pi) < 0) return -1;
    emitter em = w->em;
    uint8_t *old = w->old;
    const uint8_t *oc = w->oc, *nc = w->nc;
    int rc = 0;
    for (; pi < end; pi++) {
        size_t j = (size_t)pos[pi] - e0;
        uint8_t ov = old[j], nv = nc[pi];
        if (ov != oc[pi]) {
            w->out_of_step = 1;
            rc = -1;
            break;
        }
        em_put(&em, j, ov, nv);
        old[j] = nv;
    }
    w->em = em;
    w->pi = pi;
    return rc;
}

/* Requantize elements [p0, p1) of dirty block b with its new scale; entries there are skipped. */
static int emit_dirty(walk *w, int fmt, size_t b, size_t p0, size_t p1) {
    int finite;
    float mult = block_mult(fmt, w->scales, b, &finite);
    if (em_reserve(&w->em, p1 - p0) < 0) return -1;
    for (size_t p = p0; p < p1; p++) {
        uint8_t nv;
        if (fmt == FMT_MX)
            nv = finite ? e4m3_finite(u32(BF16_F32(w->src[p]) * mult)) : (uint8_t)E4M3_NAN;
        else
            nv = finite ? e4m3_finite(u32(BF16_F32(w->src[p]) * mult)) : e4m3(u32(BF16_F32(w->src[p]) * mult));
        uint8_t ov = w->old[p - w->e0];
        if (ov != nv) {
            em_put(&w->em, p - w->e0, ov, nv);
            w->old[p - w->e0] = nv;
        }
    }
    while (w->pi < w->np && (size_t)w->pos[w->pi] < p1) w->pi++;
    return 0;
}

/* fp8-block128: rows [ra, rz) of the chunk (whole block rows but at the chunk's and the range's
 * edges). */
static int walk_fp8(walk *w, size_t ra, size_t rz) {
    size_t cols = w->cols, nbc = (cols + QB - 1) / QB;
    for (size_t br = ra / QB; br * QB < rz; br++) {
        size_t a = br * QB > ra ? br * QB : ra, z = br * QB + QB < rz ? br * QB + QB : rz;
        if (memchr(w->dirty + br * nbc, 1, nbc) == NULL) {
            if (emit_entries(w, z * cols) < 0) return -1;
            continue;
        }
        for (size_t r = a; r < z; r++)
            for (size_t j = 0; j < nbc; j++) {
                size_t b = br * nbc + j, c1 = (j + 1) * QB < cols ? (j + 1) * QB : cols;
                if (!w->dirty[b]) {
                    if (emit_entries(w, r * cols + c1) < 0) return -1;
                } else if (emit_dirty(w, FMT_FP8, b, r * cols + j * QB, r * cols + c1) < 0) {
                    return -1;
                }
            }
    }
    return 0;
}

/* mxfp8: elements [a, z) of the chunk (whole rows). */
static int walk_mx(walk *w, size_t a, size_t z) {
    size_t b = a / MXB, b_end = z / MXB;
    for (;;) {
        const uint8_t *d = b < b_end ? (const uint8_t *)memchr(w->dirty + b, 1, b_end - b) : NULL;
        if (d == NULL) return emit_entries(w, z);
        b = (size_t)(d - w->dirty);
        if (emit_entries(w, b * MXB) < 0 || emit_dirty(w, FMT_MX, b, b * MXB, b * MXB + MXB) < 0) return -1;
        b++;
    }
}

/* Bytes of the chunk walked, then hashed, at a time. While a slice is hashed (HASH_PIECE bytes at a
 * time), the next slice is prefetched piece by piece into L2, so that the changes' scattered
 * reads and writes of `old` in the next walk hit lines already there: one stream over the chunk,
 * not a miss per change followed by a second pass to hash. (A burst of a whole slice's prefetches
 * stalled on the line fill buffers.) */
#define SLICE_BYTES (16 * 1024)
#define HASH_PIECE (4 * 1024)

/* The walk of the whole chunk, sliced by rows, with its digest (`digest` as encode_add's). */
static int walk_chunk(walk *w, int fmt, int digest, XXH3_state_t *st, int *hashed) {
    size_t cols = w->cols, r0 = w->e0 / cols, r1 = w->e1 / cols, total = (r1 - r0) * cols;
    size_t step = SLICE_BYTES / cols ? SLICE_BYTES / cols : 1; /* rows */
    *hashed = 0;
    if (digest == DIGEST_ALWAYS) {
        XXH3_128bits_reset(st);
        *hashed = 1;
    }
    for (size_t r = r0; r < r1; r += step) {
        size_t rn = r1 - r > step ? r + step : r1;
        size_t at = (r - r0) * cols, len = (rn - r) * cols;
        size_t before = w->em.k;
        if ((fmt == FMT_FP8 ? walk_fp8(w, r, rn) : walk_mx(w, r * cols, rn * cols)) < 0) return -1;
        if (!*hashed && digest == DIGEST_IF_CHANGED && w->em.k != before) {
            XXH3_128bits_reset(st); /* the first change: catch up on the slices before it */
            if (at) DS_XXH3_128_UPDATE(st, w->old, at);
            *hashed = 1;
        }
        for (size_t o = 0; o < len; o += HASH_PIECE) {
            size_t n = len - o > HASH_PIECE ? HASH_PIECE : len - o;
#if defined(__GNUC__) || defined(__clang__)
            for (size_t f = at + len + o; f < at + len + o + n && f < total; f += 64)
                __builtin_prefetch(w->old + f, 1, 1);
#endif
            if (*hashed) DS_XXH3_128_UPDATE(st, w->old + at + o, n);
        }
    }
    return 0;
}

/* The walk of chunk [w->e0, w->e1) and its digest (`digest` as encode_add's), into *h when
 * *hashed; `st` a state to hash with. Runs without the GIL. 0, or -1: no memory, or an entry out
 * of step (w->out_of_step). */
static int walk_digest(walk *w, int fmt, int digest, XXH3_state_t *st, XXH128_hash_t *h, int *hashed) {
    *hashed = 0;
    if (w->e1 == w->e0) {
        if (digest == DIGEST_ALWAYS) {
            *h = DS_XXH3_128(w->old, 0);
            *hashed = 1;
        }
        return 0;
    }
    int rc = walk_chunk(w, fmt, digest, st, hashed);
    if (rc == 0 && *hashed) *h = XXH3_128bits_digest(st);
    return rc;
}

/* requant_delta's result for a walk that returned `rc` (NULL with the error set when it failed),
 * led by `lead` when `led` (requant_chunk's). Frees the walk's emitter. */
static PyObject *walk_result(walk *w, int rc, int hashed, XXH128_hash_t h, int led, size_t lead) {
    PyObject *result = NULL;
    if (rc < 0 && w->out_of_step) {
        PyErr_SetString(PyExc_ValueError, "requant: an old code differs from the reference's: the reference is not "
                                          "the state the changes start from");
    } else if (rc < 0) {
        PyErr_NoMemory();
    } else {
        emitter *e = &w->em;
        PyObject *hex = hashed ? ds_hex128(h.high64, h.low64) : Py_NewRef(Py_None);
#define BYTES(p) ((p) != NULL ? (const char *)(p) : "") /* y# of NULL would be None */
        if (hex != NULL) {
            PyObject *planes = Py_BuildValue("(ny#y#ky#y#N)", (Py_ssize_t)e->k, BYTES(e->syms), (Py_ssize_t)e->k,
                                             BYTES(e->rest), (Py_ssize_t)(4 * e->n_rest), (unsigned long)e->max_rest,
                                             BYTES(e->codes), (Py_ssize_t)((e->k + 1) / 2), BYTES(e->esc),
                                             (Py_ssize_t)e->n_esc, hex);
            if (!led || planes == NULL) {
                result = planes;
            } else { /* (lead, *planes) */
                Py_ssize_t k = PyTuple_GET_SIZE(planes);
                result = PyTuple_New(k + 1);
                PyObject *n = result != NULL ? PyLong_FromSize_t(lead) : NULL;
                if (n == NULL) {
                    Py_CLEAR(result);
                } else {
                    PyTuple_SET_ITEM(result, 0, n);
                    for (Py_ssize_t i = 0; i < k; i++) PyTuple_SET_ITEM(result, i + 1, Py_NewRef(PyTuple_GET_ITEM(planes, i)));
                }
                Py_DECREF(planes);
            }
        }
#undef BYTES
    }
    em_free(&w->em);
    return result;
}

/* The walk of chunk [e0, e1) of a [., cols] tensor whose new bfloat16 bits are `src`: the changed
 * codes outside dirty blocks (pos/oc/nc, np entries), the dirty blocks and the new scales, and
 * the chunk's reference codes `old`, advanced in place. */
static walk walk_of(const uint16_t *src, size_t cols, size_t e0, size_t e1, const int64_t *pos, size_t np,
                    const uint8_t *oc, const uint8_t *nc, const uint8_t *dirty, const void *scales, uint8_t *old) {
    walk w = {.src = src, .cols = cols, .e0 = e0, .e1 = e1, .pos = pos, .oc = oc, .nc = nc, .dirty = dirty,
              .np = np, .scales = scales, .old = old}; /* the emitter, pi and out_of_step zeroed */
    return w;
}

PyDoc_STRVAR(requant_delta_doc,
"requant_delta(fmt, src, rows, cols, r0, r1, positions, old_codes, new_codes, dirty, scales,\n"
"    old, digest) -> (n_changed, gap_symbols, gap_rests, max_rest, value_codes,\n"
"    value_escapes, digest)\n\n"
"The second step, per chunk of rows [r0, r1) of the quantized tensor: requant_classify's changed\n"
"codes within the chunk (`positions`, `old_codes`, `new_codes`), and every element of its dirty\n"
"blocks requantized from `src` with the new `scales`, compared with `old` (the chunk's reference\n"
"codes, advanced in place): what encode_add(old, new, 1, True, digest) returns for the chunk's\n"
"new codes. ValueError when an old code is not the reference's (the reference is not the state\n"
"the changes start from). Releases the GIL. On an error `old` may be partly advanced.");

static PyObject *py_requant_delta(PyObject *self, PyObject *args) {
    (void)self;
    int fmt, digest;
    Py_ssize_t rows, cols, r0, r1;
    PyObject *o[8]; /* src, positions, old_codes, new_codes, dirty, scales, old */
    if (!PyArg_ParseTuple(args, "iOnnnnOOOOOOi:requant_delta", &fmt, &o[0], &rows, &cols, &r0, &r1, &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6], &digest))
        return NULL;
    Py_ssize_t nb = n_blocks(fmt, rows, cols);
    if (nb < 0) return NULL;
    if (digest < DIGEST_NONE || digest > DIGEST_ALWAYS || r0 < 0 || r1 < r0 || r1 > rows) {
        PyErr_SetString(PyExc_ValueError, "requant_delta: digest must be 0, 1 or 2, and 0 <= r0 <= r1 <= rows");
        return NULL;
    }
    static const char *const names[7] = {"src", "positions", "old_codes", "new_codes", "dirty", "scales", "old"};
    Py_buffer bf[7];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 7; held++)
        if (ds_get_buffer(o[held], &bf[held], held == 6, names[held]) < 0) goto out;
    {
        Py_ssize_t sw = fmt == FMT_MX ? 1 : 4, e0 = r0 * cols, e1 = r1 * cols, np = bf[1].len / 8;
        const int64_t *pos = (const int64_t *)bf[1].buf;
        int ok = bf[0].len == 2 * rows * cols && bf[1].len % 8 == 0 && bf[2].len == np && bf[3].len == np &&
                 bf[4].len == nb && bf[5].len == nb * sw && bf[6].len == e1 - e0 && (uint64_t)(e1 - e0) <= 0xFFFFFFFFull;
        for (Py_ssize_t i = 0; ok && i < np; i++) ok = pos[i] >= e0 && pos[i] < e1 && (i == 0 || pos[i] > pos[i - 1]);
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "requant_delta: buffers do not fit the tensor and chunk, or positions "
                                              "are not increasing within the chunk");
            goto out;
        }
        walk w = walk_of((const uint16_t *)bf[0].buf, (size_t)cols, (size_t)e0, (size_t)e1, pos, (size_t)np,
                         (const uint8_t *)bf[2].buf, (const uint8_t *)bf[3].buf, (const uint8_t *)bf[4].buf, bf[5].buf,
                         (uint8_t *)bf[6].buf);
        int rc = -1, hashed = 0;
        XXH128_hash_t h = {0, 0};
        XXH3_state_t *st = XXH3_createState();
        Py_BEGIN_ALLOW_THREADS
        if (st != NULL) rc = walk_digest(&w, fmt, digest, st, &h, &hashed);
        Py_END_ALLOW_THREADS
        XXH3_freeState(st);
        result = walk_result(&w, rc, hashed, h, 0, 0);
    }
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&bf[i]);
    return result;
}

PyDoc_STRVAR(requant_chunk_doc,
"requant_chunk(fmt, rows, cols, start, positions, old_values, new_values, src, scales, amax,\n"
"    dirty, old, digest) -> (n_dirty, n_changed, gap_symbols, gap_rests, max_rest, value_codes,\n"
"    value_escapes, digest)\n\n"
"The three steps in one, for a chunk that holds whole blocks: elements [start, start + len(old))\n"
"of the [rows, cols] tensor, whole rows, and for fmt 0 (fp8-block128) whole block rows (start\n"
"and the end on multiples of 128 rows, or the end at the tensor's end). Its change list\n"
"(positions in the chunk, old and new bfloat16 bits, as for requant_classify) classified,\n"
"the chunk's dirty blocks rescaled from `src` (the tensor's new bits) into `scales` and `amax`\n"
"(in place; dirty[b] of the chunk's blocks set to 1 for a dirty block, 0 otherwise), and the\n"
"chunk walked: requant_delta's result for it, led by the number of dirty blocks. No other\n"
"chunk's blocks are read or written, so the chunks of a tensor may run on several threads at\n"
"once. ValueError for buffers that do not fit, a chunk that does not hold whole blocks, an\n"
"inconsistent change list, or an old code that is not the reference's. Releases the GIL. On an\n"
"error `old`, `scales`, `amax` and `dirty` may be partly updated.");

static PyObject *py_requant_chunk(PyObject *self, PyObject *args) {
    (void)self;
    int fmt, digest;
    Py_ssize_t rows, cols, start;
    PyObject *o[8];
    if (!PyArg_ParseTuple(args, "innnOOOOOOOOi:requant_chunk", &fmt, &rows, &cols, &start, &o[0], &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6], &o[7], &digest))
        return NULL;
    Py_ssize_t nb = n_blocks(fmt, rows, cols);
    if (nb < 0) return NULL;
    if (digest < DIGEST_NONE || digest > DIGEST_ALWAYS) {
        PyErr_SetString(PyExc_ValueError, "requant_chunk: digest must be 0, 1 or 2");
        return NULL;
    }
    static const char *const names[8] = {"positions", "old_values", "new_values", "src",
                                         "scales",    "amax",       "dirty",      "old"};
    Py_buffer bf[8];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 8; held++)
        if (ds_get_buffer(o[held], &bf[held], held >= 4, names[held]) < 0) goto out;
    {
        Py_ssize_t n_elems = rows * cols, sw = fmt == FMT_MX ? 1 : 4, n = bf[0].len / 4, len = bf[7].len;
        Py_ssize_t e1 = start + len, r0 = cols ? start / cols : 0, r1 = cols ? e1 / cols : 0;
        int whole = start >= 0 && e1 <= n_elems && cols > 0 && start % cols == 0 && e1 % cols == 0 &&
                    (uint64_t)len <= 0xFFFFFFFFull &&
                    (fmt == FMT_MX || (r0 % QB == 0 && (r1 % QB == 0 || r1 == rows)));
        if (bf[3].len != 2 * n_elems || bf[4].len != nb * sw || bf[5].len != 2 * nb || bf[6].len != nb || !whole) {
            PyErr_SetString(PyExc_ValueError, "requant_chunk: src, scales, amax, dirty or old does not fit the "
                                              "tensor, or the chunk does not hold whole blocks");
            goto out;
        }
        const uint32_t *ps = (const uint32_t *)bf[0].buf;
        if (!change_list_ok(&bf[0], &bf[1], &bf[2], (size_t)len)) {
            PyErr_SetString(PyExc_ValueError, "requant_chunk: the chunk's change list is inconsistent");
            goto out;
        }
        size_t nbc = fmt == FMT_MX ? 0 : (size_t)((cols + QB - 1) / QB);
        /* the chunk's blocks: [b0, b1) */
        size_t b0 = fmt == FMT_MX ? (size_t)start / MXB : (size_t)(r0 / QB) * nbc;
        size_t b1 = fmt == FMT_MX ? (size_t)e1 / MXB : (size_t)((r1 + QB - 1) / QB) * nbc;
        uint8_t *cmax = NULL;
        float *mults = fmt == FMT_FP8 ? block_tables_alloc(nb, &cmax) : NULL;
        batch *t = (batch *)malloc(sizeof(batch));
        XXH3_state_t *st = XXH3_createState();
        dsbuf pos = {0}, oc = {0}, nc = {0};
        uint8_t *dirty = (uint8_t *)bf[6].buf;
        int rc = (fmt == FMT_FP8 && mults == NULL) || t == NULL || st == NULL ? -1 : 0, hashed = 0;
        size_t n_dirty = 0;
        XXH128_hash_t h = {0, 0};
        walk w = walk_of((const uint16_t *)bf[3].buf, (size_t)cols, (size_t)start, (size_t)e1, NULL, 0, NULL, NULL,
                         dirty, bf[4].buf, (uint8_t *)bf[7].buf);
        Py_BEGIN_ALLOW_THREADS
        if (rc == 0) {
            if (mults) block_tables((const float *)bf[4].buf, (const uint16_t *)bf[5].buf, mults, cmax, b0, b1);
            memset(dirty + b0, 0, b1 - b0);
            rc = classify_chunk(fmt, ps, (const uint16_t *)bf[1].buf, (const uint16_t *)bf[2].buf, (size_t)n,
                                (size_t)start, (size_t)cols, nbc, bf[4].buf, mults, cmax, (const uint16_t *)bf[5].buf,
                                dirty, &pos, &oc, &nc, t);
        }
        if (rc == 0) {
            for (const uint8_t *d = dirty + b0, *end = dirty + b1; (d = (const uint8_t *)memchr(d, 1, (size_t)(end - d)));
                 d++) {
                rescale_block(fmt, w.src, (size_t)rows, (size_t)cols, nbc, (size_t)(d - dirty), bf[4].buf,
                              (uint16_t *)bf[5].buf);
                n_dirty++;
            }
            w.pos = (const int64_t *)pos.p;
            w.np = pos.len / 8;
            w.oc = oc.p;
            w.nc = nc.p;
            rc = walk_digest(&w, fmt, digest, st, &h, &hashed);
        }
        Py_END_ALLOW_THREADS
        free(mults);
        free(t);
        XXH3_freeState(st);
        result = walk_result(&w, rc, hashed, h, 1, n_dirty);
        free(pos.p);
        free(oc.p);
        free(nc.p);
    }
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&bf[i]);
    return result;
}

PyMethodDef ds_requant_methods[] = {
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
    {"requant_classify", py_requant_classify, METH_VARARGS, requant_classify_doc},
    {"requant_rescale", py_requant_rescale, METH_VARARGS, requant_rescale_doc},
    {"requant_delta", py_requant_delta, METH_VARARGS, requant_delta_doc},
    {"requant_chunk", py_requant_chunk, METH_VARARGS, requant_chunk_doc},
#endif
    {NULL, NULL, 0, NULL},
};
