/* xxh3-128's update compiled for AVX2, picked at run time by xts_loop.c where the
 * CPU has it (the portable build inlines the SSE2 variant, 4x slower than what the xxhash wheel runs).
 * The state layout is the same for every vector width, so states move between variants.
 * Compiled by _build.py into the same cffi module as xts_loop.c. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <stddef.h>
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR 2
#include <xxhash.h>

void dpukv_xxh3_update_avx2(void *state, const void *data, size_t len)
{
    XXH3_128bits_update((XXH3_state_t *)state, data, len);
}
#endif
