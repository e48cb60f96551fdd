/* XXH3 with runtime dispatch on x86-64: xxHash's own dispatcher (vendored as
 * xxh_x86dispatch.c.h, so that setup.py's *.c glob compiles it only through this file) picks
 * AVX-512, AVX2 or SSE2 once per process from cpuid. The baseline x86-64 build of the kernels
 * is SSE2 only, and XXH3 over AVX2 is ~2x faster: the chunk digest was about a third of the
 * delta-encode pass. Elsewhere this unit is empty and the kernels call the portable XXH3. */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(DS_NO_XXH_DISPATCH)
#include "xxh_x86dispatch.c.h"
#else
typedef int ds_xxh3_dispatch_unused; /* ISO C: a translation unit declares something */
#endif
