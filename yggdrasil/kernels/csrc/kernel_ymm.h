// ymm kernels for AVX-VNNI (vpdpbusd ymm) and plain AVX2 (vpmaddubsw + vpmaddwd), 8 output
// columns per vector: each 16-column group runs as two halves. Included by kernel_avxvnni.cpp and
// kernel_avx2.cpp, each under its own `#pragma GCC target`, with YGG_VNNI 1 or 0 and YGG_TABLE set.
// Only 16 ymm registers: 4 rows a tile keeps accumulators, sums and weights in registers.
#include <immintrin.h>

#include "q4_common.h"

namespace ygg {
namespace {

constexpr int kTile = 4;
constexpr int kPrefetchBlocks = 16;  // weight blocks ahead, as the AVX-512 path

// Prefetch the bytes kPrefetchBlocks blocks ahead (the next group's follow this one's in memory).
inline void prefetch_ahead(const uint8_t* blk, int bytes, const uint16_t* d, const uint16_t* m) {
  const int64_t ahead = static_cast<int64_t>(kPrefetchBlocks);
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + ahead * bytes + off), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + ahead * kCols), _MM_HINT_T0);
  if (m) _mm_prefetch(reinterpret_cast<const char*>(m + ahead * kCols), _MM_HINT_T0);
}

void quantize_block(const float* xb, int8_t* q, float* scale, float* sum_f, int32_t* sum_i) {
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
  __m256i sum = _mm256_setzero_si256();
  alignas(32) int32_t qi[kBlock];
  for (int i = 0; i < 4; ++i) {
    __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(xv[i], inv), kRne));
    v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    sum = _mm256_add_epi32(sum, v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i), v);
  }
  for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(qi[i]);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  const int32_t s = _mm_cvtsi128_si32(s4);
  *scale = live ? amax / 127.f : 0.f;
  *sum_i = s;
  *sum_f = static_cast<float>(s);
}

void quantize(const float* x, const Activations& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t i = block_index(a, r, b);
      quantize_block(x + r * a.k + b * kBlock, a.q + i * kBlock, a.scale + i, a.sum_f + i, a.sum_i + i);
    }
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

inline void store_half_row(const Output& o, int64_t row, int64_t col, __m256 v) {
  if (o.f32) {
    _mm256_storeu_ps(o.f32 + row * o.stride + col, v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    store_row(o, row, col, tmp, 8);
  }
}

// R rows x 8 columns (half h of group g); same per-row float order as every other path.
template <int R>
void q4_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, int h, bool first) {
  const int64_t nb = w.blocks;
  const uint8_t* wq = w.q + g * nb * kQ4Bytes + 32 * h;
  const uint16_t* wd = w.d + g * nb * kCols + 8 * h;
  const uint16_t* wm = w.m + g * nb * kCols + 8 * h;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch_ahead(wq + b * kQ4Bytes, kQ4Bytes, wd + b * kCols, wm + b * kCols);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    // not unrolled: unrolled, GCC hoists all 32 products of a block ahead of their sums and
    // spills half of them to the stack (16 ymm registers), which cost more than the loop
#pragma GCC unroll 1
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * kQ4Bytes + 64 * i));
      const __m256i w_lo = _mm256_and_si256(v, nibble);
      const __m256i w_hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + row0 * a.k + (b * R + r) * kBlock;
#if YGG_VNNI
        s[r] = dot_u8s8(s[r], w_lo, broadcast4(xq + 4 * i));
        s[r] = dot_u8s8(s[r], w_hi, broadcast4(xq + 16 + 4 * i));
#else
        // the block's 8 maddubs pairs add up in int16 and widen once (madd_pairs below): each
        // pair is at most 2 * 15 * 127 in magnitude and 8 of them 30480 < 32767, so the int32
        // dot is exact, as VNNI's, for 8 multiply-adds fewer per block and row
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w_lo, broadcast4(xq + 4 * i)));
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w_hi, broadcast4(xq + 16 + 4 * i)));
#endif
      }
    }
#if !YGG_VNNI
    for (int r = 0; r < R; ++r) s[r] = _mm256_madd_epi16(s[r], _mm256_set1_epi16(1));
#endif
    const __m256 d = load_half8(wd + b * kCols), m = load_half8(wm + b * kCols);
    for (int r = 0; r < R; ++r) {
      const int64_t ab = row0 * nb + b * R + r;
      const __m256 part = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(s[r])),
                                        _mm256_mul_ps(m, _mm256_set1_ps(a.sum_f[ab])));
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(part, _mm256_set1_ps(a.scale[ab])));
    }
  }
  for (int r = 0; r < R; ++r) store_half_row(o, row0 + r, g * kCols + 8 * h, acc[r]);
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
  for (int r = 0; r < R; ++r) store_half_row(o, row0 + r, g * kCols + 8 * h, acc[r]);
}

template <template <int> class Tile, int R>
inline void run_tile(int64_t n, const Activations& a, const Weights& w, const Output& o, int64_t g,
                     int64_t row0, bool first) {
  if constexpr (R > 1) {
    if (n < R) return run_tile<Tile, R - 1>(n, a, w, o, g, row0, first);
  }
  for (int h = 0; h < 2; ++h) Tile<R>::run(a, w, o, g, row0, h, first && h == 0);
}

template <template <int> class Tile>
void run_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t row0 = 0; row0 < a.rows; row0 += kTile)
      run_tile<Tile, kTile>(a.rows - row0, a, w, o, g, row0, row0 == 0);
}

template <int R>
struct Q4Tile {
  static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, int h, bool first) {
    q4_tile<R>(a, w, o, g, r0, h, first);
  }
};
template <int R>
struct Q8Tile {
  static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, int h, bool first) {
    q8_tile<R>(a, w, o, g, r0, h, first);
  }
};

void q4_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  run_groups<Q4Tile>(a, w, o, g0, g1);
}

void q8_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  run_groups<Q8Tile>(a, w, o, g0, g1);
}

}  // namespace

const KernelTable YGG_TABLE = {YGG_TABLE_NAME, kTile, quantize, q4_groups, q8_groups};

}  // namespace ygg
