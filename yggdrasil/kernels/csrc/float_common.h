// Shared by the batch-invariant float32 ops' glue (invariant_ops.cpp) and their per-ISA kernel
// files (float_scalar.cpp, float_avx2.cpp, float_avx512.cpp). Free of torch headers, and every
// helper here is static, for the reason q4_common.h gives (no COMDAT merging across ISAs).
//
// The arithmetic every path performs (reference.py spells it out in PyTorch, bit for bit):
//   tree16(p[16]): a[i] = p[i] + p[i+8], b[i] = a[i] + a[i+4], c[i] = b[i] + b[i+2], c[0] + c[1]
//   lane sums:     lane i starts at +0 and adds, in increasing index, the terms whose index is i mod 16
//   exp_fixed:     the Cephes expf polynomial below, mul and add rounded separately, 0 below -87
// A SIMD path keeps its 16 (or 2 x 8) lanes in registers and performs exactly these operations.
#pragma once
#include <cstdint>
#include <cstring>

namespace ygg {

constexpr int kLanes = 16;           // float lanes of the fixed reduction order (one zmm)
constexpr int kKeyBlock = 16;        // keys scored at once; blocks start at multiples of 16
constexpr int kMaxItemRows = 32;     // query rows per attention work item (bounds the scratch)
constexpr int kRunBlocks = 4;        // key blocks per V pass over an item's rows (64 keys: L1)

// Constants as float(double literal), the rounding PyTorch applies to the same literals.
static const float kLog2e = static_cast<float>(1.44269504088896341);
static const float kExpC1 = static_cast<float>(0.693359375);
static const float kExpC2 = static_cast<float>(-2.12194440e-4);
static const float kExpP[6] = {static_cast<float>(1.9875691500e-4), static_cast<float>(1.3981999507e-3),
                               static_cast<float>(8.3334519073e-3), static_cast<float>(4.1665795894e-2),
                               static_cast<float>(1.6666665459e-1), static_cast<float>(5.0000001201e-1)};
static const float kExpMin = -87.0f;  // exp of anything lower is flushed to 0 (2^n stays normal)

// Rows [r0, r1) of y = w * (x * (1 / sqrt(sum(x*x) / d + eps))), x and y [rows, d] row-major.
struct RmsArgs {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, d;
  float eps;
};
using RmsFn = void (*)(const RmsArgs& a, int64_t r0, int64_t r1);

// Attention over a KV-cache prefix. Strides in floats (bytes for the mask); the last dim of every
// operand is contiguous. Work item i = (b, kv head g, chunk c) takes rows [c*chunk_rows, ...) of
// the group's G*T query rows, t-major (row r is t = r / G, query head g*G + r % G).
struct AttnArgs {
  const float* q;                 // [B, H, T, D] contiguous
  const float* k;                 // [B, Hkv, S, D] view
  const float* v;
  const uint8_t* mask;            // [B, 1, T, S] bool view (0 / 1 bytes)
  float* out;                     // [B, H, T, D] contiguous
  int64_t k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, m_sb, m_st;
  int64_t batch, heads, kv_heads, t, s, d;
  float scale;
  int64_t chunk_rows, chunks;     // rows per item (<= kMaxItemRows), items per (b, g)
};
// Items [i0, i1), using `scratch` (attn_scratch_floats(a) floats, any alignment).
using AttnFn = void (*)(const AttnArgs& a, int64_t i0, int64_t i1, float* scratch);

// Rows [r0, r1) of out = silu(g) * u, gu [rows, 2f] row-major (g = its first f columns, u the
// rest), out [rows, f]: per element, with e = exp_fixed(-|g|) (its argument is <= 0: no overflow),
// silu(g) = (g >= 0 ? g : g * e) / (1 + e), each operation rounded once.
using SiluMulFn = void (*)(const float* gu, float* out, int64_t f, int64_t r0, int64_t r1);

struct FloatKernels {
  const char* name;
  RmsFn rms_norm;
  AttnFn attention;
  SiluMulFn silu_mul;
};

extern const FloatKernels kFloatScalar;
extern const FloatKernels kFloatAvx2;
extern const FloatKernels kFloatAvx512;

static inline int64_t attn_blocks(const AttnArgs& a) { return (a.s + kKeyBlock - 1) / kKeyBlock; }

// Per-call scratch: scores [chunk_rows][blocks*16], acc [chunk_rows][d], a zero-padded copy of the
// last partial key block [16][d], the visited block list (int32, one float slot each).
static inline int64_t attn_scratch_floats(const AttnArgs& a) {
  const int64_t nb = attn_blocks(a);
  return a.chunk_rows * (nb * kKeyBlock + a.d) + kKeyBlock * a.d + nb;
}

static inline float tree16(const float* p) {
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

// Bit j set where key s0 + j may be attended (n <= 16 keys exist from s0).
static inline uint32_t mask_bits(const uint8_t* m, int n) {
  uint32_t bits = 0;
  for (int j = 0; j < n; ++j) bits |= static_cast<uint32_t>(m[j] != 0) << j;
  return bits;
}

// Whether any of n <= 16 mask bytes is set (bool bytes are 0 or 1: OR them 8 at a time).
static inline bool mask_any(const uint8_t* m, int n) {
  if (n == kKeyBlock) {
    uint64_t w0, w1;
    std::memcpy(&w0, m, 8);
    std::memcpy(&w1, m + 8, 8);
    return (w0 | w1) != 0;
  }
  for (int j = 0; j < n; ++j)
    if (m[j]) return true;
  return false;
}

// exp_fixed's polynomial, 1 + r + r^2 P(r) with r = x - n ln 2 in two parts, for one float or a
// GCC vector of them (__m256, __m512: the operators act lane by lane, each rounded once, no FMA).
template <class F>
static inline F exp_poly(F x, F n) {
  F r = x - n * kExpC1;
  r = r - n * kExpC2;
  const F z = r * r;
  F y = F{} + kExpP[0];
  for (int i = 1; i < 6; ++i) y = y * r + kExpP[i];
  y = y * z + r;
  return y + 1.f;
}

// exp_fixed without its kExpMin cut, for a GCC vector of floats F (int lanes I), n = rint(x log2e)
// from the caller's ISA: the polynomial times 2^n (the exponent bits built directly).
template <class F, class I>
static inline F exp_scaled(F x, F n) {
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return exp_poly(x, n) * (F)bits;
}

// The scalar exp every path reproduces lane by lane; x <= 0 here (a score minus the row's max).
static inline float exp_fixed(float x) {
  if (x != x) return x;
  if (x < kExpMin) return 0.f;
  const float n = __builtin_rintf(x * kLog2e);  // round half to even, as roundscale / torch.round
  const float y = exp_poly(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

static inline float silu_mul_one(float g, float u) {
  const float e = exp_fixed(g >= 0.f ? -g : g);  // -|g|
  const float num = g >= 0.f ? g : g * e;
  return (num / (1.f + e)) * u;
}

}  // namespace ygg
