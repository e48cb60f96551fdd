/* XXH3 for the apply kernel: xxhash.h inlined, with XXH3_128bits_update (and the one-shot XXH3)
 * remapped to xxHash's x86-64 runtime dispatcher compiled by xxh3_dispatch.c (AVX2 / AVX-512
 * when the CPU has them; the extension is otherwise built for baseline SSE2, where XXH3 runs at
 * about a third of the speed). Elsewhere the portable functions. Same digests on every path. */
#ifndef DS_XXH_H
#define DS_XXH_H

#define XXH_INLINE_ALL
#include "xxhash.h"
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(DS_NO_XXH_DISPATCH) /* as xxh3_dispatch.c */
#include "xxh_x86dispatch.h"
#endif

#endif
