/* Prototype of the decode step a conditioned delta codec would need (benchmarks/conditioned.py
 * --kernel; docs/design/003-codec-v2.md, addendum). Not part of the package: compiled by the
 * benchmark with the system's cc and called through ctypes, only to measure its speed.
 *
 * Every element of the held chunk has a class, lut[old >> 7] (bf16 sign and exponent). The
 * delta codes each changed element as its rank among its class's elements, crossers (changed
 * elements whose class changes) excluded from every class. ctx_select maps the ranks back to
 * positions in one read-only pass over the chunk: per block of BLOCK elements the classes are
 * counted into four interleaved histograms (no store-to-load chain on one counter), and a
 * block is scanned element by element only for a class whose next wanted rank falls in it.
 *
 * Returns 0, or -1 if a rank or crosser lies beyond the chunk (out is then partly written). */
#include <stdint.h>
#include <string.h>

#define BLOCK 64
#define MAX_CLASSES 64

#ifdef __SSE2__
#include <emmintrin.h>
static inline uint64_t class_mask(const uint8_t *cl, uint8_t c) {
    __m128i cc = _mm_set1_epi8((char)c);
    uint64_t m = 0;
    for (int q = 0; q < BLOCK / 16; q++)
        m |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(cl + 16 * q)), cc)) << (16 * q);
    return m;
}
#else
static inline uint64_t class_mask(const uint8_t *cl, uint8_t c) {
    uint64_t m = 0;
    for (int i = 0; i < BLOCK; i++) m |= (uint64_t)(cl[i] == c) << i;
    return m;
}
#endif

int ctx_select(const uint16_t *old, int64_t n, const uint8_t *lut, int k, const int64_t *xs, int64_t nx,
               const int64_t *rk, const int64_t *off, int64_t *out) {
    int64_t cnt[MAX_CLASSES], want[MAX_CLASSES], j[MAX_CLASSES];
    if (k < 1 || k >= MAX_CLASSES) return -1;
    for (int c = 0; c < k; c++) {
        cnt[c] = 0;
        j[c] = off[c];
        want[c] = j[c] < off[c + 1] ? rk[j[c]] : -1;
    }
    int64_t xi = 0, nextx = nx ? xs[0] : -1;
    uint8_t cl[BLOCK];
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        int64_t bn = n - b0 < BLOCK ? n - b0 : BLOCK;
        const uint16_t *p = old + b0;
        for (int64_t i = 0; i < bn; i++) cl[i] = lut[p[i] >> 7];
        for (int64_t i = bn; i < BLOCK; i++) cl[i] = (uint8_t)k; /* class k: counted nowhere */
        while (nextx >= b0 && nextx < b0 + bn) {
            cl[nextx - b0] = (uint8_t)k;
            nextx = ++xi < nx ? xs[xi] : -1;
        }
        uint8_t h[4][MAX_CLASSES + 1];
        memset(h, 0, sizeof h);
        for (int i = 0; i < BLOCK; i += 4) {
            h[0][cl[i]]++;
            h[1][cl[i + 1]]++;
            h[2][cl[i + 2]]++;
            h[3][cl[i + 3]]++;
        }
        for (int c = 0; c < k; c++) {
            int64_t bc = h[0][c] + h[1][c] + h[2][c] + h[3][c];
            if (want[c] >= 0 && cnt[c] + bc > want[c]) {
                /* The block's elements of class c as a bit mask; the wanted ranks are found by
                 * dropping set bits, without a branch per element (which mispredicts). */
                uint64_t m = class_mask(cl, (uint8_t)c);
                int64_t r = cnt[c];
                while (want[c] >= 0 && want[c] < cnt[c] + bc) {
                    for (; r < want[c]; r++) m &= m - 1;
                    out[j[c]++] = b0 + __builtin_ctzll(m);
                    m &= m - 1;
                    r++;
                    want[c] = j[c] < off[c + 1] ? rk[j[c]] : -1;
                }
            }
            cnt[c] += bc;
        }
    }
    if (xi < nx) return -1;
    for (int c = 0; c < k; c++)
        if (j[c] != off[c + 1]) return -1;
    return 0;
}
