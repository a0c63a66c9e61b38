// AVX2 path of the batch-invariant float ops (also taken by the avxvnni q4 path: no integer dots
// here). The 16 lanes of float_common.h's fixed order are a pair of ymm (lo = lanes 0..7,
// hi = 8..15), so every operation is one of the definition's and the bits match the other paths.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "float_common.h"

namespace ygg {
namespace {

struct Lanes {
  __m256 lo, hi;
};

inline float tree8(__m256 a) {  // the definition's tree after its first stage (a = lo + hi)
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

inline float tree16(Lanes v) { return tree8(_mm256_add_ps(v.lo, v.hi)); }

// Stages 2 and 3 of the tree for 4 keys (a[j] = stage 1 of key j): 128-bit lane L holds c[0..1]
// of key L in elements 0-1 and of key 2 + L in elements 2-3.
inline __m256 tree_stage3x4(const __m256 a[4]) {
  const __m256 x0 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 x1 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Stage 4 for keys 0-3 (ya) and 4-7 (yb) -> their 8 sums in key order.
inline __m256 tree_stage4x8(__m256 ya, __m256 yb) {
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(ya, yb, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(ya, yb, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // was r0 r2 r4 r6 r1 r3 r5 r7
}

inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(x * kLog2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_NLT_UQ), exp_scaled<__m256, __v8si>(x, n));
}

// Lanes [i, i + 8) that exist in a row of n floats (maskload reads nothing past them).
inline __m256i load_mask(int64_t i, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), idx);
}

void rms_rows(const RmsArgs& a, int64_t r0, int64_t r1) {
  const int64_t full = a.d / kLanes * kLanes;
  const __m256i m_lo = load_mask(full, a.d), m_hi = load_mask(full + 8, a.d);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a.x + r * a.d;
    float* y = a.y + r * a.d;
    Lanes lanes = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < full; i += kLanes) {
      const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + 8);
      lanes.lo = _mm256_add_ps(lanes.lo, _mm256_mul_ps(lo, lo));
      lanes.hi = _mm256_add_ps(lanes.hi, _mm256_mul_ps(hi, hi));
    }
    if (full < a.d) {  // zero padding adds +0 to lanes >= +0: the same as not adding
      const __m256 lo = _mm256_maskload_ps(x + full, m_lo), hi = _mm256_maskload_ps(x + full + 8, m_hi);
      lanes.lo = _mm256_add_ps(lanes.lo, _mm256_mul_ps(lo, lo));
      lanes.hi = _mm256_add_ps(lanes.hi, _mm256_mul_ps(hi, hi));
    }
    const __m256 inv = _mm256_set1_ps(1.f / __builtin_sqrtf(tree16(lanes) / static_cast<float>(a.d) + a.eps));
    int64_t i = 0;
    for (; i + 8 <= a.d; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(a.w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), inv)));
    for (; i < a.d; ++i) y[i] = a.w[i] * (x[i] * inv[0]);
  }
}

// 4 keys x one query row at a time (8 ymm of lane partials: registers are 16), trees for 4 keys,
// then stage 4 pairs two such groups into 8 scores.
inline __m256 score_keys4(const float* q, const float* k, int64_t key_stride, int64_t chunks) {
  __m256 lo[4], hi[4];
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256 qlo = _mm256_loadu_ps(q + c * kLanes), qhi = _mm256_loadu_ps(q + c * kLanes + 8);
    for (int j = 0; j < 4; ++j) {
      const float* kc = k + j * key_stride + c * kLanes;
      lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(qlo, _mm256_loadu_ps(kc)));
      hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(qhi, _mm256_loadu_ps(kc + 8)));
    }
  }
  __m256 a[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm256_add_ps(lo[j], hi[j]);
  return tree_stage3x4(a);
}

void score_block(const float* q, const float* k, int64_t key_stride, int64_t chunks, float scale, uint32_t bits,
                 float* out) {
  const __m256 sv = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-__builtin_inff());
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int half = 0; half < 2; ++half) {
    const float* kh = k + 8 * half * key_stride;
    const __m256 ya = score_keys4(q, kh, key_stride, chunks);
    const __m256 yb = score_keys4(q, kh + 4 * key_stride, key_stride, chunks);
    const __m256 s = _mm256_mul_ps(tree_stage4x8(ya, yb), sv);
    const __m256i b8 = _mm256_set1_epi32(static_cast<int>((bits >> (8 * half)) & 0xFFu));
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b8, bit), bit));
    _mm256_storeu_ps(out + 8 * half, _mm256_blendv_ps(ninf, s, live));
  }
}

float row_max(const float* p, const int32_t* blocks, int64_t nb) {
  __m256 m = _mm256_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < nb; ++i) {
    const float* block = p + blocks[i] * kKeyBlock;
    m = _mm256_max_ps(m, _mm256_max_ps(_mm256_loadu_ps(block), _mm256_loadu_ps(block + 8)));
  }
  alignas(32) float v[8];
  _mm256_store_ps(v, m);
  float out = v[0];
  for (int i = 1; i < 8; ++i) out = v[i] > out ? v[i] : out;  // max is exact: any order
  return out;
}

void exp_row(float* p, const int32_t* blocks, int64_t nb, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t i = 0; i < nb; ++i) {
    float* block = p + blocks[i] * kKeyBlock;
    _mm256_storeu_ps(block, exp8(_mm256_sub_ps(_mm256_loadu_ps(block), mv)));
    _mm256_storeu_ps(block + 8, exp8(_mm256_sub_ps(_mm256_loadu_ps(block + 8), mv)));
  }
}

// RR rows' V sums (2 * NC ymm each) over keys [s0, s1); a row adds w * v only where w != 0.
template <int NC, int RR>
void accumulate_group(const float* v, int64_t v_stride, int64_t s0, int64_t s1, const float* const* p,
                      float* const* acc) {
  __m256 sum[RR][2 * NC];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < 2 * NC; ++c) sum[r][c] = _mm256_loadu_ps(acc[r] + c * 8);
  for (int64_t s = s0; s < s1; ++s) {
    __m256 w[RR], live[RR];
    int any = 0;
    for (int r = 0; r < RR; ++r) {
      w[r] = _mm256_set1_ps(p[r][s]);
      live[r] = _mm256_cmp_ps(w[r], _mm256_setzero_ps(), _CMP_NEQ_UQ);
      any |= _mm256_movemask_ps(live[r]);
    }
    if (!any) continue;
    const float* vs = v + s * v_stride;
    for (int c = 0; c < 2 * NC; ++c) {
      const __m256 vc = _mm256_loadu_ps(vs + c * 8);
      for (int r = 0; r < RR; ++r)
        sum[r][c] = _mm256_blendv_ps(sum[r][c], _mm256_add_ps(sum[r][c], _mm256_mul_ps(w[r], vc)), live[r]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < 2 * NC; ++c) _mm256_storeu_ps(acc[r] + c * 8, sum[r][c]);
}

constexpr int v_rows(int nc) { return 6 / nc < 1 ? 1 : 6 / nc; }  // sums held in <= 12 ymm

void finish_row(const float* acc, float l, int64_t d, float* out) {
  const __m256 lv = _mm256_set1_ps(l);
  for (int64_t i = 0; i < d; i += 8)
    _mm256_storeu_ps(out + i, l == 0.f ? _mm256_setzero_ps() : _mm256_div_ps(_mm256_loadu_ps(acc + i), lv));
}

constexpr int kSiluLanes = 8;

void silu_lanes(const float* g, const float* u, float* o) {
  const __m256 gv = _mm256_loadu_ps(g), zero = _mm256_setzero_ps();
  const __m256 positive = _mm256_cmp_ps(gv, zero, _CMP_GE_OQ);
  const __m256 e = exp8(_mm256_blendv_ps(gv, _mm256_sub_ps(zero, gv), positive));  // -|g|
  const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(gv, e), gv, positive);
  _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(u)));
}

#include "simd_rows.h"

#include "attention_driver.h"

}  // namespace

const FloatKernels kFloatAvx2 = {"avx2", rms_rows, attention_items, silu_mul_rows};

}  // namespace ygg
