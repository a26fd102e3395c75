/* xxh3-128's update for AVX-512 F+BW (xxh3_variant.h); compiled by _build.py into the cffi module. */
#define DPUKV_XXH3_TARGET "avx512f,avx512bw,avx2"
#define DPUKV_XXH3_VECTOR 3
#define DPUKV_XXH3_UPDATE dpukv_xxh3_update_avx512
#include "xxh3_variant.h"
