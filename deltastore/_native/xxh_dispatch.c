/* XXH3 with runtime dispatch (SSE2 / AVX2 / AVX-512) on x86-64, for the kernels' digests.
 *
 * The extension is compiled for the baseline ISA (SSE2 on x86-64), where XXH3 runs at about a
 * third of the AVX2 speed; the state digests are the hot part of a pull (every byte of the
 * model is hashed), so the vendored xxHash dispatcher (vendor/xxh_x86dispatch.c, the same
 * xxHash release as xxhash.h, BSD-2, see LICENSE-xxhash) picks the widest unit the CPU has at
 * run time, as the xxhash Python package does. The digests are the same on every path.
 * Elsewhere this unit is empty and the kernels call the portable functions (ds_xxh.h). */
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__) || defined(_MSC_VER))
/* the same condition as DS_XXH_DISPATCH in ds_xxh.h (not included: this unit includes
 * xxhash.h its own way) */
#include "vendor/xxh_x86dispatch.c"
#else
typedef int ds_xxh_dispatch_unused; /* ISO C: a translation unit must not be empty */
#endif
