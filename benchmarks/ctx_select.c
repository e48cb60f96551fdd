/* Prototype of the decode step a conditioned delta codec would need (benchmarks/conditioned.py
 * --kernel; docs/design/003-codec-v2.md). Not part of the package: compiled by the
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
                    if (want[c] < r) return -1; /* ranks not increasing */
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

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>

/* The same pass with AVX2 and BMI2 (runtime-checked by ctx_has_avx2): classes computed from
 * the exponent arithmetically, clip(e, lo, lo + k - 1) - lo, 32 elements per instruction, and
 * counted with compare + movemask + popcount; the r-th element of a class in a block is found
 * with pdep. `lut` is not used: this variant needs the class window (lo, k) instead. */
__attribute__((target("avx2,bmi,bmi2,popcnt")))
int ctx_select_avx2(const uint16_t *old, int64_t n, int lo, int k, const int64_t *xs, int64_t nx,
                    const int64_t *rk, const int64_t *off, int64_t *out) {
    int64_t cnt[MAX_CLASSES], want[MAX_CLASSES], j[MAX_CLASSES];
    if (k < 1 || k >= MAX_CLASSES || lo < 0 || lo + k - 1 > 255) return -1;
    for (int c = 0; c < k; c++) {
        cnt[c] = 0;
        j[c] = off[c];
        want[c] = j[c] < off[c + 1] ? rk[j[c]] : -1;
    }
    int64_t xi = 0, nextx = nx ? xs[0] : -1;
    const __m256i vlo = _mm256_set1_epi16((short)lo), vhi = _mm256_set1_epi16((short)(lo + k - 1));
    const __m256i ff = _mm256_set1_epi16(0xFF);
    uint8_t cl[BLOCK] __attribute__((aligned(32)));
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        int64_t bn = n - b0 < BLOCK ? n - b0 : BLOCK;
        if (bn == BLOCK) {
            for (int q = 0; q < BLOCK / 32; q++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(old + b0 + 32 * q));
                __m256i b = _mm256_loadu_si256((const __m256i *)(old + b0 + 32 * q + 16));
                a = _mm256_sub_epi16(_mm256_min_epi16(_mm256_max_epi16(_mm256_and_si256(_mm256_srli_epi16(a, 7), ff), vlo), vhi), vlo);
                b = _mm256_sub_epi16(_mm256_min_epi16(_mm256_max_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 7), ff), vlo), vhi), vlo);
                /* packus interleaves 128-bit lanes; permute back to element order */
                __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
                _mm256_store_si256((__m256i *)(cl + 32 * q), p);
            }
        } else {
            for (int64_t i = 0; i < bn; i++) {
                int e = (old[b0 + i] >> 7) & 0xFF;
                e = e < lo ? lo : e > lo + k - 1 ? lo + k - 1 : e;
                cl[i] = (uint8_t)(e - lo);
            }
            for (int64_t i = bn; i < BLOCK; i++) cl[i] = (uint8_t)k;
        }
        while (nextx >= b0 && nextx < b0 + bn) {
            cl[nextx - b0] = (uint8_t)k;
            nextx = ++xi < nx ? xs[xi] : -1;
        }
        __m256i c0 = _mm256_load_si256((const __m256i *)cl), c1 = _mm256_load_si256((const __m256i *)(cl + 32));
        for (int c = 0; c < k; c++) {
            __m256i cc = _mm256_set1_epi8((char)c);
            uint64_t m = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c0, cc)) |
                         ((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c1, cc)) << 32);
            int64_t bc = _mm_popcnt_u64(m);
            while (want[c] >= 0 && want[c] < cnt[c] + bc) {
                if (want[c] < cnt[c]) return -1; /* ranks not increasing */
                /* the (want - cnt)-th set bit of m */
                uint64_t bit = _pdep_u64(1ULL << (want[c] - cnt[c]), m);
                out[j[c]++] = b0 + _tzcnt_u64(bit);
                want[c] = j[c] < off[c + 1] ? rk[j[c]] : -1;
            }
            cnt[c] += bc;
        }
    }
    if (xi < nx) return -1;
    for (int c = 0; c < k; c++)
        if (j[c] != off[c + 1]) return -1;
    return 0;
}

int ctx_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}
#endif
