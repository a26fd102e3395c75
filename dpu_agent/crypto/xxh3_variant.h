/* xxh3-128's update compiled for one vector width, picked at run time by xts_loop.c where the
 * CPU has it (the portable build inlines the SSE2 variant, 4x slower than what the xxhash wheel
 * runs). The state layout is the same for every width, so states move between variants.
 * Included by xxh3_avx2.c and xxh3_avx512.c (one translation unit each: xxhash.h inlines once per
 * unit), which define:
 *   DPUKV_XXH3_TARGET  the `#pragma GCC target` string, e.g. "avx2"
 *   DPUKV_XXH3_VECTOR  xxHash's XXH_VECTOR (2 = AVX2, 3 = AVX-512)
 *   DPUKV_XXH3_UPDATE  the function's name, declared in xts_loop.c */
#if defined(__x86_64__) && defined(__GNUC__)
#include <stddef.h>
#define DPUKV_PRAGMA(x) _Pragma(#x)
#define DPUKV_PRAGMA_EXPANDED(x) DPUKV_PRAGMA(x)
DPUKV_PRAGMA_EXPANDED(GCC target(DPUKV_XXH3_TARGET))
#define XXH_INLINE_ALL
#define XXH_VECTOR DPUKV_XXH3_VECTOR
#include <xxhash.h>

void DPUKV_XXH3_UPDATE(void *state, const void *data, size_t len)
{
    XXH3_128bits_update((XXH3_state_t *)state, data, len);
}
#endif
