// AVX-512 path of the batch-invariant float ops: one zmm holds the 16 lanes of float_common.h's
// fixed order, so each operation below is one of the definition's, 16 at a time. The glue calls
// it only where the CPU has the avx512vnni q4 path (which implies avx512f/bw/vl).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>

#include "float_common.h"

namespace ygg {
namespace {

// tree16 of one vector: halves, quarters, then pairs, as the scalar definition.
inline float tree16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// tree16 of 16 vectors at once (v[j]: key j's lanes) -> their 16 sums in key order. Each stage
// adds lane i to lane i + 8 (then + 4, + 2, + 1) of the same key while packing two keys per vector.
inline __m512 tree16x16(const __m512 v[16]) {
  __m512 w[8], x[4], y[2];
  for (int j = 0; j < 8; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // 128-bit chunk k of x[j]: key 4j + k, lanes b[0..3]
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int j = 0; j < 2; ++j)  // chunk k of y[j]: c[0..1] of keys 8j + k and 8j + 4 + k
    y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4k + m now holds key 4m + k: transpose back to key order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// exp_fixed on 16 lanes; lanes below kExpMin (masked keys: -inf) are 0, NaN stays NaN.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x * kLog2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_NLT_UQ),
                             exp_scaled<__m512, __v16si>(x, n));
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

void rms_rows(const RmsArgs& a, int64_t r0, int64_t r1) {
  const int64_t full = a.d / kLanes * kLanes;
  const __mmask16 tail = tail_mask(a.d - full);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a.x + r * a.d;
    float* y = a.y + r * a.d;
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += kLanes) {
      const __m512 v = _mm512_loadu_ps(x + i);
      lanes = _mm512_add_ps(lanes, _mm512_mul_ps(v, v));
    }
    if (tail) {  // zero padding adds +0 to lanes >= +0: the same as not adding
      const __m512 v = _mm512_maskz_loadu_ps(tail, x + full);
      lanes = _mm512_add_ps(lanes, _mm512_mul_ps(v, v));
    }
    const __m512 inv = _mm512_set1_ps(1.f / __builtin_sqrtf(tree16(lanes) / static_cast<float>(a.d) + a.eps));
    for (int64_t i = 0; i < full; i += kLanes)
      _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(a.w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), inv)));
    if (tail)
      _mm512_mask_storeu_ps(y + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, a.w + full),
                                                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + full), inv)));
  }
}

// 16 keys x one query row: lane partials per key in registers (the query chunk loaded once per
// chunk), then all 16 trees at once.
void score_block(const float* q, const float* k, int64_t key_stride, int64_t chunks, float scale, uint32_t bits,
                 float* out) {
  __m512 acc[kKeyBlock];
#pragma GCC unroll 16
  for (int j = 0; j < kKeyBlock; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + c * kLanes);
#pragma GCC unroll 16
    for (int j = 0; j < kKeyBlock; ++j)
      acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(qc, _mm512_loadu_ps(k + j * key_stride + c * kLanes)));
  }
  const __m512 s = _mm512_mul_ps(tree16x16(acc), _mm512_set1_ps(scale));
  _mm512_storeu_ps(out, _mm512_mask_blend_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(-__builtin_inff()), s));
}

float row_max(const float* p, const int32_t* blocks, int64_t nb) {
  __m512 m = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < nb; ++i) m = _mm512_max_ps(m, _mm512_loadu_ps(p + blocks[i] * kKeyBlock));
  return _mm512_reduce_max_ps(m);  // max is exact: any order gives the same value
}

void exp_row(float* p, const int32_t* blocks, int64_t nb, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t i = 0; i < nb; ++i) {
    float* block = p + blocks[i] * kKeyBlock;
    _mm512_storeu_ps(block, exp16(_mm512_sub_ps(_mm512_loadu_ps(block), mv)));
  }
}

// RR rows x all D of their V sums in registers over keys [s0, s1); each V row is loaded once for
// the RR rows. A row adds w * v only where its weight w is nonzero (masked add: never 0 * garbage).
template <int NC, int RR>
void accumulate_group(const float* v, int64_t v_stride, int64_t s0, int64_t s1, const float* const* p,
                      float* const* acc) {
  __m512 sum[RR][NC];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < NC; ++c) sum[r][c] = _mm512_loadu_ps(acc[r] + c * kLanes);
  for (int64_t s = s0; s < s1; ++s) {
    __m512 w[RR];
    __mmask16 live[RR], any = 0;
    for (int r = 0; r < RR; ++r) {
      w[r] = _mm512_set1_ps(p[r][s]);
      live[r] = _mm512_cmp_ps_mask(w[r], _mm512_setzero_ps(), _CMP_NEQ_UQ);
      any |= live[r];
    }
    if (!any) continue;
    const float* vs = v + s * v_stride;
    for (int c = 0; c < NC; ++c) {
      const __m512 vc = _mm512_loadu_ps(vs + c * kLanes);
      for (int r = 0; r < RR; ++r)
        sum[r][c] = _mm512_mask_add_ps(sum[r][c], live[r], sum[r][c], _mm512_mul_ps(w[r], vc));
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc[r] + c * kLanes, sum[r][c]);
}

constexpr int v_rows(int nc) { return 24 / nc > 6 ? 6 : (24 / nc < 1 ? 1 : 24 / nc); }  // sums in <= 24 zmm

void finish_row(const float* acc, float l, int64_t d, float* out) {
  const __m512 lv = _mm512_set1_ps(l);
  for (int64_t i = 0; i < d; i += kLanes)
    _mm512_storeu_ps(out + i, l == 0.f ? _mm512_setzero_ps() : _mm512_div_ps(_mm512_loadu_ps(acc + i), lv));
}

constexpr int kSiluLanes = kLanes;

void silu_lanes(const float* g, const float* u, float* o) {
  const __m512 gv = _mm512_loadu_ps(g), zero = _mm512_setzero_ps();
  const __mmask16 positive = _mm512_cmp_ps_mask(gv, zero, _CMP_GE_OQ);
  const __m512 e = exp16(_mm512_mask_sub_ps(gv, positive, zero, gv));  // -|g|
  const __m512 num = _mm512_mask_blend_ps(positive, _mm512_mul_ps(gv, e), gv);
  _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(u)));
}

#include "simd_rows.h"

#include "attention_driver.h"

}  // namespace

const FloatKernels kFloatAvx512 = {"avx512", rms_rows, attention_items, silu_mul_rows};

}  // namespace ygg
