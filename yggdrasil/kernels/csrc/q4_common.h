// Shared by the op glue (q4_linear.cpp) and the per-ISA kernel files. Kept free of torch headers:
// each kernel file is compiled under its own `#pragma GCC target`, and an inline torch function
// instantiated there could be merged (COMDAT) with the baseline copy and run AVX-512 code on a
// CPU without it.
#pragma once
#include <cstdint>
#include <cstring>

namespace ygg {

constexpr int kBlock = 32;                        // weights per block along K (one scale each)
constexpr int kCols = 16;                         // output columns interleaved per group
constexpr int kQ4Bytes = kCols * kBlock / 2;      // packed bytes per (group, block), 4-bit
constexpr int kQ8Bytes = kCols * kBlock;          // packed bytes per (group, block), 8-bit
constexpr float kTinyAmax = 1e-30f;               // blocks below this quantize to zero (127/amax stays finite)

// Activation rows quantized to int8 per block of 32 (symmetric, scale = amax/127), stored tile by
// tile so a micro-kernel reads one tile's rows of one block from one place: rows are cut into
// tiles of `tile` rows (the last may be shorter, R rows), and (row, block) sits at block index
//   tile_start * blocks + block * R + (row - tile_start)
// for the int8 codes (x 32 bytes) and for the per-block numbers. tile = 1 is plain row-major.
struct Activations {
  int8_t* q;          // [rows * k]
  float* scale;       // [rows * blocks]
  float* sum_f;       // [rows * blocks] float(sum of q): the 4-bit min term
  int32_t* sum_i;     // [rows * blocks] sum of q: the 8-bit path's +128 correction
  int64_t rows, k, blocks, tile;
};

static inline int64_t block_index(const Activations& a, int64_t row, int64_t b) {
  const int64_t start = row - row % a.tile;
  const int64_t rows_here = a.rows - start < a.tile ? a.rows - start : a.tile;
  return start * a.blocks + b * rows_here + (row - start);
}

// Packed weight: groups of 16 columns, each [blocks][bytes] contiguous; d and m as fp16 bits
// laid out [groups][blocks][16].
struct Weights {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;      // null for the 8-bit op
  int64_t groups, blocks;
};

// Row-major [rows, stride] output; exactly one of f32 / bf16 is set.
struct Output {
  float* f32;
  uint16_t* bf16;
  int64_t stride;
};

// Quantizes rows [r0, r1) of x [rows, k] (row-major float32) into a.
using QuantizeFn = void (*)(const float* x, const Activations& a, int64_t r0, int64_t r1);
// Computes rows [row0, row0 + rows) x groups [g0, g1) of the output.
using GroupsFn = void (*)(const Activations& a, const Weights& w, const Output& o, int64_t g0,
                          int64_t g1);

struct KernelTable {
  const char* name;
  int tile;  // activation rows a micro-kernel takes at once (Activations::tile)
  QuantizeFn quantize;
  GroupsFn q4;
  GroupsFn q8;
};

extern const KernelTable kScalarTable;
extern const KernelTable kAvx2Table;
extern const KernelTable kAvxVnniTable;
extern const KernelTable kAvx512VnniTable;

// Helpers below are static: each kernel file gets its own copy built for its own ISA.

static inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// fp32 -> bf16 bits, round to nearest even, as c10::BFloat16 and Tensor.to(torch.bfloat16) do.
static inline uint16_t bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_row(const Output& o, int64_t row, int64_t col, const float* v, int n) {
  if (o.f32) {
    std::memcpy(o.f32 + row * o.stride + col, v, sizeof(float) * n);
  } else {
    for (int i = 0; i < n; ++i) o.bf16[row * o.stride + col + i] = bf16_bits(v[i]);
  }
}

}  // namespace ygg
