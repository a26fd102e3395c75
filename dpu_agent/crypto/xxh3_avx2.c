/* xxh3-128's update for AVX2 (xxh3_variant.h); compiled by _build.py into the cffi module. */
#define DPUKV_XXH3_TARGET "avx2"
#define DPUKV_XXH3_VECTOR 2
#define DPUKV_XXH3_UPDATE dpukv_xxh3_update_avx2
#include "xxh3_variant.h"
