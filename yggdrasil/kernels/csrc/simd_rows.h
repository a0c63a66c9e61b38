// The row loops the SIMD float files share; each includes this inside its anonymous namespace
// after defining
//   accumulate_group<NC, RR>(v, v_stride, s0, s1, p, acc)  RR rows' V sums, NC vectors of 16 floats
//   v_rows(NC)                                            how many rows' sums its registers hold
//   silu_lanes(g, u, o)                                   kSiluLanes elements of silu(g) * u
// so each is compiled once per ISA (never shared code that could run the wrong instructions).

// Attention's pass 3: a head dim of `chunks` x 16 runs its own instantiation, rows in groups of
// v_rows(NC), the rest one at a time.
template <int NC>
void accumulate_rows(const float* v, int64_t v_stride, int64_t s0, int64_t s1, const float* const* p,
                     float* const* acc, int64_t rows) {
  constexpr int kGroup = v_rows(NC);
  int64_t r = 0;
  for (; r + kGroup <= rows; r += kGroup) accumulate_group<NC, kGroup>(v, v_stride, s0, s1, p + r, acc + r);
  for (; r < rows; ++r) accumulate_group<NC, 1>(v, v_stride, s0, s1, p + r, acc + r);
}

void accumulate(int64_t chunks, const float* v, int64_t v_stride, int64_t s0, int64_t s1, const float* const* p,
                float* const* acc, int64_t rows) {
  switch (chunks) {
#define YGG_CASE(NC) \
  case NC:           \
    return accumulate_rows<NC>(v, v_stride, s0, s1, p, acc, rows);
    YGG_CASE(1) YGG_CASE(2) YGG_CASE(3) YGG_CASE(4) YGG_CASE(5) YGG_CASE(6) YGG_CASE(7) YGG_CASE(8)
    YGG_CASE(9) YGG_CASE(10) YGG_CASE(11) YGG_CASE(12) YGG_CASE(13) YGG_CASE(14) YGG_CASE(15) YGG_CASE(16)
#undef YGG_CASE
    default:
      return;  // the glue admits head dims 16..256 only
  }
}

// kSiluLanes elements at a time, the row's tail element by element: silu_mul_one is the same
// operations.
void silu_mul_rows(const float* gu, float* out, int64_t f, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    float* o = out + r * f;
    int64_t i = 0;
    for (; i + kSiluLanes <= f; i += kSiluLanes) silu_lanes(g + i, u + i, o + i);
    for (; i < f; ++i) o[i] = silu_mul_one(g[i], u[i]);
  }
}
