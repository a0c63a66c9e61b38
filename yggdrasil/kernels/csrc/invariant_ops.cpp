// yggdrasil::rms_norm / attention: float32 ops whose every output row is computed in one fixed
// order (float_common.h), so a row's bits do not depend on how many rows the call has, where the
// row sits among them, or how many threads run it. This file is the torch glue: schemas, checks,
// ISA choice, the split into work items, and the AOTInductor C shims. Kernels: float_*.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "float_common.h"

namespace ygg {

std::string kernel_isa();  // q4_linear.cpp: the q4 path in use ($YGGDRASIL_KERNEL_ISA or the best)

namespace {

constexpr int64_t kRmsGrain = 16384;  // elements per thread chunk: fewer run on one thread
constexpr int64_t kMaxHeadDim = 256;  // 16 zmm of V sums per row

// The float path that goes with the q4 path in use, so one variable forces both; a path this
// build lacks (its file did not compile here) falls to the next one down: all give the same bits.
const FloatKernels& float_kernels() {
  const std::string isa = kernel_isa();
#ifdef YGG_HAS_FLOAT_AVX512
  if (isa == "avx512vnni") return kFloatAvx512;
#endif
#ifdef YGG_HAS_FLOAT_AVX2
  if (isa == "avx512vnni" || isa == "avxvnni" || isa == "avx2") return kFloatAvx2;
#endif
  return kFloatScalar;
}

void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// A view whose last dim is contiguous keeps its other strides (a KV-cache prefix is not copied).
at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "yggdrasil::rms_norm";
  check_tensor(op, "x", x, at::kFloat);
  check_tensor(op, "weight", weight, at::kFloat);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have a feature dimension, got a 0-d tensor");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, op, ": weight has shape ", weight.sizes(), "; expected [",
              d, "] (the last dim of x ", x.sizes(), ")");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const at::Tensor x2 = x.reshape({-1, d}).contiguous(), w = weight.contiguous();
  const RmsArgs a{x2.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x2.size(0), d,
                  static_cast<float>(eps)};
  const RmsFn fn = float_kernels().rms_norm;
  // rows, never parts of a row, go to threads: each row is reduced whole by one thread
  at::parallel_for(0, a.rows, std::max<int64_t>(1, kRmsGrain / d), [&](int64_t r0, int64_t r1) { fn(a, r0, r1); });
  return out;
}

namespace {

void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const char* op = "yggdrasil::attention";
  check_tensor(op, "q", q, at::kFloat);
  check_tensor(op, "k", k, at::kFloat);
  check_tensor(op, "v", v, at::kFloat);
  check_tensor(op, "mask", mask, at::kBool);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": q, k, v must be 4-d [B, H, T, D] / [B, Hkv, S, D], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3), hkv = k.size(1), s = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(3) == d && v.sizes() == k.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(),
              " must both be [B, Hkv, S, D] = [", b, ", Hkv, S, ", d, "] for q ", q.sizes());
  TORCH_CHECK(hkv > 0 && h % hkv == 0, op, ": q has ", h, " heads, not a multiple of k's ", hkv, " kv heads");
  TORCH_CHECK(d % kLanes == 0 && d >= kLanes && d <= kMaxHeadDim, op, ": head dim ", d,
              " is not supported; the kernel takes multiples of 16 from 16 to ", kMaxHeadDim);
  TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1 && mask.size(3) == s && (mask.size(0) == b || mask.size(0) == 1) &&
                  (mask.size(2) == t || mask.size(2) == 1),
              op, ": mask has shape ", mask.sizes(), "; expected [B, 1, T, S] = [", b, ", 1, ", t, ", ", s, "]");
}

// Items of up to kMaxItemRows query rows of one kv head (its GQA heads x consecutive t). At least
// two items per thread where the shape allows, for balance; the split changes no row's bits.
void split_items(AttnArgs& a) {
  const int64_t group_rows = a.heads / a.kv_heads * a.t, units = a.batch * a.kv_heads;
  int64_t chunks = (group_rows + kMaxItemRows - 1) / kMaxItemRows;
  const int64_t wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  if (units * chunks < wanted) chunks = std::min(group_rows, (wanted + units - 1) / units);
  a.chunk_rows = (group_rows + chunks - 1) / chunks;
  a.chunks = (group_rows + a.chunk_rows - 1) / a.chunk_rows;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& x) {
  const char* op = "yggdrasil::silu_mul";
  check_tensor(op, "x", x, at::kFloat);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op, ": x has shape ", x.sizes(),
              "; expected [..., 2F] (the gate's F columns, then the up projection's)");
  const int64_t f = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = f;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  const at::Tensor x2 = x.reshape({-1, 2 * f}).contiguous();
  const float* gu = x2.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const SiluMulFn fn = float_kernels().silu_mul;
  // whole rows to threads; every element is computed alone, so the split changes no bit
  at::parallel_for(0, x2.size(0), std::max<int64_t>(1, kRmsGrain / f), [&](int64_t r0, int64_t r1) {
    fn(gu, o, f, r0, r1);
  });
  return out;
}

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& mask_in,
                     double scale) {
  check_attention(q_in, k_in, v_in, mask_in);
  const int64_t b = q_in.size(0), h = q_in.size(1), t = q_in.size(2), d = q_in.size(3);
  const int64_t hkv = k_in.size(1), s = k_in.size(2);
  at::Tensor out = at::empty({b, h, t, d}, q_in.options());
  if (out.numel() == 0) return out;
  if (s == 0) return out.zero_();  // no key at all: every row attends nothing
  const at::Tensor q = q_in.contiguous(), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const at::Tensor mask = last_dim_contiguous(mask_in.expand({b, 1, t, s}));
  AttnArgs a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
             reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()), out.data_ptr<float>(),
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
             mask.stride(0), mask.stride(2), b, h, hkv, t, s, d, static_cast<float>(scale), 0, 0};
  split_items(a);
  const AttnFn fn = float_kernels().attention;
  const int64_t scratch = attn_scratch_floats(a);
  at::parallel_for(0, a.batch * a.kv_heads * a.chunks, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> buffer(new float[scratch]);
    fn(a, i0, i1, buffer.get());
  });
  return out;
}

}  // namespace ygg

TORCH_LIBRARY_FRAGMENT(yggdrasil, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(yggdrasil, CPU, m) {
  m.impl("rms_norm", &ygg::rms_norm);
  m.impl("attention", &ygg::attention);
  m.impl("silu_mul", &ygg::silu_mul);
}

// AOTInductor's direct calls (aot_inductor.custom_ops_to_c_shims); a schema float is a C double.
extern "C" {

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps,
                                                         AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    at::Tensor out = ygg::rms_norm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weight), eps);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_silu_mul(AtenTensorHandle x, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    *ret0 = torch::aot_inductor::new_tensor_handle(ygg::silu_mul(*tensor_handle_to_tensor_pointer(x)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                          AtenTensorHandle mask, double scale, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    at::Tensor out = ygg::attention(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                    *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(mask), scale);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

}  // extern "C"
