/* Encode kernels: the add-sparse/1 delta in one pass (and the change list the serving streams
 * derive from, which scatter_changes applies to a copy of the reference), and XXH3-128 state
 * digests. Output bytes equal the numpy path's exactly
 * (deltastore/codec/delta.py, full.py); tests/codec/test_native.py proves it. */
#include "ds_native.h"

#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
/* x86-64 with gcc/clang: AVX2 and AVX-512BW variants of the scan, compiled with target
 * attributes (the rest of the extension stays baseline SSE2) and chosen at run time. */
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(DS_NO_DISPATCH)
#define DS_SCAN_DISPATCH 1
#include <immintrin.h>
#endif

#include "ds_xxh3.h"

/* Bytes of `new` scanned, then hashed, at a time: small enough to stay in L1/L2 between the
 * two, large enough that XXH3's per-update overhead is negligible. */
#define HASH_BLOCK (16 * 1024)

/* Elements compared at once into a bit mask (one bit per element, SSE2 where available); the
 * changed elements are then visited by counting trailing zeros, never one element at a time. */
#define SCAN_BLOCK 64

/* Bytes ahead of the compared block that the scan prefetches in both streams, into L2: the
 * hardware prefetchers alone left the loads waiting whenever a block had changes to emit (the
 * emit work and the memory stream did not overlap). A few KiB into L2 beat a short prefetch into
 * L1 and a non-temporal one (docs/design/006-native-kernels.md). A prefetch never faults. */
#define SCAN_PREFETCH 4096
/* __builtin_prefetch's locality: 1 is prefetcht2 (L2 and outward on current x86 cores) */
#define SCAN_PREFETCH_LOCALITY 1

/* Prefetch the lines SCAN_PREFETCH bytes past those of a block of `bytes` at `p` (the address
 * is formed as an integer: it may lie past the end of the buffer). */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_AHEAD(p, bytes)                                                              \
    do {                                                                                      \
        for (size_t pf_ = 0; pf_ < (size_t)(bytes); pf_ += 64)                                \
            __builtin_prefetch((const void *)((uintptr_t)(p) + SCAN_PREFETCH + pf_), 0, SCAN_PREFETCH_LOCALITY);    \
    } while (0)
#else
#define PREFETCH_AHEAD(p, bytes) ((void)0)
#endif

#include "ds_buf.h"

/* --- add-sparse/1 in one pass ----------------------------------------------------------- */

typedef struct {
    dsbuf syms;  /* one gap symbol per change */
    dsbuf rest;  /* u32 gap - DS_GAP_ESCAPE per escaped gap */
    dsbuf codes; /* paired 4-bit value codes, low nibble first */
    dsbuf esc;   /* zigzag values >= DS_NIBBLE_ESCAPE, full width */
    dsbuf cb;    /* scratch of the vector scan: one code byte per change of a range, then paired */
    dsbuf vals;  /* with want_vals: each change's new value, full width, */
    dsbuf olds;  /* its old value, */
    dsbuf poss;  /* and its position (u32) */
    int want_vals;
    size_t k;    /* changes so far */
    size_t next; /* position after the last change */
    uint32_t max_rest;
} enc_out;

static void enc_free(enc_out *s) {
    free(s->syms.p);
    free(s->rest.p);
    free(s->codes.p);
    free(s->esc.p);
    free(s->cb.p);
    free(s->vals.p);
    free(s->olds.p);
    free(s->poss.p);
}

static inline unsigned ctz64(uint64_t x) { /* x != 0 */
#if defined(__GNUC__) || defined(__clang__)
    return (unsigned)__builtin_ctzll(x);
#else
    unsigned n = 0;
    while (!(x & 1)) {
        x >>= 1;
        n++;
    }
    return n;
#endif
}

/* Bit j set: element j of the two blocks of 64 elements differs. SSE2 compares 16 bytes at a
 * time and packs the lane results to one bit per element; elsewhere a branch-free scalar loop. */
#define SCALAR_MASK(T, W)                                                                 \
    static inline uint64_t elem_mask_scalar_##W(const uint8_t *a, const uint8_t *b) {    \
        uint64_t m = 0;                                                                   \
        for (int j = 0; j < 64; j++) {                                                    \
            T x, y;                                                                       \
            memcpy(&x, a + j * W, W);                                                     \
            memcpy(&y, b + j * W, W);                                                     \
            m |= (uint64_t)(x != y) << j;                                                 \
        }                                                                                 \
        return m;                                                                         \
    }
SCALAR_MASK(uint8_t, 1)
SCALAR_MASK(uint16_t, 2)
SCALAR_MASK(uint32_t, 4)
SCALAR_MASK(uint64_t, 8)

#ifdef __SSE2__
static inline __m128i ld(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

static inline uint64_t elem_mask_1(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int q = 0; q < 4; q++)
        eq |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(ld(a + 16 * q), ld(b + 16 * q))) << (16 * q);
    return ~eq;
}

static inline uint64_t elem_mask_2(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int q = 0; q < 4; q++) { /* 16 elements: two 8-lane compares packed to 16 bytes */
        __m128i e0 = _mm_cmpeq_epi16(ld(a + 32 * q), ld(b + 32 * q));
        __m128i e1 = _mm_cmpeq_epi16(ld(a + 32 * q + 16), ld(b + 32 * q + 16));
        eq |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_packs_epi16(e0, e1)) << (16 * q);
    }
    return ~eq;
}

static inline uint64_t elem_mask_4(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int q = 0; q < 4; q++) { /* 16 elements: four 4-lane compares packed twice */
        const uint8_t *x = a + 64 * q, *y = b + 64 * q;
        __m128i e0 = _mm_cmpeq_epi32(ld(x), ld(y)), e1 = _mm_cmpeq_epi32(ld(x + 16), ld(y + 16));
        __m128i e2 = _mm_cmpeq_epi32(ld(x + 32), ld(y + 32)), e3 = _mm_cmpeq_epi32(ld(x + 48), ld(y + 48));
        __m128i p = _mm_packs_epi16(_mm_packs_epi32(e0, e1), _mm_packs_epi32(e2, e3));
        eq |= (uint64_t)(uint16_t)_mm_movemask_epi8(p) << (16 * q);
    }
    return ~eq;
}
#else
#define elem_mask_1 elem_mask_scalar_1
#define elem_mask_2 elem_mask_scalar_2
#define elem_mask_4 elem_mask_scalar_4
#endif
#define elem_mask_8 elem_mask_scalar_8 /* SSE2 has no 64-bit compare; 8-byte elements are rare */

#ifdef DS_SCAN_DISPATCH
#define DS_AVX2 __attribute__((target("avx2,bmi,bmi2")))
#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx2,bmi,bmi2")))

static inline DS_AVX2 __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* AVX2: 32 bytes per compare; the 16- and 32-bit lane results are packed to bytes (packs
 * interleaves the two 128-bit lanes, the permute restores element order) before movemask. */
static inline DS_AVX2 uint64_t elem_mask_1_avx2(const uint8_t *a, const uint8_t *b) {
    uint64_t lo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(ld32(a), ld32(b)));
    uint64_t hi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(ld32(a + 32), ld32(b + 32)));
    return ~(lo | hi << 32);
}

static inline DS_AVX2 uint64_t elem_mask_2_avx2(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int q = 0; q < 2; q++) { /* 32 elements: two 16-lane compares packed to 32 bytes */
        __m256i e0 = _mm256_cmpeq_epi16(ld32(a + 64 * q), ld32(b + 64 * q));
        __m256i e1 = _mm256_cmpeq_epi16(ld32(a + 64 * q + 32), ld32(b + 64 * q + 32));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8);
        eq |= (uint64_t)(uint32_t)_mm256_movemask_epi8(p) << (32 * q);
    }
    return ~eq;
}

static inline DS_AVX2 uint64_t elem_mask_4_avx2(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int q = 0; q < 8; q++) /* 8 elements: one bit each from the float-lane sign mask */
        eq |= (uint64_t)(uint8_t)_mm256_movemask_ps(
                  _mm256_castsi256_ps(_mm256_cmpeq_epi32(ld32(a + 32 * q), ld32(b + 32 * q))))
              << (8 * q);
    return ~eq;
}

static inline DS_AVX2 uint64_t elem_mask_8_avx2(const uint8_t *a, const uint8_t *b) {
    uint64_t eq = 0;
    for (int q = 0; q < 16; q++)
        eq |= (uint64_t)(uint8_t)_mm256_movemask_pd(
                  _mm256_castsi256_pd(_mm256_cmpeq_epi64(ld32(a + 32 * q), ld32(b + 32 * q))))
              << (4 * q);
    return ~eq;
}

/* AVX-512BW: the compares write mask registers directly, one bit per element. */
static inline DS_AVX512 __m512i ld64(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }

static inline DS_AVX512 uint64_t elem_mask_1_avx512(const uint8_t *a, const uint8_t *b) {
    return (uint64_t)_mm512_cmpneq_epi8_mask(ld64(a), ld64(b));
}

static inline DS_AVX512 uint64_t elem_mask_2_avx512(const uint8_t *a, const uint8_t *b) {
    return (uint64_t)_mm512_cmpneq_epi16_mask(ld64(a), ld64(b)) |
           (uint64_t)_mm512_cmpneq_epi16_mask(ld64(a + 64), ld64(b + 64)) << 32;
}

static inline DS_AVX512 uint64_t elem_mask_4_avx512(const uint8_t *a, const uint8_t *b) {
    uint64_t m = 0;
    for (int q = 0; q < 4; q++) m |= (uint64_t)_mm512_cmpneq_epi32_mask(ld64(a + 64 * q), ld64(b + 64 * q)) << (16 * q);
    return m;
}

static inline DS_AVX512 uint64_t elem_mask_8_avx512(const uint8_t *a, const uint8_t *b) {
    uint64_t m = 0;
    for (int q = 0; q < 8; q++) m |= (uint64_t)_mm512_cmpneq_epi64_mask(ld64(a + 64 * q), ld64(b + 64 * q)) << (8 * q);
    return m;
}
#endif

/* One change at element j (the scan's locals), branch-free: the gap symbol (the u32 remainder
 * is always stored and kept only when the gap escapes), the 4-bit zigzag value code (likewise
 * its full-width escape), the nibble pairing through a register (`pend`), and the reference
 * advance. Branches here mispredict: the escapes are data-dependent and k's parity alternates
 * with a varying number of changes per block. */
#define EMIT(T, W, j)                                                                           \
    do {                                                                                        \
        T ov, nv;                                                                               \
        memcpy(&ov, ob + (j) * W, W);                                                           \
        memcpy(&nv, nb + (j) * W, W);                                                           \
        size_t gap = (j) - next;                                                                \
        next = (j) + 1;                                                                         \
        int eg = gap >= DS_GAP_ESCAPE;                                                          \
        uint32_t rr = (uint32_t)(gap - DS_GAP_ESCAPE); /* kept only when eg */                  \
        memcpy(rest + rest_len, &rr, 4);                                                        \
        rest_len += 4 * (size_t)eg;                                                             \
        max_rest = eg && rr > max_rest ? rr : max_rest;                                         \
        syms[k] = eg ? (uint8_t)DS_GAP_ESCAPE : (uint8_t)gap;                                   \
        T d = (T)(nv - ov);                                                                     \
        T zz = (T)((T)(d << 1) ^ (T)(0 - (T)(d >> (8 * W - 1))));                               \
        int ev = zz >= DS_NIBBLE_ESCAPE;                                                        \
        memcpy(esc + esc_len, &zz, W); /* kept only when ev */                                  \
        esc_len += W * (size_t)ev;                                                              \
        uint8_t code = ev ? (uint8_t)DS_NIBBLE_ESCAPE : (uint8_t)zz;                            \
        uint8_t v = (k & 1) ? (uint8_t)(pend | (code << 4)) : code;                             \
        codes[k >> 1] = v;                                                                      \
        pend = v;                                                                               \
        k++;                                                                                    \
        if (want_vals) {                                                                        \
            uint32_t pj_ = (uint32_t)(j);                                                       \
            memcpy(vals + (k - 1) * W, &nv, W);                                                 \
            memcpy(olds + (k - 1) * W, &ov, W);                                                 \
            memcpy(poss + 4 * (k - 1), &pj_, 4);                                                \
        }                                                                                       \
        if (adv) memcpy(ob + (j) * W, &nv, W);                                                  \
    } while (0)

/* Scan elements [lo, hi): emit every change, advance `ob` if asked. -1: out of memory.
 * Per 64-element block: compare into a bit mask (MASK: SSE2, AVX2 or AVX-512BW), visit the set
 * bits by counting trailing zeros and EMIT each change branch-free. The worst case of the whole
 * range (every element changed, every gap and value escaped, plus the unconditional stores'
 * slack) is reserved once up front, not per block: the caller passes ranges of HASH_BLOCK
 * bytes, so that is a few tens of KiB. Buffers live in locals (stores through uint8_t pointers
 * would otherwise make the compiler reload every field of `s` after each one).
 * NAME/MASK/ATTR: one variant per instruction set, identical output. (Flattening a region's
 * masks to a position list first, to pay the loop's mispredicted exit per region instead of
 * per block, measured slower.) */
#define DEFINE_SCAN(T, W, NAME, MASK, ATTR)                                                          \
    static ATTR int NAME(uint8_t *ob, const uint8_t *nb, size_t lo, size_t hi, int adv, enc_out *s) { \
        size_t k = s->k, next = s->next;                                                             \
        uint32_t max_rest = s->max_rest;                                                             \
        size_t m = hi > lo ? hi - lo : 0;                                                            \
        const int want_vals = s->want_vals;                                                          \
        if (reserve(&s->syms, m) || reserve(&s->codes, m / 2 + 1) || reserve(&s->rest, 4 * m + 4) ||  \
            reserve(&s->esc, W * m + W) ||                                                           \
            (want_vals && (reserve(&s->vals, W * (k + m) - s->vals.len) ||                            \
                           reserve(&s->olds, W * (k + m) - s->olds.len) ||                            \
                           reserve(&s->poss, 4 * (k + m) - s->poss.len))))                            \
            return -1;                                                                               \
        uint8_t *syms = s->syms.p, *codes = s->codes.p, *rest = s->rest.p, *esc = s->esc.p;          \
        uint8_t *vals = s->vals.p, *olds = s->olds.p, *poss = s->poss.p;                             \
        size_t rest_len = s->rest.len, esc_len = s->esc.len;                                         \
        /* the low nibble already written when an odd number of codes is */                          \
        uint8_t pend = (k & 1) ? codes[k >> 1] : 0;                                                  \
        size_t i = lo;                                                                               \
        for (; i + SCAN_BLOCK <= hi; i += SCAN_BLOCK) {                                              \
            PREFETCH_AHEAD(ob + i * W, SCAN_BLOCK * W);                                              \
            PREFETCH_AHEAD(nb + i * W, SCAN_BLOCK * W);                                              \
            uint64_t mask = MASK(ob + i * W, nb + i * W);                                            \
            while (mask) {                                                                           \
                size_t j = i + ctz64(mask);                                                          \
                mask &= mask - 1;                                                                    \
                EMIT(T, W, j);                                                                       \
            }                                                                                        \
        }                                                                                            \
        for (size_t j = i; j < hi; j++) { /* the tail: under one block */                           \
            T x, y;                                                                                  \
            memcpy(&x, ob + j * W, W);                                                               \
            memcpy(&y, nb + j * W, W);                                                               \
            if (x != y) EMIT(T, W, j);                                                               \
        }                                                                                            \
        s->rest.len = rest_len;                                                                      \
        s->esc.len = esc_len;                                                                        \
        s->syms.len = k;                                                                             \
        s->codes.len = (k + 1) / 2;                                                                  \
        s->k = k;                                                                                    \
        s->next = next;                                                                              \
        s->max_rest = max_rest;                                                                      \
        if (want_vals) {                                                                             \
            s->vals.len = s->olds.len = W * k;                                                       \
            s->poss.len = 4 * k;                                                                     \
        }                                                                                            \
        return 0;                                                                                    \
    }

DEFINE_SCAN(uint8_t, 1, scan_1, elem_mask_1, )
DEFINE_SCAN(uint16_t, 2, scan_2, elem_mask_2, )
DEFINE_SCAN(uint32_t, 4, scan_4, elem_mask_4, )
DEFINE_SCAN(uint64_t, 8, scan_8, elem_mask_8, )

typedef int (*scan_fn)(uint8_t *, const uint8_t *, size_t, size_t, int, enc_out *);

/* The scan variants, by instruction set: index ISA_* below, then log2 of the width. */
enum { ISA_BASELINE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_VBMI2 = 3, N_ISA = 4 };
static const char *const isa_names[N_ISA] = {"baseline", "avx2", "avx512bw", "avx512vbmi2"};

#ifdef DS_SCAN_DISPATCH
DEFINE_SCAN(uint8_t, 1, scan_1_avx2, elem_mask_1_avx2, DS_AVX2)
DEFINE_SCAN(uint16_t, 2, scan_2_avx2, elem_mask_2_avx2, DS_AVX2)
DEFINE_SCAN(uint32_t, 4, scan_4_avx2, elem_mask_4_avx2, DS_AVX2)
DEFINE_SCAN(uint64_t, 8, scan_8_avx2, elem_mask_8_avx2, DS_AVX2)
DEFINE_SCAN(uint8_t, 1, scan_1_avx512, elem_mask_1_avx512, DS_AVX512)
DEFINE_SCAN(uint16_t, 2, scan_2_avx512, elem_mask_2_avx512, DS_AVX512)
DEFINE_SCAN(uint32_t, 4, scan_4_avx512, elem_mask_4_avx512, DS_AVX512)
DEFINE_SCAN(uint64_t, 8, scan_8_avx512, elem_mask_8_avx512, DS_AVX512)

#define DS_VBMI2 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2,avx2,bmi,bmi2,popcnt")))

/* Pair the code bytes cb[0..n) (each < 16) into nibbles, continuing at change k0: what EMIT
 * writes one change at a time (low nibble first; an odd last code alone in its byte). */
static inline void pair_code_bytes(uint8_t *codes, size_t k0, const uint8_t *cb, size_t n) {
    size_t t = 0;
    if ((k0 & 1) && n) { /* the low nibble of codes[k0 >> 1] is written already */
        codes[k0 >> 1] = (uint8_t)(codes[k0 >> 1] | (cb[0] << 4));
        t = 1;
    }
    uint8_t *dst = codes + ((k0 + t) >> 1);
    for (; t + 2 <= n; t += 2) *dst++ = (uint8_t)(cb[t] | (cb[t + 1] << 4));
    if (t < n) *dst = cb[t];
}

/* bf16/fp16 add-sparse with AVX-512 VBMI2: a block's changes emitted as vectors, not one at a
 * time. EMIT's loop costs a mispredicted exit per block with changes and ~15 instructions per
 * change; here each block of 64 elements with any change costs one fixed sequence: the
 * differences zigzagged for all 64 lanes, their 4-bit codes, escapes and in-block gaps
 * compressed to the changed lanes (vpcompressb/w) and stored whole (the buffers keep 64 bytes
 * of slack), the first gap of the block (the only one that can reach DS_GAP_ESCAPE) fixed up
 * by scalar code, the reference advanced by masked stores. Codes go to `cb` one byte per
 * change and are paired into nibbles once per range. Same bytes as scan_2 (tests/codec/test_native.py
 * runs every variant against the numpy path). */
static DS_VBMI2 int scan_2_vbmi2(uint8_t *ob, const uint8_t *nb, size_t lo, size_t hi, int adv, enc_out *s) {
    enum { W = 2 };
    size_t k = s->k, next = s->next;
    uint32_t max_rest = s->max_rest;
    size_t m = hi > lo ? hi - lo : 0;
    if (reserve(&s->syms, m + 64) || reserve(&s->codes, m / 2 + 1) || reserve(&s->rest, 4 * m + 4) ||
        reserve(&s->esc, W * m + 128) || reserve(&s->cb, m + 64) ||
        (s->want_vals && (reserve(&s->vals, W * (k + m) + 128 - s->vals.len) ||
                          reserve(&s->olds, W * (k + m) + 128 - s->olds.len) ||
                          reserve(&s->poss, 4 * (k + m) + 256 - s->poss.len))))
        return -1;
    uint8_t *syms = s->syms.p, *codes = s->codes.p, *rest = s->rest.p, *esc = s->esc.p, *cb = s->cb.p;
    size_t rest_len = s->rest.len, esc_len = s->esc.len;
    const size_t k0 = k;
    static const uint8_t lanes[64] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                      16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                                      32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                      48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
    static const uint8_t before[64] = {0,  0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14,
                                       15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                                       31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46,
                                       47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62};
    const __m512i iota = ld64(lanes), prev_idx = ld64(before);
    const __m512i one8 = _mm512_set1_epi8(1), esc16 = _mm512_set1_epi16(DS_NIBBLE_ESCAPE);
    size_t i = lo;
    for (; i + SCAN_BLOCK <= hi; i += SCAN_BLOCK) {
        const uint8_t *op = ob + i * W, *np = nb + i * W;
        PREFETCH_AHEAD(op, SCAN_BLOCK * W);
        PREFETCH_AHEAD(np, SCAN_BLOCK * W);
        __m512i o0 = ld64(op), o1 = ld64(op + 64), n0 = ld64(np), n1 = ld64(np + 64);
        __mmask32 m0 = _mm512_cmpneq_epi16_mask(o0, n0), m1 = _mm512_cmpneq_epi16_mask(o1, n1);
        uint64_t mask = (uint64_t)m0 | (uint64_t)m1 << 32;
        if (!mask) continue;
        size_t c = (size_t)__builtin_popcountll(mask);
        /* zigzag(new - old) in every lane; the code is min(zz, 15), the escape the whole zz */
        __m512i d0 = _mm512_sub_epi16(n0, o0), d1 = _mm512_sub_epi16(n1, o1);
        __m512i z0 = _mm512_xor_si512(_mm512_slli_epi16(d0, 1), _mm512_srai_epi16(d0, 15));
        __m512i z1 = _mm512_xor_si512(_mm512_slli_epi16(d1, 1), _mm512_srai_epi16(d1, 15));
        __m512i code = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_min_epu16(z0, esc16))),
                                          _mm512_cvtepi16_epi8(_mm512_min_epu16(z1, esc16)), 1);
        _mm512_storeu_si512((void *)(cb + (k - k0)), _mm512_maskz_compress_epi8(mask, code));
        __mmask32 e0 = _mm512_mask_cmpge_epu16_mask(m0, z0, esc16), e1 = _mm512_mask_cmpge_epu16_mask(m1, z1, esc16);
        if (e0 | e1) {
            _mm512_storeu_si512((void *)(esc + esc_len), _mm512_maskz_compress_epi16(e0, z0));
            esc_len += W * (size_t)__builtin_popcount(e0);
            _mm512_storeu_si512((void *)(esc + esc_len), _mm512_maskz_compress_epi16(e1, z1));
            esc_len += W * (size_t)__builtin_popcount(e1);
        }
        /* gaps inside the block: position minus the previous one minus 1 (all < 63) */
        __m512i pos = _mm512_maskz_compress_epi8(mask, iota);
        __m512i gaps = _mm512_sub_epi8(_mm512_sub_epi8(pos, _mm512_permutexvar_epi8(prev_idx, pos)), one8);
        _mm512_storeu_si512((void *)(syms + k), gaps);
        size_t gap = i + ctz64(mask) - next; /* the first change's gap, from the last block's */
        if (gap >= DS_GAP_ESCAPE) {
            uint32_t rr = (uint32_t)(gap - DS_GAP_ESCAPE);
            memcpy(rest + rest_len, &rr, 4);
            rest_len += 4;
            max_rest = rr > max_rest ? rr : max_rest;
            syms[k] = (uint8_t)DS_GAP_ESCAPE;
        } else {
            syms[k] = (uint8_t)gap;
        }
        next = i + 64 - (size_t)__builtin_clzll(mask);
        if (adv) {
            if (m0) _mm512_mask_storeu_epi16((void *)(ob + i * W), m0, n0);
            if (m1) _mm512_mask_storeu_epi16((void *)(ob + i * W + 64), m1, n1);
        }
        if (s->want_vals) { /* the changed lanes' new and old values, in order, picked from the two
                             * blocks by their positions (two-table permutes: cheaper than four
                             * compresses), and their positions; whole stores (the slack) */
            uint8_t *v = s->vals.p + k * W, *u = s->olds.p + k * W, *ps = s->poss.p + 4 * k;
            __m512i at = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(pos)); /* lanes 0..63 */
            _mm512_storeu_si512((void *)v, _mm512_permutex2var_epi16(n0, at, n1));
            _mm512_storeu_si512((void *)u, _mm512_permutex2var_epi16(o0, at, o1));
            if (c > 32) {
                at = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(pos, 1));
                _mm512_storeu_si512((void *)(v + 64), _mm512_permutex2var_epi16(n0, at, n1));
                _mm512_storeu_si512((void *)(u + 64), _mm512_permutex2var_epi16(o0, at, o1));
            }
            const __m512i base = _mm512_set1_epi32((int)i); /* lane index + block start, 16 at a time */
            _mm512_storeu_si512((void *)ps, _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(pos)), base));
            if (c > 16)
                _mm512_storeu_si512((void *)(ps + 64), _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(pos, 1)), base));
            if (c > 32)
                _mm512_storeu_si512((void *)(ps + 128), _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(pos, 2)), base));
            if (c > 48)
                _mm512_storeu_si512((void *)(ps + 192), _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(pos, 3)), base));
        }
        k += c;
    }
    pair_code_bytes(codes, k0, cb, k - k0);
    s->rest.len = rest_len;
    s->esc.len = esc_len;
    s->syms.len = k;
    s->codes.len = (k + 1) / 2;
    s->k = k;
    s->next = next;
    s->max_rest = max_rest;
    if (s->want_vals) {
        s->vals.len = s->olds.len = W * k;
        s->poss.len = 4 * k;
    }
    return i < hi ? scan_2(ob, nb, i, hi, adv, s) : 0; /* the tail, under one block: the scalar scan's */
}


static const scan_fn scan_table[N_ISA][4] = {
    {scan_1, scan_2, scan_4, scan_8},
    {scan_1_avx2, scan_2_avx2, scan_4_avx2, scan_8_avx2},
    {scan_1_avx512, scan_2_avx512, scan_4_avx512, scan_8_avx512},
    {scan_1_avx512, scan_2_vbmi2, scan_4_avx512, scan_8_avx512}, /* 2-byte elements vectorized */
};

/* What this CPU (and OS: __builtin_cpu_supports checks XSAVE state) can run. */
static int isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    case ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && isa_supported(ISA_AVX2);
    case ISA_VBMI2:
        return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vbmi2") &&
               __builtin_cpu_supports("popcnt") && isa_supported(ISA_AVX512);
    default: return 1;
    }
}
#else
static const scan_fn scan_table[N_ISA][4] = {{scan_1, scan_2, scan_4, scan_8}};
static int isa_supported(int isa) { return isa == ISA_BASELINE; }
#endif

/* The best supported variant. AVX-512BW first: its compares write one bit per element straight
 * to a mask register (see docs/design/006, "Scan variants", for the measured order). */
static int isa_auto(void) {
    for (int isa = N_ISA - 1; isa > ISA_BASELINE; isa--)
        if (isa_supported(isa)) return isa;
    return ISA_BASELINE;
}

/* The variant encode_add uses; -1 until first chosen (under the GIL: by scan_isa or the first
 * encode_add call). */
static int active_isa = -1;

static int current_isa(void) {
    if (active_isa < 0) active_isa = isa_auto();
    return active_isa;
}

static scan_fn scan_for(int isa, int w) {
    switch (w) {
    case 1: return scan_table[isa][0];
    case 2: return scan_table[isa][1];
    case 4: return scan_table[isa][2];
    default: return scan_table[isa][3];
    }
}

PyDoc_STRVAR(scan_isa_doc,
"scan_isa(name=None) -> str\n\n"
"The instruction set encode_add's scan uses ('baseline': SSE2 or scalar, 'avx2', 'avx512bw',\n"
"'avx512vbmi2'):\n"
"with `name`, switch to it first ('auto': the best this CPU supports; ValueError for one it\n"
"lacks or an unknown name). Every variant writes the same bytes; forcing one is for tests and\n"
"benchmarks. Process-wide; do not switch while another thread encodes.");

static PyObject *py_scan_isa(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z:scan_isa", &name)) return NULL;
    if (name != NULL) {
        int isa = -1;
        if (strcmp(name, "auto") == 0) {
            isa = isa_auto();
        } else {
            for (int i = 0; i < N_ISA; i++)
                if (strcmp(name, isa_names[i]) == 0) isa = i;
            if (isa < 0) {
                PyErr_Format(PyExc_ValueError, "unknown instruction set %R (baseline, avx2, avx512bw, avx512vbmi2, auto)", PyTuple_GET_ITEM(args, 0));
                return NULL;
            }
            if (!isa_supported(isa)) {
                PyErr_Format(PyExc_ValueError, "this CPU or build cannot run %s", isa_names[isa]);
                return NULL;
            }
        }
        active_isa = isa;
    }
    return PyUnicode_FromString(isa_names[current_isa()]);
}


/* Bytes of `new` hashed at a time between two slices of the next block's scan (below). */
#ifndef HASH_SLICE
#define HASH_SLICE (4 * 1024)
#endif

/* Runs without the GIL. With DIGEST_IF_CHANGED hashing starts at the first changed block,
 * catching up on the (unchanged) blocks before it.
 *
 * A block of `new` is hashed while the next block is scanned, a slice of each in turn, not
 * after its own scan: hashing a whole block from cache left the memory stream idle for as
 * long (the scan's prefetches run only a few KiB ahead), and the digest added ~0.17 of a
 * copy's time to a 2-thread publish scan. The bytes hashed, and their order, are the same. */
static int encode_add_pass(scan_fn scan, uint8_t *ob, const uint8_t *nb, size_t count, int w, int adv, int digest,
                           enc_out *s, XXH3_state_t *st, int *hashed) {
    const size_t step = HASH_BLOCK / (size_t)w, slice = HASH_SLICE / (size_t)w;
    size_t lag0 = 0, lag1 = 0; /* elements [lag0, lag1) of `new`: scanned, not yet hashed */
    *hashed = 0;
    if (digest == DIGEST_ALWAYS) {
        XXH3_128bits_reset(st);
        *hashed = 1;
    }
    for (size_t h0 = 0; h0 < count; h0 += step) {
        size_t h1 = count - h0 > step ? h0 + step : count;
        size_t before = s->k;
        if (lag0 < lag1) {
            for (size_t a = h0; a < h1; a += slice) {
                size_t b = h1 - a > slice ? a + slice : h1;
                if (scan(ob, nb, a, b, adv, s) < 0) return -1;
                if (lag0 < lag1) {
                    size_t e = lag1 - lag0 > slice ? lag0 + slice : lag1;
                    DS_XXH3_128_UPDATE(st, nb + lag0 * w, (e - lag0) * (size_t)w);
                    lag0 = e;
                }
            }
            if (lag0 < lag1) DS_XXH3_128_UPDATE(st, nb + lag0 * w, (lag1 - lag0) * (size_t)w);
        } else if (scan(ob, nb, h0, h1, adv, s) < 0) {
            return -1;
        }
        if (!*hashed && digest == DIGEST_IF_CHANGED && s->k != before) {
            XXH3_128bits_reset(st); /* the first change: catch up on the blocks before it */
            if (h0) DS_XXH3_128_UPDATE(st, nb, h0 * (size_t)w);
            *hashed = 1;
        }
        if (*hashed) {
            lag0 = h0;
            lag1 = h1;
        }
    }
    if (lag0 < lag1) DS_XXH3_128_UPDATE(st, nb + lag0 * w, (lag1 - lag0) * (size_t)w);
    return 0;
}

static int acquire_pair(PyObject *old_obj, PyObject *new_obj, int adv, Py_buffer *ob, Py_buffer *nb, int w) {
    if (ds_get_buffer(old_obj, ob, adv, "old") < 0) return -1;
    if (ds_get_buffer(new_obj, nb, 0, "new") < 0) {
        PyBuffer_Release(ob);
        return -1;
    }
    const char *err = NULL;
    if (ob->len != nb->len)
        err = "old and new differ in length";
    else if (ob->len % w)
        err = "buffer length is not a multiple of the element width";
    else if ((uint64_t)(ob->len / w) > 0xFFFFFFFFull)
        err = "more than 2**32 - 1 elements in one chunk";
    else if (adv && ob->buf != nb->buf && (const char *)ob->buf < (const char *)nb->buf + nb->len &&
             (const char *)nb->buf < (const char *)ob->buf + ob->len)
        err = "old and new overlap";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        PyBuffer_Release(ob);
        PyBuffer_Release(nb);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(encode_add_doc,
"encode_add(old, new, width, advance, digest, values=False) -> (n_changed, gap_symbols,\n"
"    gap_rests, max_rest, value_codes, value_escapes, digest[, positions, old_values,\n"
"    new_values])\n\n"
"One pass over two chunks of `width`-byte little-endian elements: the add-sparse/1 sections'\n"
"raw planes (gap symbols; u32 escaped gap remainders; paired 4-bit zigzag codes; escaped\n"
"zigzag values), `old` advanced to `new` at every change when `advance`, and the XXH3-128\n"
"hex digest of `new` (digest: 0 never, 1 if anything changed, 2 always; else None); with\n"
"`values`, also the change list: each changed element's position (u32), old and new value\n"
"(full width), in order, as read-only buffers (not copied into bytes).\n"
"Releases the GIL.\n"
"On MemoryError `old` may be partly advanced.");

static PyObject *py_encode_add(PyObject *self, PyObject *args) {
    PyObject *old_obj, *new_obj;
    long width;
    int adv, digest, values = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOlpi|p:encode_add", &old_obj, &new_obj, &width, &adv, &digest, &values))
        return NULL;
    if (digest < DIGEST_NONE || digest > DIGEST_ALWAYS) {
        PyErr_SetString(PyExc_ValueError, "digest must be 0, 1 or 2");
        return NULL;
    }
    int w = ds_check_width(width);
    if (w < 0) return NULL;
    Py_buffer ob, nb;
    if (acquire_pair(old_obj, new_obj, adv, &ob, &nb, w) < 0) return NULL;
    enc_out s;
    memset(&s, 0, sizeof s);
    s.want_vals = values;
    if (values) { /* reused memory, already faulted in (ds_pool_get) */
        s.vals.p = (uint8_t *)ds_pool_get(&s.vals.cap);
        s.olds.p = (uint8_t *)ds_pool_get(&s.olds.cap);
        s.poss.p = (uint8_t *)ds_pool_get(&s.poss.cap);
    }
    XXH3_state_t *st = XXH3_createState();
    int rc = -1, hashed = 0;
    scan_fn scan = scan_for(current_isa(), w);
    if (st != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = encode_add_pass(scan, (uint8_t *)ob.buf, (const uint8_t *)nb.buf, (size_t)(nb.len / w), w, adv, digest,
                             &s, st, &hashed);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    PyObject *result = NULL;
    if (rc < 0) {
        PyErr_NoMemory();
    } else {
        PyObject *digest;
        if (hashed) {
            XXH128_hash_t h = XXH3_128bits_digest(st);
            digest = ds_hex128(h.high64, h.low64);
        } else {
            digest = Py_NewRef(Py_None);
        }
        if (digest != NULL && values) { /* the change list is handed over, not copied */
            PyObject *poss = ds_buffer_take(s.poss.p, s.poss.len, s.poss.cap), *olds = NULL, *vals = NULL;
            olds = poss != NULL ? ds_buffer_take(s.olds.p, s.olds.len, s.olds.cap) : (free(s.olds.p), NULL);
            vals = olds != NULL ? ds_buffer_take(s.vals.p, s.vals.len, s.vals.cap) : (free(s.vals.p), NULL);
            s.poss.p = s.olds.p = s.vals.p = NULL;
            if (vals != NULL)
                result = Py_BuildValue("(nNNkNNNNNN)", (Py_ssize_t)s.k, buf_bytes(&s.syms), buf_bytes(&s.rest),
                                       (unsigned long)s.max_rest, buf_bytes(&s.codes), buf_bytes(&s.esc), digest,
                                       poss, olds, vals);
            else {
                Py_XDECREF(poss);
                Py_XDECREF(olds);
                Py_DECREF(digest);
            }
        }
        else if (digest != NULL)
            result = Py_BuildValue("(nNNkNNN)", (Py_ssize_t)s.k, buf_bytes(&s.syms), buf_bytes(&s.rest),
                                   (unsigned long)s.max_rest, buf_bytes(&s.codes), buf_bytes(&s.esc), digest);
    }
    XXH3_freeState(st);
    enc_free(&s);
    return result;
}

/* --- state digests ---------------------------------------------------------------------- */

PyDoc_STRVAR(xxh3_128_hex_doc,
"xxh3_128_hex(buffer) -> str\n\n"
"XXH3-128 of a C-contiguous buffer's bytes, as xxhash.xxh3_128_hexdigest writes it. Releases\n"
"the GIL.");

static PyObject *py_xxh3_128_hex(PyObject *self, PyObject *arg) {
    Py_buffer b;
    (void)self;
    if (ds_get_buffer(arg, &b, 0, "buffer") < 0) return NULL;
    XXH128_hash_t h;
    Py_BEGIN_ALLOW_THREADS
    h = DS_XXH3_128(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return ds_hex128(h.high64, h.low64);
}

/* --- a change list applied to a copy of the reference --------------------------------------- */

PyDoc_STRVAR(scatter_changes_doc,
"scatter_changes(dst, width, positions, values) -> None\n\n"
"dst[positions[i]] = values[i] for the change list encode_add(..., values=True) returned\n"
"(positions u32, values of `width` bytes): a copy of a chunk's reference advanced the way\n"
"encode_add advanced its own. ValueError when a position is outside `dst`.");

static PyObject *py_scatter_changes(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer db, pb, vb;
    long width;
    if (!PyArg_ParseTuple(args, "w*ly*y*:scatter_changes", &db, &width, &pb, &vb)) return NULL;
    PyObject *result = NULL;
    int w = ds_check_width(width);
    if (w < 0) goto done;
    if (db.len % w || pb.len % 4 || vb.len != pb.len / 4 * w) {
        PyErr_SetString(PyExc_ValueError, "scatter_changes: values do not match the positions, or bad sizes");
        goto done;
    }
    {
        uint8_t *dst = (uint8_t *)db.buf;
        const uint8_t *vals = (const uint8_t *)vb.buf;
        const uint32_t *pos = (const uint32_t *)pb.buf;
        size_t n = (size_t)pb.len / 4, count = (size_t)(db.len / w), ok = 1;
        Py_BEGIN_ALLOW_THREADS
        for (size_t i = 0; i < n; i++) ok &= pos[i] < count;
        if (ok)
            for (size_t i = 0; i < n; i++) memcpy(dst + (size_t)pos[i] * (size_t)w, vals + (size_t)w * i, (size_t)w);
        Py_END_ALLOW_THREADS
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "scatter_changes: a position is outside the chunk");
            goto done;
        }
        result = Py_NewRef(Py_None);
    }
done:
    PyBuffer_Release(&db);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&vb);
    return result;
}

PyMethodDef ds_encode_methods[] = {
    {"encode_add", py_encode_add, METH_VARARGS, encode_add_doc},
    {"scan_isa", py_scan_isa, METH_VARARGS, scan_isa_doc},
    {"scatter_changes", py_scatter_changes, METH_VARARGS, scatter_changes_doc},
    {"xxh3_128_hex", py_xxh3_128_hex, METH_O, xxh3_128_hex_doc},
    {NULL, NULL, 0, NULL},
};
