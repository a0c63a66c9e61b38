// Portable path of the batch-invariant float ops: the definitions of float_common.h as plain
// loops (16 lane sums in an array). The SIMD paths return the same bits; this one is their check
// and the path of last resort on a CPU without AVX2.
#include "float_common.h"

namespace ygg {
namespace {

void rms_rows(const RmsArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a.x + r * a.d;
    float* y = a.y + r * a.d;
    float lanes[kLanes] = {};
    for (int64_t i = 0; i < a.d; ++i) lanes[i % kLanes] = lanes[i % kLanes] + x[i] * x[i];
    const float inv = 1.f / __builtin_sqrtf(tree16(lanes) / static_cast<float>(a.d) + a.eps);
    for (int64_t i = 0; i < a.d; ++i) y[i] = a.w[i] * (x[i] * inv);
  }
}

void score_block(const float* q, const float* k, int64_t key_stride, int64_t chunks, float scale, uint32_t bits,
                 float* out) {
  for (int j = 0; j < kKeyBlock; ++j) {
    const float* key = k + j * key_stride;
    float lanes[kLanes] = {};
    for (int64_t c = 0; c < chunks; ++c)
      for (int i = 0; i < kLanes; ++i) lanes[i] = lanes[i] + q[c * kLanes + i] * key[c * kLanes + i];
    out[j] = (bits >> j) & 1u ? tree16(lanes) * scale : -__builtin_inff();
  }
}

float row_max(const float* p, const int32_t* blocks, int64_t nb) {
  float m = -__builtin_inff();
  for (int64_t i = 0; i < nb; ++i)
    for (int j = 0; j < kKeyBlock; ++j) {
      const float s = p[blocks[i] * kKeyBlock + j];
      m = s > m ? s : m;
    }
  return m;
}

void exp_row(float* p, const int32_t* blocks, int64_t nb, float m) {
  for (int64_t i = 0; i < nb; ++i) {
    float* block = p + blocks[i] * kKeyBlock;
    for (int j = 0; j < kKeyBlock; ++j) block[j] = exp_fixed(block[j] - m);
  }
}

void accumulate(int64_t chunks, const float* v, int64_t v_stride, int64_t s0, int64_t s1, const float* const* p,
                float* const* acc, int64_t rows) {
  const int64_t d = chunks * kLanes;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = s0; s < s1; ++s) {
      const float w = p[r][s];
      if (w == 0.f) continue;
      const float* vs = v + s * v_stride;
      for (int64_t i = 0; i < d; ++i) acc[r][i] = acc[r][i] + w * vs[i];
    }
}

void finish_row(const float* acc, float l, int64_t d, float* out) {
  for (int64_t i = 0; i < d; ++i) out[i] = l == 0.f ? 0.f : acc[i] / l;
}

#include "attention_driver.h"

void silu_mul_rows(const float* gu, float* out, int64_t f, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < f; ++i) out[r * f + i] = silu_mul_one(gu[r * 2 * f + i], gu[r * 2 * f + f + i]);
}

}  // namespace

const FloatKernels kFloatScalar = {"scalar", rms_rows, attention_items, silu_mul_rows};

}  // namespace ygg
