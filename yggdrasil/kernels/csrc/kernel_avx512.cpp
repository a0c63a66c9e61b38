// AVX512-VNNI path: zmm vpdpbusd, 16 output columns per vector. Whole file built for that ISA;
// the glue calls it only after __builtin_cpu_supports says the CPU has it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "q4_common.h"

namespace ygg {
namespace {

// Activation rows per weight unpack. Measured on Zen 5 (16 rows at a time, weights hot): 16 rows
// ~5 % faster per row than 8, whose rate equals 4's and 12's.
constexpr int kTile = 16;

void quantize_block(const float* xb, int8_t* q, float* scale, float* sum_f, int32_t* sum_i, int32_t* sum_lo) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const bool live = amax >= kTinyAmax;
  const __m512 inv = _mm512_set1_ps(live ? 127.f / amax : 0.f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, inv), kRne);
  __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, inv), kRne);
  q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
  q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  const int32_t first = _mm512_reduce_add_epi32(q0);
  const int32_t s = first + _mm512_reduce_add_epi32(q1);
  *scale = live ? amax / 127.f : 0.f;
  *sum_i = s;
  *sum_lo = first;
  *sum_f = static_cast<float>(s);
}

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 8 weight vectors of one (group, block): lane c, byte t of vector j is k = 4j + t of column c.
inline void unpack_q4(const uint8_t* blk, __m512i wv[8]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(blk + 64 * i);
    wv[i] = _mm512_and_si512(v, nibble);
    wv[i + 4] = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
  }
}

// int32 dot of 16 columns with one row's 32 codes (xq), added to init. Two chains for latency.
inline __m512i dot_block(const __m512i wv[8], const int8_t* xq, __m512i init) {
  __m512i s0 = init, s1 = _mm512_setzero_si512();
  for (int j = 0; j < 8; j += 2) {
    s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
    s1 = _mm512_dpbusd_epi32(s1, wv[j + 1], _mm512_set1_epi32(load_i32(xq + 4 * j + 4)));
  }
  return _mm512_add_epi32(s0, s1);
}

// R rows (one activation tile starting at row0) x 16 columns of group g. Each block's weight vectors
// are unpacked once and used by every row; per row and block the kind's part (reference.py) is
// added as acc += part * sx, in the reference's order exactly. `first`: the first tile over this
// group streams it from memory.
template <Q4Kind kKind, int R>
void q4_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, bool first) {
  const int64_t nb = w.blocks, ns = nb / kSuperBlocks;
  const uint8_t* wq = w.q + g * nb * kQ4Bytes;
  const bool per_block = kKind != Q4Kind::kQ4K;  // q4_k's d and dmin are per super-block
  const uint16_t* wd = w.d + g * (per_block ? nb : ns) * kCols;
  const uint16_t* wm = kKind == Q4Kind::kQ40 ? nullptr : w.m + g * (per_block ? nb : ns) * kCols;
  const int8_t* xq = a.q + row0 * a.k;          // this tile: [block][R][32]
  const float* sx = a.scale + row0 * nb;        // [block][R]
  const float* fs = a.sum_f + row0 * nb;
  const int32_t* si = a.sum_i + row0 * nb;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t p = per_block ? b : b / kSuperBlocks;  // where this block's d (and m) are
    if (first) prefetch_ahead(wq + b * kQ4Bytes, kQ4Bytes, wd + p * kCols, wm ? wm + p * kCols : nullptr);
    __m512i wv[8];
    unpack_q4(wq + b * kQ4Bytes, wv);
    const __m512 d = load_half16(wd + p * kCols);
    if constexpr (kKind == Q4Kind::kQ41) {
      const __m512 m = load_half16(wm + p * kCols);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(dot_block(wv, xq + (b * R + r) * kBlock, _mm512_setzero_si512()));
        const __m512 part = _mm512_add_ps(_mm512_mul_ps(d, dot), _mm512_mul_ps(m, _mm512_set1_ps(fs[b * R + r])));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(part, _mm512_set1_ps(sx[b * R + r])));
      }
    } else if constexpr (kKind == Q4Kind::kQ40) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {  // dot(q - 8, x) = dot(q, x) - 8 * sum(x): the sum is the start
        const __m512i init = _mm512_set1_epi32(-8 * si[b * R + r]);
        const __m512 part = _mm512_mul_ps(d, _mm512_cvtepi32_ps(dot_block(wv, xq + (b * R + r) * kBlock, init)));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(part, _mm512_set1_ps(sx[b * R + r])));
      }
    } else {
      const __m512 dmin = load_half16(wm + p * kCols);
      const __m128i* sub = reinterpret_cast<const __m128i*>(w.sc + (g * nb + b) * kCols);
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(sub));
      const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          w.mn + (g * nb + b) * kCols)));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512i dot = dot_block(wv, xq + (b * R + r) * kBlock, _mm512_setzero_si512());
        const __m512i msum = _mm512_mullo_epi32(mn, _mm512_set1_epi32(si[b * R + r]));
        const __m512 part = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_mullo_epi32(sc, dot))),
                                          _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum)));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(part, _mm512_set1_ps(sx[b * R + r])));
      }
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(o, row0 + r, g * kCols, acc[r]);
}

// q6_k: the q4 layout's nibbles are the low 4 bits, the qh plane adds bits 4-5 (q4_common.h);
// each half of a block has its own scale, so each half's dot starts at -32 * (its sum of codes).
template <int R>
void q6_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, bool first) {
  const int64_t nb = w.blocks, ns = nb / kSuperBlocks;
  const uint8_t* wq = w.q + g * nb * kQ4Bytes;
  const uint8_t* wh = w.qh + g * nb * kQ6HighBytes;
  const uint16_t* wd = w.d + g * ns * kCols;
  const int8_t* xq = a.q + row0 * a.k;
  const float* sx = a.scale + row0 * nb;
  const int32_t* si = a.sum_i + row0 * nb;
  const int32_t* sl = a.sum_lo + row0 * nb;
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch_q6(wq, wh, wd, b);
    __m512i lo[4], hi[4];  // k 0..15 and 16..31: 4 vectors of 4 k each
    for (int j = 0; j < 2; ++j) {
      const __m512i h = _mm512_loadu_si512(wh + b * kQ6HighBytes + 64 * j);
      const __m512i v0 = _mm512_loadu_si512(wq + b * kQ4Bytes + 128 * j);
      const __m512i v1 = _mm512_loadu_si512(wq + b * kQ4Bytes + 128 * j + 64);
      lo[2 * j] = _mm512_or_si512(_mm512_and_si512(v0, nibble), _mm512_and_si512(_mm512_slli_epi32(h, 4), top));
      hi[2 * j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v0, 4), nibble),
                                  _mm512_and_si512(_mm512_slli_epi32(h, 2), top));
      lo[2 * j + 1] = _mm512_or_si512(_mm512_and_si512(v1, nibble), _mm512_and_si512(h, top));
      hi[2 * j + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v1, 4), nibble),
                                      _mm512_and_si512(_mm512_srli_epi32(h, 2), top));
    }
    const int8_t* sub = reinterpret_cast<const int8_t*>(w.sc) + (g * nb + b) * 2 * kCols;
    const __m512i sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
    const __m512i sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kCols)));
    const __m512 d = load_half16(wd + (b / kSuperBlocks) * kCols);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + (b * R + r) * kBlock;
      const int32_t low = sl[b * R + r], high = si[b * R + r] - low;
      __m512i s_lo = _mm512_set1_epi32(-32 * low), s_hi = _mm512_set1_epi32(-32 * high);
      for (int i = 0; i < 4; ++i) {
        s_lo = _mm512_dpbusd_epi32(s_lo, lo[i], _mm512_set1_epi32(load_i32(x + 4 * i)));
        s_hi = _mm512_dpbusd_epi32(s_hi, hi[i], _mm512_set1_epi32(load_i32(x + 16 + 4 * i)));
      }
      const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(sc_lo, s_lo), _mm512_mullo_epi32(sc_hi, s_hi));
      const __m512 part = _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(part, _mm512_set1_ps(sx[b * R + r])));
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(o, row0 + r, g * kCols, acc[r]);
}

// 8-bit: weights stored signed; xor 0x80 makes them the unsigned operand (w + 128) and the
// accumulator starts at -128 * sum(xq), so the int32 dot is exactly sum(w * xq).
template <int R>
void q8_tile(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0, bool first) {
  const int64_t nb = w.blocks;
  const uint8_t* wq = w.q + g * nb * kQ8Bytes;
  const uint16_t* wd = w.d + g * nb * kCols;
  const int8_t* xq = a.q + row0 * a.k;
  const float* sx = a.scale + row0 * nb;
  const int32_t* si = a.sum_i + row0 * nb;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch_ahead(wq + b * kQ8Bytes, kQ8Bytes, wd + b * kCols, nullptr);
    __m512i wv[8];
    for (int j = 0; j < 8; ++j) wv[j] = _mm512_xor_si512(_mm512_loadu_si512(wq + b * kQ8Bytes + 64 * j), flip);
    const __m512 d = load_half16(wd + b * kCols);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i init = _mm512_set1_epi32(-128 * si[b * R + r]);
      const __m512 part = _mm512_mul_ps(d, _mm512_cvtepi32_ps(dot_block(wv, xq + (b * R + r) * kBlock, init)));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(part, _mm512_set1_ps(sx[b * R + r])));
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(o, row0 + r, g * kCols, acc[r]);
}

template <Q4Kind kKind>
struct Q4Of {
  template <int R>
  struct Tile {
    static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, bool first) {
      q4_tile<kKind, R>(a, w, o, g, r0, first);
    }
  };
};
template <int R>
struct Q6Tile {
  static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, bool first) {
    q6_tile<R>(a, w, o, g, r0, first);
  }
};
template <int R>
struct Q8Tile {
  static void run(const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t r0, bool first) {
    q8_tile<R>(a, w, o, g, r0, first);
  }
};

}  // namespace

const KernelTable kAvx512VnniTable =
    tile_table<kTile, quantize_block, Q4Of<Q4Kind::kQ41>::Tile, Q4Of<Q4Kind::kQ40>::Tile, Q4Of<Q4Kind::kQ4K>::Tile,
               Q6Tile, Q8Tile>("avx512vnni");

}  // namespace ygg
