// AVX2 path (vpmaddubsw + vpmaddwd): Haswell and later, Zen 1-3.
#pragma GCC target("avx2,fma,f16c")
#define YGG_VNNI 0
#define YGG_TABLE kAvx2Table
#define YGG_TABLE_NAME "avx2"
#include "kernel_ymm.h"
