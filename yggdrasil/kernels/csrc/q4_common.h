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
constexpr int kQ6HighBytes = kCols * kBlock / 4;  // q6_k: the 2 high bits per (group, block)
constexpr int kQ8Bytes = kCols * kBlock;          // packed bytes per (group, block), 8-bit
constexpr int kSuperBlocks = 8;                   // blocks per K-quant super-block (256 weights)
constexpr int kPrefetchBlocks = 16;               // weight blocks prefetched ahead (~5 KB): DRAM latency at the compute rate
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
  int32_t* sum_i;     // [rows * blocks] sum of q: the 8-bit path's +128 correction, q4_0's offset
  int32_t* sum_lo;    // [rows * blocks] sum of the block's first 16 codes: q6_k's per-half offset
  int64_t rows, k, blocks, tile;
};

static inline int64_t block_index(const Activations& a, int64_t row, int64_t b) {
  const int64_t start = row - row % a.tile;
  const int64_t rows_here = a.rows - start < a.tile ? a.rows - start : a.tile;
  return start * a.blocks + b * rows_here + (row - start);
}

// Packed weight: groups of 16 columns, each [blocks][bytes] contiguous (pack.py). What the other
// fields hold depends on the block kind (reference.py has each kind's arithmetic):
//   q4    d, m fp16 [groups][blocks][16]                       w = d*q + m        (GGUF Q4_1)
//   q4_0  d fp16 [groups][blocks][16]                          w = d*(q - 8)      (GGUF Q4_0)
//   q4_k  d, m fp16 [groups][blocks/8][16] (d, dmin of a super-block), sc, mn uint8
//         [groups][blocks][16] (6-bit)                         w = d*sc*q - dmin*mn (GGUF Q4_K)
//   q6_k  qh [groups][blocks][128] (high 2 bits), d fp16 [groups][blocks/8][16], sc int8
//         [groups][blocks][2][16] (per 16 weights)             w = d*sc*(q - 32)  (GGUF Q6_K)
//   q8    d fp16 [groups][blocks][16], q int8                  w = d*q            (GGUF Q8_0)
struct Weights {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m = nullptr;
  const uint8_t* sc = nullptr;
  const uint8_t* mn = nullptr;
  const uint8_t* qh = nullptr;
  int64_t groups = 0, blocks = 0;
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
  GroupsFn q4_0;
  GroupsFn q4_k;
  GroupsFn q6_k;
  GroupsFn q8;
};

enum class Q4Kind { kQ41, kQ40, kQ4K };  // the 4-bit kinds share codes and dots, not scales

// q6_k's high-bit plane: byte 64*j + 4*c + t of a (group, block) holds the top 2 bits of k = 8j+t
// (bits 0-1), 16+8j+t (2-3), 8j+4+t (4-5) and 16+8j+4+t (6-7) of column c, so that after a shift
// and a mask they sit at bits 4-5 of the byte whose low nibble (q4 layout) holds that k's low bits.

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

// Prefetch (to L1) a block's weight bytes and its scales kPrefetchBlocks blocks ahead: the next
// group's blocks follow this one's in memory.
static inline void prefetch_ahead(const uint8_t* blk, int bytes, const uint16_t* d, const uint16_t* m) {
  const int64_t ahead = static_cast<int64_t>(kPrefetchBlocks);
  for (int off = 0; off < bytes; off += 64) __builtin_prefetch(blk + ahead * bytes + off, 0, 3);
  __builtin_prefetch(d + ahead * kCols, 0, 3);
  if (m) __builtin_prefetch(m + ahead * kCols, 0, 3);
}

// q6_k's two planes of block b (low codes, high bits) and its super-block's scales.
static inline void prefetch_q6(const uint8_t* wq, const uint8_t* wh, const uint16_t* wd, int64_t b) {
  prefetch_ahead(wq + b * kQ4Bytes, kQ4Bytes, wd + (b / kSuperBlocks) * kCols, nullptr);
  prefetch_ahead(wh + b * kQ6HighBytes, kQ6HighBytes, wd, nullptr);
}

// One register of a tile row (a GCC vector of floats: __m256, __m512) into o at (row, col); the
// copies fold into one store at -O3.
template <class V>
static inline void store_lanes(const Output& o, int64_t row, int64_t col, V v) {
  constexpr int kN = sizeof(V) / sizeof(float);
  float lanes[kN];
  std::memcpy(lanes, &v, sizeof v);
  store_row(o, row, col, lanes, kN);
}

// Every kernel file's activation quantizer: its own quantize_block over each row's blocks.
template <auto kQuantizeBlock>
void quantize_rows(const float* x, const Activations& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t i = block_index(a, r, b);
      kQuantizeBlock(x + r * a.k + b * kBlock, a.q + i * kBlock, a.scale + i, a.sum_f + i, a.sum_i + i,
                     a.sum_lo + i);
    }
}

// The SIMD files' one tile driver. Tile<R>::run(a, w, o, g, row0, first) computes activation
// rows [row0, row0 + R) of column group g; a tile of n <= kRows rows runs the R = n
// instantiation (the layout and the loops match its size).
template <template <int> class Tile, int R>
inline void run_tile(int64_t n, const Activations& a, const Weights& w, const Output& o, int64_t g, int64_t row0,
                     bool first) {
  if constexpr (R > 1) {
    if (n < R) return run_tile<Tile, R - 1>(n, a, w, o, g, row0, first);
  }
  Tile<R>::run(a, w, o, g, row0, first);
}

// Row tiles inside column groups: a group's weights come from memory once, then from L1/L2.
template <template <int> class Tile, int kRows>
void run_groups(const Activations& a, const Weights& w, const Output& o, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t row0 = 0; row0 < a.rows; row0 += kRows)
      run_tile<Tile, kRows>(a.rows - row0, a, w, o, g, row0, row0 == 0);
}

// A SIMD file's table: its quantizer and each kind's Tile under the one driver.
template <int kRows, auto kQuantizeBlock, template <int> class Q41, template <int> class Q40,
          template <int> class Q4K, template <int> class Q6K, template <int> class Q8>
constexpr KernelTable tile_table(const char* name) {
  return {name, kRows, quantize_rows<kQuantizeBlock>, run_groups<Q41, kRows>, run_groups<Q40, kRows>,
          run_groups<Q4K, kRows>, run_groups<Q6K, kRows>, run_groups<Q8, kRows>};
}

}  // namespace ygg
