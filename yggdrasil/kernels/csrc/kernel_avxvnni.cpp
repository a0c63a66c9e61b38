// AVX-VNNI path (vpdpbusd on ymm, VEX-encoded): Alder Lake and later Intel, Zen 5.
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define YGG_VNNI 1
#define YGG_TABLE kAvxVnniTable
#define YGG_TABLE_NAME "avxvnni"
#include "kernel_ymm.h"
