// The pass structure of yggdrasil::attention, shared by every ISA file: each includes this inside
// its anonymous namespace after defining its primitives
//   score_block(q, k, key_stride, chunks, scale, bits, out16)  16 scores, -inf where bits is 0
//   row_max(p, blocks, nb)                                     max over the visited blocks
//   exp_row(p, blocks, nb, m)                                  p = exp_fixed(p - m)
//   accumulate(chunks, v, v_stride, s0, s1, p, acc, rows)      acc += p[s] * v[s], s in order, p != 0
//   finish_row(acc, l, d, out)                                 out = acc / l
// so it is compiled once per ISA (never shared code that could run the wrong instructions).
//
// Why a row's bits never depend on its item: rows only share loads of K and V. Each row's scores,
// max, weights, weight sum and V sum are its own, over keys in increasing order. An item skips the
// key blocks no row of it may attend; for a row those are blocks whose weights are all exactly 0,
// and a 0 weight is never added (V) or adds +0 to a sum that is >= +0 (denominator): no change.

inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

struct ItemRows {
  int64_t n = 0;
  const float* q[kMaxItemRows];
  const uint8_t* mask[kMaxItemRows];     // the row's mask over keys 0..S-1
  float* out[kMaxItemRows];
  float* p[kMaxItemRows];                // its scores, then its weights, [blocks * 16]
  float* acc[kMaxItemRows];              // its V sum [d]
  float l[kMaxItemRows];                 // its softmax denominator; 0: the row attends no key
};

// The rows of work item `item` and their pointers into the operands and the scratch.
inline void item_rows(const AttnArgs& a, int64_t item, float* scores, float* acc, ItemRows& rows,
                      const float** kbase, const float** vbase) {
  const int64_t group = a.heads / a.kv_heads, total = group * a.t, stride = attn_blocks(a) * kKeyBlock;
  const int64_t bg = item / a.chunks, r0 = (item % a.chunks) * a.chunk_rows;
  const int64_t b = bg / a.kv_heads, g = bg % a.kv_heads;
  *kbase = a.k + b * a.k_sb + g * a.k_sh;
  *vbase = a.v + b * a.v_sb + g * a.v_sh;
  rows.n = min64(total, r0 + a.chunk_rows) - r0;
  for (int64_t r = 0; r < rows.n; ++r) {
    const int64_t t = (r0 + r) / group, h = g * group + (r0 + r) % group, row = (b * a.heads + h) * a.t + t;
    rows.q[r] = a.q + row * a.d;
    rows.out[r] = a.out + row * a.d;
    rows.mask[r] = a.mask + b * a.m_sb + t * a.m_st;
    rows.p[r] = scores + r * stride;
    rows.acc[r] = acc + r * a.d;
  }
}

// The key blocks some row of the item may attend, in increasing order; returns their count.
inline int64_t visited_blocks(const AttnArgs& a, const ItemRows& rows, int32_t* blocks) {
  int64_t n = 0;
  for (int64_t kb = 0; kb < attn_blocks(a); ++kb) {
    const int64_t s0 = kb * kKeyBlock;
    const int len = static_cast<int>(min64(kKeyBlock, a.s - s0));
    for (int64_t r = 0; r < rows.n; ++r) {
      if (r > 0 && rows.mask[r] == rows.mask[r - 1]) continue;  // heads of one t share a mask row
      if (mask_any(rows.mask[r] + s0, len)) {
        blocks[n++] = static_cast<int32_t>(kb);
        break;
      }
    }
  }
  return n;
}

// Pass 1: every row's scores over the visited blocks. A block's 16 keys come from memory once and
// serve all rows from L1; a partial last block is scored from a zero-padded copy (no reads past S).
inline void score_rows(const AttnArgs& a, const ItemRows& rows, const float* kbase, const int32_t* blocks,
                       int64_t nb, float* tail) {
  const int64_t chunks = a.d / kLanes;
  for (int64_t i = 0; i < nb; ++i) {
    const int64_t s0 = static_cast<int64_t>(blocks[i]) * kKeyBlock;
    const int len = static_cast<int>(min64(kKeyBlock, a.s - s0));
    const float* keys = kbase + s0 * a.k_ss;
    int64_t key_stride = a.k_ss;
    if (len < kKeyBlock) {
      for (int j = 0; j < kKeyBlock; ++j) {
        if (j < len) std::memcpy(tail + j * a.d, keys + j * a.k_ss, sizeof(float) * a.d);
        else std::memset(tail + j * a.d, 0, sizeof(float) * a.d);
      }
      keys = tail;
      key_stride = a.d;
    }
    for (int64_t r = 0; r < rows.n; ++r) {
      const uint32_t bits = mask_bits(rows.mask[r] + s0, len);
      float* out = rows.p[r] + s0;
      if (bits == 0) {
        for (int j = 0; j < kKeyBlock; ++j) out[j] = -__builtin_inff();
      } else {
        score_block(rows.q[r], keys, key_stride, chunks, a.scale, bits, out);
      }
    }
  }
}

// A row's weights summed one by one in increasing key order, from +0. Not in lanes: a lane is a
// key's slot mod 16, and a tree verify holds a path's keys at other slots than a decode (gaps
// between them), so lane sums would round differently; a sequence adds the same nonzero weights
// in the same order wherever they sit (a masked weight is +0 and adds nothing).
inline float ordered_sum(const float* p, const int32_t* blocks, int64_t nb) {
  float l = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const float* block = p + blocks[i] * kKeyBlock;
    for (int j = 0; j < kKeyBlock; ++j) l += block[j];
  }
  return l;
}

// Pass 2: per row, weights = exp_fixed(score - max) and their sum; a row with no key gets zeros.
inline void softmax_rows(ItemRows& rows, const int32_t* blocks, int64_t nb) {
  for (int64_t r = 0; r < rows.n; ++r) {
    const float m = row_max(rows.p[r], blocks, nb);
    if (m == -__builtin_inff()) {
      for (int64_t i = 0; i < nb; ++i) std::memset(rows.p[r] + blocks[i] * kKeyBlock, 0, sizeof(float) * kKeyBlock);
      rows.l[r] = 0.f;
    } else {
      exp_row(rows.p[r], blocks, nb, m);
      rows.l[r] = ordered_sum(rows.p[r], blocks, nb);
    }
  }
}

// Pass 3: V sums over runs of up to kRunBlocks consecutive visited blocks, so a run of V rows
// comes from memory once and serves every row of the item from L1.
inline void value_rows(const AttnArgs& a, const ItemRows& rows, const float* vbase, const int32_t* blocks,
                       int64_t nb) {
  for (int64_t r = 0; r < rows.n; ++r) std::memset(rows.acc[r], 0, sizeof(float) * a.d);
  for (int64_t i = 0; i < nb;) {
    int64_t j = i;
    while (j + 1 < nb && blocks[j + 1] == blocks[j] + 1 && j + 1 - i < kRunBlocks) ++j;
    const int64_t s0 = static_cast<int64_t>(blocks[i]) * kKeyBlock;
    const int64_t s1 = min64(a.s, (static_cast<int64_t>(blocks[j]) + 1) * kKeyBlock);
    accumulate(a.d / kLanes, vbase, a.v_ss, s0, s1, rows.p, rows.acc, rows.n);
    i = j + 1;
  }
}

void attention_items(const AttnArgs& a, int64_t i0, int64_t i1, float* scratch) {
  const int64_t nb_all = attn_blocks(a);
  float* scores = scratch;
  float* acc = scores + a.chunk_rows * nb_all * kKeyBlock;
  float* tail = acc + a.chunk_rows * a.d;
  int32_t* blocks = reinterpret_cast<int32_t*>(tail + kKeyBlock * a.d);
  ItemRows rows;
  for (int64_t item = i0; item < i1; ++item) {
    const float *kbase, *vbase;
    item_rows(a, item, scores, acc, rows, &kbase, &vbase);
    const int64_t nb = visited_blocks(a, rows, blocks);
    score_rows(a, rows, kbase, blocks, nb, tail);
    softmax_rows(rows, blocks, nb);
    value_rows(a, rows, vbase, blocks, nb);
    for (int64_t r = 0; r < rows.n; ++r) finish_row(rows.acc[r], rows.l[r], a.d, rows.out[r]);
  }
}
