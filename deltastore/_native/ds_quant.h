/* The element arithmetic of the serving formats' quantizers (docs/SPEC.md "Serving formats:
 * quantizers"), shared by the full quantizers (quant.c) and the incremental requantizer
 * (requant.c), so that both compute every code and scale from the same operations. Static
 * inline: each including unit gets its own copy. See quant.c for why the results are exact. */
#ifndef DS_QUANT_H
#define DS_QUANT_H

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

/* fp8-block128's scale of a block whose max |x| is `a` (SPEC: NaN for a NaN, +Inf for an
 * infinity, else fl(max(a, 1e-4) × fl(1/448))). */
static inline float fp8_block_scale(float a) {
    const float floor_ = f32(AMAX_FLOOR_BITS), inv = f32(INV_E4M3_MAX_BITS);
    return a != a ? f32(F32_NAN_BITS) : (a > floor_ ? a : floor_) * inv;
}

/* mxfp8's E8M0 scale code of a block whose max |x| is `a`: the power of two at or above
 * fl(a × fl(1/448)) (RCEIL), E8M0_NAN for a NaN or an infinity. */
static inline uint8_t mx_scale_code(float a) {
    uint32_t rb = u32(a * f32(INV_E4M3_MAX_BITS));
    uint32_t exp = (rb >> 23) & 0xFFu, mant = rb & 0x7FFFFFu;
    if (exp == 0xFF) return E8M0_NAN;
    return (uint8_t)(exp + (exp == 0 ? mant > 0x400000u : mant != 0));
}

/* The element multiplier of mxfp8 scale code e (not E8M0_NAN): 2**(127-e), exact. */
static inline float mx_multiplier(uint8_t e) { return f32((254u - e) << 23); }

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

#endif
