/* XXH3 for the kernels (state digests, SPEC §2): xxHash inlined into each including unit
 * (static functions, no symbol clashes), and DS_XXH3_128 / DS_XXH3_128_UPDATE for the calls
 * that take the bulk of the bytes: on x86-64 the runtime dispatcher (AVX2 / AVX-512 when
 * present, compiled once in xxh3_dispatch.c), elsewhere the portable functions. Same digests
 * as xxhash.xxh3_128_hexdigest either way. */
#ifndef DS_XXH3_H
#define DS_XXH3_H

#define XXH_INLINE_ALL
#include "xxhash.h"

/* XXH3 entry points that take the bulk of the bytes: the x86-64 runtime dispatcher (AVX2 /
 * AVX-512 when present, xxh3_dispatch.c) or the portable functions. Same digests. */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(DS_NO_XXH_DISPATCH)
#define XXH_DISPATCH_DISABLE_REPLACE
#include "xxh_x86dispatch.h"
#define DS_XXH3_128 XXH3_128bits_dispatch
#define DS_XXH3_128_UPDATE XXH3_128bits_update_dispatch
#else
#define DS_XXH3_128 XXH3_128bits
#define DS_XXH3_128_UPDATE XXH3_128bits_update
#endif

#endif
