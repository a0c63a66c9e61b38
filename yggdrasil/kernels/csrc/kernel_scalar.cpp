// Portable fallback: plain loops, the same integer dots and the same float operations in the same
// order as the SIMD paths, so every path returns identical bits. Slow; correctness reference for
// the machine code, and the path of last resort on a non-x86 or pre-AVX2 CPU.
#include <cmath>

#include "q4_common.h"

namespace ygg {
namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float f;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, 4);
  return f;
}

void quantize_block(const float* xb, int8_t* q, float* scale, float* sum_f, int32_t* sum_i, int32_t* sum_lo) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
  const bool live = amax >= kTinyAmax;
  const float inv = live ? 127.f / amax : 0.f;
  int32_t s = 0, lo = 0;
  for (int i = 0; i < kBlock; ++i) {
    float v = __builtin_roundevenf(xb[i] * inv);
    v = v > 127.f ? 127.f : (v >= -127.f ? v : -127.f);  // NaN -> -127, as the SIMD paths
    q[i] = static_cast<int8_t>(v);
    s += static_cast<int32_t>(v);
    if (i == kBlock / 2 - 1) lo = s;
  }
  *scale = live ? amax / 127.f : 0.f;
  *sum_i = s;
  *sum_lo = lo;
  *sum_f = static_cast<float>(s);
}

// One (group, block) of 4-bit codes -> codes[column][k]. Byte 64*i + 4*c + t holds k = 4i + t in
// its low nibble and k = 16 + 4i + t in its high nibble (see pack.py).
void unpack_q4(const uint8_t* blk, uint8_t codes[kCols][kBlock]) {
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kCols; ++c)
      for (int t = 0; t < 4; ++t) {
        const uint8_t byte = blk[64 * i + 4 * c + t];
        codes[c][4 * i + t] = byte & 0x0F;
        codes[c][16 + 4 * i + t] = byte >> 4;
      }
}

// Every kind's one loop: per (group, row), the blocks in order, each kind's block adding its 16
// columns' parts into acc (acc = acc + part * s, as reference.py).
template <class AddBlock>
void each_block(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1, AddBlock add_block) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t row = 0; row < a.rows; ++row) {
      float acc[kCols] = {};
      for (int64_t b = 0; b < w.blocks; ++b)
        add_block(g * w.blocks + b, g * (w.blocks / kSuperBlocks) + b / kSuperBlocks, block_index(a, row, b), acc);
      store_row(o, row, g * kCols, acc, kCols);
    }
  }
}

// The 4-bit kinds: the same codes and integer dots, each kind's scales (q4_common.h, reference.py).
template <Q4Kind kKind>
void q4_family(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  each_block(a, w, o, g0, g1, [&](int64_t gb, int64_t gs, int64_t ab, float* acc) {
    uint8_t codes[kCols][kBlock];
    unpack_q4(w.q + gb * kQ4Bytes, codes);
    const int8_t* xq = a.q + ab * kBlock;
    const float sx = a.scale[ab];
    for (int c = 0; c < kCols; ++c) {
      int32_t dot = 0;
      for (int t = 0; t < kBlock; ++t) dot += codes[c][t] * xq[t];
      float part;
      if constexpr (kKind == Q4Kind::kQ41) {
        part = half_to_float(w.d[gb * kCols + c]) * static_cast<float>(dot) +
               half_to_float(w.m[gb * kCols + c]) * a.sum_f[ab];
      } else if constexpr (kKind == Q4Kind::kQ40) {
        part = half_to_float(w.d[gb * kCols + c]) * static_cast<float>(dot - 8 * a.sum_i[ab]);
      } else {
        const int32_t sc = w.sc[gb * kCols + c], mn = w.mn[gb * kCols + c];
        part = half_to_float(w.d[gs * kCols + c]) * static_cast<float>(sc * dot) -
               half_to_float(w.m[gs * kCols + c]) * static_cast<float>(mn * a.sum_i[ab]);
      }
      acc[c] = acc[c] + part * sx;
    }
  });
}

void q4_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  q4_family<Q4Kind::kQ41>(a, w, o, g0, g1);
}
void q4_0_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  q4_family<Q4Kind::kQ40>(a, w, o, g0, g1);
}
void q4_k_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  q4_family<Q4Kind::kQ4K>(a, w, o, g0, g1);
}

// q6_k: low nibbles as q4's, the high 2 bits from the qh plane (q4_common.h); two scales a block.
void q6_k_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  each_block(a, w, o, g0, g1, [&](int64_t gb, int64_t gs, int64_t ab, float* acc) {
    uint8_t codes[kCols][kBlock];
    unpack_q4(w.q + gb * kQ4Bytes, codes);
    const uint8_t* qh = w.qh + gb * kQ6HighBytes;
    for (int j = 0; j < 2; ++j)
      for (int c = 0; c < kCols; ++c)
        for (int t = 0; t < 4; ++t) {
          const uint8_t h = qh[64 * j + 4 * c + t];
          codes[c][8 * j + t] |= (h & 3) << 4;
          codes[c][16 + 8 * j + t] |= ((h >> 2) & 3) << 4;
          codes[c][8 * j + 4 + t] |= ((h >> 4) & 3) << 4;
          codes[c][16 + 8 * j + 4 + t] |= ((h >> 6) & 3) << 4;
        }
    const int8_t* xq = a.q + ab * kBlock;
    const int32_t lo_sum = a.sum_lo[ab], hi_sum = a.sum_i[ab] - a.sum_lo[ab];
    const int8_t* sc = reinterpret_cast<const int8_t*>(w.sc) + gb * 2 * kCols;
    for (int c = 0; c < kCols; ++c) {
      int32_t lo = 0, hi = 0;
      for (int t = 0; t < kBlock / 2; ++t) lo += codes[c][t] * xq[t];
      for (int t = kBlock / 2; t < kBlock; ++t) hi += codes[c][t] * xq[t];
      const int32_t isum = sc[c] * (lo - 32 * lo_sum) + sc[kCols + c] * (hi - 32 * hi_sum);
      const float part = half_to_float(w.d[gs * kCols + c]) * static_cast<float>(isum);
      acc[c] = acc[c] + part * a.scale[ab];
    }
  });
}

// 8-bit: byte 64*j + 4*c + t holds k = 4j + t of column c.
void q8_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  each_block(a, w, o, g0, g1, [&](int64_t gb, int64_t, int64_t ab, float* acc) {
    const int8_t* blk = reinterpret_cast<const int8_t*>(w.q + gb * kQ8Bytes);
    const int8_t* xq = a.q + ab * kBlock;
    const float sx = a.scale[ab];
    for (int c = 0; c < kCols; ++c) {
      int32_t dot = 0;
      for (int t = 0; t < kBlock; ++t) dot += blk[64 * (t / 4) + 4 * c + t % 4] * xq[t];
      const float part = half_to_float(w.d[gb * kCols + c]) * static_cast<float>(dot);
      acc[c] = acc[c] + part * sx;
    }
  });
}

}  // namespace

const KernelTable kScalarTable = {"scalar", 1, quantize_rows<quantize_block>, q4_groups,
                                  q4_0_groups, q4_k_groups, q6_k_groups, q8_groups};

}  // namespace ygg
