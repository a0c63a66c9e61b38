// ymm kernels for AVX-VNNI (vpdpbusd ymm) and plain AVX2 (vpmaddubsw + vpmaddwd), 8 output
// columns per vector: each 16-column group runs as two halves. Included by kernel_avxvnni.cpp and
// kernel_avx2.cpp, each under its own `#pragma GCC target`, with YGG_VNNI 1 or 0 and YGG_TABLE set.
// Only 16 ymm registers: 4 rows a tile keeps accumulators, sums and weights in registers.
#include <immintrin.h>

#include "q4_common.h"

namespace ygg {
namespace {

constexpr int kTile = 4;

void quantize_block(const float* xb, int8_t* q, float* scale, float* sum_f, int32_t* sum_i, int32_t* sum_lo) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256 xv[4], mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    xv[i] = _mm256_loadu_ps(xb + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xv[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  const bool live = amax >= kTinyAmax;
  const __m256 inv = _mm256_set1_ps(live ? 127.f / amax : 0.f);
  __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // codes 0..15, 16..31
  alignas(32) int32_t qi[kBlock];
  for (int i = 0; i < 4; ++i) {
    __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(xv[i], inv), kRne));
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    sums[i / 2] = _mm256_add_epi32(sums[i / 2], v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i), v);
  }
  for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(qi[i]);
  int32_t half[2];
  for (int j = 0; j < 2; ++j) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums[j]), _mm256_extracti128_si256(sums[j], 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    half[j] = _mm_cvtsi128_si32(s4);
  }
  const int32_t s = half[0] + half[1];
  *scale = live ? amax / 127.f : 0.f;
  *sum_i = s;
  *sum_lo = half[0];
  *sum_f = static_cast<float>(s);
}

// 4 activation bytes in every 32-bit lane, straight from memory (vpbroadcastd ymm, m32: one load
// uop; through a general register, as load_i32 compiles, it took three, the AVX2 path's bottleneck)
typedef int32_t unaligned_i32 __attribute__((may_alias, aligned(1)));
inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const unaligned_i32*>(p)); }

// u8 x s8 -> s32 accumulate, 4 products a lane. maddubs cannot saturate here: the 4-bit codes
// are at most 15 (2 * 15 * 127 < 32767) and the 8-bit path feeds |x| <= 127 against |w| <= 127.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if YGG_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load8x32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 bytes of per-column sub-block values widened to int32 lanes (q4_k's uint8, q6_k's int8)
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i widen_i8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// R rows x 8 columns (half h of group g) of one 4-bit kind; same per-row float order as every
// other path (reference.py). The codes and dots are the kinds' common part; the scales differ.
template <Q4Kind kKind, int R>
void q4_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, int h, bool first) {
  const int64_t nb = w.blocks, ns = nb / kSuperBlocks;
  const bool per_block = kKind != Q4Kind::kQ4K;  // q4_k's d and dmin are per super-block
  const uint8_t* wq = w.q + g * nb * kQ4Bytes + 32 * h;
  const uint16_t* wd = w.d + g * (per_block ? nb : ns) * kCols + 8 * h;
  const uint16_t* wm = kKind == Q4Kind::kQ40 ? nullptr : w.m + g * (per_block ? nb : ns) * kCols + 8 * h;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t p = per_block ? b : b / kSuperBlocks;  // where this block's d (and m) are
    if (first) prefetch_ahead(wq + b * kQ4Bytes, kQ4Bytes, wd + p * kCols, wm ? wm + p * kCols : nullptr);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    // not unrolled: unrolled, GCC hoists all 32 products of a block ahead of their sums and
    // spills half of them to the stack (16 ymm registers), which cost more than the loop
#pragma GCC unroll 1
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load8x32(wq + b * kQ4Bytes + 64 * i);
      const __m256i w_lo = _mm256_and_si256(v, nibble);
      const __m256i w_hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + row0 * a.k + (b * R + r) * kBlock;
#if YGG_VNNI
        s[r] = dot_u8s8(s[r], w_lo, broadcast4(xq + 4 * i));
        s[r] = dot_u8s8(s[r], w_hi, broadcast4(xq + 16 + 4 * i));
#else
        // the block's 8 maddubs pairs add up in int16 and widen once (below): each pair is at
        // most 2 * 15 * 127 in magnitude and 8 of them 30480 < 32767, so the int32 dot is
        // exact, as VNNI's, for 8 multiply-adds fewer per block and row
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w_lo, broadcast4(xq + 4 * i)));
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w_hi, broadcast4(xq + 16 + 4 * i)));
#endif
      }
    }
#if !YGG_VNNI
    for (int r = 0; r < R; ++r) s[r] = _mm256_madd_epi16(s[r], _mm256_set1_epi16(1));
#endif
    const __m256 d = load_half8(wd + p * kCols);
    if constexpr (kKind == Q4Kind::kQ41) {
      const __m256 m = load_half8(wm + p * kCols);
      for (int r = 0; r < R; ++r) {
        const int64_t ab = row0 * nb + b * R + r;
        const __m256 part = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(s[r])),
                                          _mm256_mul_ps(m, _mm256_set1_ps(a.sum_f[ab])));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(part, _mm256_set1_ps(a.scale[ab])));
      }
    } else if constexpr (kKind == Q4Kind::kQ40) {
      for (int r = 0; r < R; ++r) {  // dot(q - 8, x) = dot(q, x) - 8 * sum(x)
        const int64_t ab = row0 * nb + b * R + r;
        const __m256i dot = _mm256_sub_epi32(s[r], _mm256_set1_epi32(8 * a.sum_i[ab]));
        const __m256 part = _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(part, _mm256_set1_ps(a.scale[ab])));
      }
    } else {
      const __m256 dmin = load_half8(wm + p * kCols);
      const __m256i sc = widen_u8(w.sc + (g * nb + b) * kCols + 8 * h);
      const __m256i mn = widen_u8(w.mn + (g * nb + b) * kCols + 8 * h);
      for (int r = 0; r < R; ++r) {
        const int64_t ab = row0 * nb + b * R + r;
        const __m256i msum = _mm256_mullo_epi32(mn, _mm256_set1_epi32(a.sum_i[ab]));
        const __m256 part = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_mullo_epi32(sc, s[r]))),
                                          _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum)));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(part, _mm256_set1_ps(a.scale[ab])));
      }
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(o, row0 + r, g * kCols + 8 * h, acc[r]);
}

// q6_k: the q4 layout's nibbles plus the qh plane's bits 4-5 (q4_common.h); each half of a block
// has its own scale, and its dot starts at -32 * (its sum of codes). AVX2: a code is at most 63,
// so two maddubs pairs (2 x 2 x 63 x 127 < 32767) add in int16 before each madd.
template <int R>
void q6_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, int h, bool first) {
  const int64_t nb = w.blocks, ns = nb / kSuperBlocks;
  const uint8_t* wq = w.q + g * nb * kQ4Bytes + 32 * h;
  const uint8_t* wh = w.qh + g * nb * kQ6HighBytes + 32 * h;
  const uint16_t* wd = w.d + g * ns * kCols + 8 * h;
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch_q6(wq, wh, wd, b);
    __m256i s_lo[R], s_hi[R];
    for (int r = 0; r < R; ++r) {
      const int32_t low = a.sum_lo[row0 * nb + b * R + r], all = a.sum_i[row0 * nb + b * R + r];
      s_lo[r] = _mm256_set1_epi32(-32 * low);
      s_hi[r] = _mm256_set1_epi32(-32 * (all - low));
    }
#pragma GCC unroll 1
    for (int j = 0; j < 2; ++j) {
      const __m256i hb = load8x32(wh + b * kQ6HighBytes + 64 * j);
      const __m256i v0 = load8x32(wq + b * kQ4Bytes + 128 * j), v1 = load8x32(wq + b * kQ4Bytes + 128 * j + 64);
      const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, nibble), _mm256_and_si256(_mm256_slli_epi32(hb, 4), top));
      const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v0, 4), nibble),
                                          _mm256_and_si256(_mm256_slli_epi32(hb, 2), top));
      const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, nibble), _mm256_and_si256(hb, top));
      const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v1, 4), nibble),
                                          _mm256_and_si256(_mm256_srli_epi32(hb, 2), top));
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + row0 * a.k + (b * R + r) * kBlock + 8 * j;
#if YGG_VNNI
        s_lo[r] = dot_u8s8(dot_u8s8(s_lo[r], lo0, broadcast4(xq)), lo1, broadcast4(xq + 4));
        s_hi[r] = dot_u8s8(dot_u8s8(s_hi[r], hi0, broadcast4(xq + 16)), hi1, broadcast4(xq + 20));
#else
        const __m256i ones = _mm256_set1_epi16(1);
        s_lo[r] = _mm256_add_epi32(s_lo[r], _mm256_madd_epi16(_mm256_add_epi16(
            _mm256_maddubs_epi16(lo0, broadcast4(xq)), _mm256_maddubs_epi16(lo1, broadcast4(xq + 4))), ones));
        s_hi[r] = _mm256_add_epi32(s_hi[r], _mm256_madd_epi16(_mm256_add_epi16(
            _mm256_maddubs_epi16(hi0, broadcast4(xq + 16)), _mm256_maddubs_epi16(hi1, broadcast4(xq + 20))), ones));
#endif
      }
    }
    const int8_t* sub = reinterpret_cast<const int8_t*>(w.sc) + (g * nb + b) * 2 * kCols + 8 * h;
    const __m256i sc_lo = widen_i8(sub), sc_hi = widen_i8(sub + kCols);
    const __m256 d = load_half8(wd + (b / kSuperBlocks) * kCols);
    for (int r = 0; r < R; ++r) {
      const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(sc_lo, s_lo[r]), _mm256_mullo_epi32(sc_hi, s_hi[r]));
      const __m256 part = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum));
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(part, _mm256_set1_ps(a.scale[row0 * nb + b * R + r])));
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(o, row0 + r, g * kCols + 8 * h, acc[r]);
}

// 8-bit. VNNI: (w xor 0x80) = w + 128 unsigned, accumulator starts at -128 * sum(xq). AVX2:
// maddubs(|x|, sign(w, x)) keeps both factors within 127, so no int16 saturation.
template <int R>
void q8_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, int h, bool first) {
  const int64_t nb = w.blocks;
  const uint8_t* wq = w.q + g * nb * kQ8Bytes + 32 * h;
  const uint16_t* wd = w.d + g * nb * kCols + 8 * h;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch_ahead(wq + b * kQ8Bytes, kQ8Bytes, wd + b * kCols, nullptr);
    __m256i s[R];
    for (int r = 0; r < R; ++r) {
#if YGG_VNNI
      s[r] = _mm256_set1_epi32(-128 * a.sum_i[row0 * nb + b * R + r]);
#else
      s[r] = _mm256_setzero_si256();
#endif
    }
#pragma GCC unroll 1  // as q4_tile's: unrolled, the products spill to the stack
    for (int j = 0; j < 8; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * kQ8Bytes + 64 * j));
#if YGG_VNNI
      const __m256i wu = _mm256_xor_si256(wv, _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
      for (int r = 0; r < R; ++r) {
        const __m256i xb = broadcast4(a.q + row0 * a.k + (b * R + r) * kBlock + 4 * j);
#if YGG_VNNI
        s[r] = dot_u8s8(s[r], wu, xb);
#else
        s[r] = dot_u8s8(s[r], _mm256_abs_epi8(xb), _mm256_sign_epi8(wv, xb));
#endif
      }
    }
    const __m256 d = load_half8(wd + b * kCols);
    for (int r = 0; r < R; ++r) {
      const int64_t ab = row0 * nb + b * R + r;
      const __m256 part = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s[r]));
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(part, _mm256_set1_ps(a.scale[ab])));
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(o, row0 + r, g * kCols + 8 * h, acc[r]);
}

// One Tile<R>::run computes both 8-column halves of a group (the driver: q4_common.h).
template <Q4Kind kKind>
struct Q4Of {
  template <int R>
  struct Tile {
    static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, bool first) {
      for (int h = 0; h < 2; ++h) q4_tile<kKind, R>(a, w, o, g, r0, h, first && h == 0);
    }
  };
};
template <int R>
struct Q6Tile {
  static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, bool first) {
    for (int h = 0; h < 2; ++h) q6_tile<R>(a, w, o, g, r0, h, first && h == 0);
  }
};
template <int R>
struct Q8Tile {
  static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, bool first) {
    for (int h = 0; h < 2; ++h) q8_tile<R>(a, w, o, g, r0, h, first && h == 0);
  }
};

}  // namespace

const KernelTable YGG_TABLE =
    tile_table<kTile, quantize_block, Q4Of<Q4Kind::kQ41>::Tile, Q4Of<Q4Kind::kQ40>::Tile, Q4Of<Q4Kind::kQ4K>::Tile,
               Q6Tile, Q8Tile>(YGG_TABLE_NAME);

}  // namespace ygg
