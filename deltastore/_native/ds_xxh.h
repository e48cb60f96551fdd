/* XXH3 for the kernels: xxhash.h inlined, with XXH3_128bits_update dispatched at run time to
 * the widest SIMD unit on x86-64 (xxh_dispatch.c). Include this instead of xxhash.h. */
#ifndef DS_XXH_H
#define DS_XXH_H

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__) || defined(_MSC_VER))
#define DS_XXH_DISPATCH 1
#else
#define DS_XXH_DISPATCH 0
#endif

#define XXH_INLINE_ALL
#include "xxhash.h"
#if DS_XXH_DISPATCH
#include "vendor/xxh_x86dispatch.h" /* remaps XXH3_128bits_update (and one-shot XXH3) */
#endif

#endif
