// yggdrasil::q4_linear / q8_linear: 4-bit (or 8-bit) block weights x int8 activations on the CPU.
// This file is the torch glue: schema, checks, ISA choice, threading, and the AOTInductor C shims.
// The arithmetic lives in kernel_*.cpp, one file per ISA, all computing identical bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <utility>
#include <string>
#include <vector>

#include "q4_common.h"

namespace ygg {
namespace {

// Best first. A path runs only where the CPU (and the OS, for zmm state) supports it.
struct Path {
  const KernelTable* table;
  bool (*supported)();
};

#if defined(__x86_64__) || defined(__i386__)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avxvnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
bool has_avx512vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif
bool always() { return true; }

// The paths this build has: the x86 files are built only on x86, each only where this compiler
// takes it (build.py defines YGG_HAS_* for the ones built); the scalar path is always there.
const Path kPaths[] = {
#ifdef YGG_HAS_AVX512VNNI
    {&kAvx512VnniTable, has_avx512vnni},
#endif
#ifdef YGG_HAS_AVXVNNI
    {&kAvxVnniTable, has_avxvnni},
#endif
#ifdef YGG_HAS_AVX2
    {&kAvx2Table, has_avx2},
#endif
    {&kScalarTable, always}};
const char* const kKnownPaths[] = {"avx512vnni", "avxvnni", "avx2", "scalar"};

std::string supported_names() {
  std::string out;
  for (const Path& p : kPaths)
    if (p.supported()) out += (out.empty() ? "" : ", ") + std::string(p.table->name);
  return out;
}

// The path `name` names ("" or "auto": the best this CPU has), or one clear error.
const KernelTable& resolve(const std::string& name) {
  if (name.empty() || name == "auto") {
    for (const Path& p : kPaths)
      if (p.supported()) return *p.table;
  }
  for (const Path& p : kPaths) {
    if (name != p.table->name) continue;
    TORCH_CHECK(p.supported(), "YGGDRASIL_KERNEL_ISA=", name, " asks for a kernel path this CPU lacks; it has: ",
                supported_names());
    return *p.table;
  }
  for (const char* known : kKnownPaths)
    TORCH_CHECK(name != known, "YGGDRASIL_KERNEL_ISA=", name,
                " asks for a kernel path this build of the kernels lacks (not built on this machine); it has: ",
                supported_names());
  TORCH_CHECK(false, "YGGDRASIL_KERNEL_ISA=", name,
              " is not a kernel path; use one of avx512vnni, avxvnni, avx2, scalar, auto (this CPU has: ",
              supported_names(), ")");
}

// The path every op takes: a cache of YGGDRASIL_KERNEL_ISA (or the best path), resolved on the
// first op call of the process; set_kernel_isa replaces it, for the tests and the per-path
// benchmarks that compare paths in one process (kernels.forced_isa). A bad variable leaves it
// unset, so every call raises.
std::atomic<const KernelTable*> g_active{nullptr};

const KernelTable& active_table() {
  const KernelTable* table = g_active.load(std::memory_order_acquire);
  if (table == nullptr) {
    const char* forced = std::getenv("YGGDRASIL_KERNEL_ISA");
    table = &resolve(forced == nullptr ? "" : forced);
    g_active.store(table, std::memory_order_release);
  }
  return *table;
}

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

// x [..., K] float32/bfloat16 on the CPU, K = 32 * blocks of the packed weight.
void check_x(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have a feature dimension, got a 0-d tensor");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % kBlock == 0, op, ": x has ", k, " features (last dim of ", shape_str(x),
              "); the kernel needs a multiple of ", kBlock);
  TORCH_CHECK(k == packed.size(1) * kBlock, op, ": x has ", k, " features (last dim of ", shape_str(x),
              ") but the packed weight takes ", packed.size(1) * kBlock, " (", packed.size(1), " blocks of ",
              kBlock, ")");
}

// A [groups, blocks, width] CPU tensor of the given dtype, contiguous, as pack.py lays it out
// (blocks: the weight's blocks of 32, or its super-blocks of 256 for a K-quant's d and dmin).
void check_packed(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t width,
                  int64_t groups, int64_t blocks) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, op, ": ", name, " must be a CPU ", dtype,
              " tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 3 && t.size(0) == groups && t.size(1) == blocks && t.size(2) == width, op, ": ", name,
              " has shape ", shape_str(t), "; expected [", groups, ", ", blocks, ", ", width, "] (groups of ", kCols,
              " output columns x blocks x ", width, "): pack it with yggdrasil.kernels' pack functions");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The packed codes' shape; returns (groups, blocks). super: a K-quant (whole super-blocks of 256).
std::pair<int64_t, int64_t> check_codes(const char* op, const at::Tensor& packed, at::ScalarType dtype, int64_t width,
                                        bool super) {
  TORCH_CHECK(packed.dim() == 3, op, ": packed has shape ", shape_str(packed),
              "; expected [out_features/16, in_features/32, bytes]");
  check_packed(op, "packed", packed, dtype, width, packed.size(0), packed.size(1));
  TORCH_CHECK(!super || packed.size(1) % kSuperBlocks == 0, op, ": in_features ", packed.size(1) * kBlock,
              " is not whole super-blocks of ", kSuperBlocks * kBlock);
  return {packed.size(0), packed.size(1)};
}

const uint16_t* half_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }
const uint8_t* byte_ptr(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

// Every op's activation side: x quantized per row (one workspace), the output allocated, and
// the kind's micro-kernel run over column groups split between threads.
at::Tensor run(const char* op, const at::Tensor& x, const at::Tensor& packed, Weights w, GroupsFn KernelTable::*kind) {
  check_x(op, x, packed);
  const KernelTable& table = active_table();
  const int64_t k = x.size(-1), nb = k / kBlock, groups = packed.size(0), n = groups * kCols;
  const at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t rows = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out.reshape(out_shape);

  // activation workspace in one allocation, laid out in the micro-kernel's row tiles (q4_common.h):
  // int8 codes [rows * k], then float scale, float(sum), int32 sum, int32 sum of the first half [rows * nb] each
  const int64_t stats = rows * nb, codes = (rows * k + 63) / 64 * 64;
  at::Tensor work = at::empty({codes + 16 * stats}, x.options().dtype(at::kByte));
  uint8_t* base = work.data_ptr<uint8_t>();
  float* scale = reinterpret_cast<float*>(base + codes);
  int32_t* sums = reinterpret_cast<int32_t*>(scale + 2 * stats);
  const Activations a{reinterpret_cast<int8_t*>(base), scale, scale + stats, sums, sums + stats, rows, k, nb,
                      table.tile};
  // each row is quantized on its own, so splitting rows over threads changes no bit
  const float* xf = x2.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) { table.quantize(xf, a, r0, r1); });

  w.groups = groups;
  w.blocks = nb;
  const bool f32 = out.scalar_type() == at::kFloat;
  const Output o{f32 ? out.data_ptr<float>() : nullptr,
                 f32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n};
  // contiguous column groups per thread: each streams its slice of the weight once
  const int64_t grain = std::max<int64_t>(1, 512 / (nb * (rows + 4)));
  const GroupsFn fn = table.*kind;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) { fn(a, w, o, g0, g1); });
  return out.reshape(out_shape);
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& mins) {
  const char* op = "yggdrasil::q4_linear";
  const auto [groups, blocks] = check_codes(op, packed, at::kByte, kQ4Bytes, false);
  check_packed(op, "scales", scales, at::kHalf, kCols, groups, blocks);
  check_packed(op, "mins", mins, at::kHalf, kCols, groups, blocks);
  return run(op, x, packed, Weights{byte_ptr(packed), half_ptr(scales), half_ptr(mins)}, &KernelTable::q4);
}

at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const char* op = "yggdrasil::q4_0_linear";
  const auto [groups, blocks] = check_codes(op, packed, at::kByte, kQ4Bytes, false);
  check_packed(op, "scales", scales, at::kHalf, kCols, groups, blocks);
  return run(op, x, packed, Weights{byte_ptr(packed), half_ptr(scales)}, &KernelTable::q4_0);
}

at::Tensor q4_k_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, const at::Tensor& sub_scales, const at::Tensor& sub_mins) {
  const char* op = "yggdrasil::q4_k_linear";
  const auto [groups, blocks] = check_codes(op, packed, at::kByte, kQ4Bytes, true);
  check_packed(op, "scales", scales, at::kHalf, kCols, groups, blocks / kSuperBlocks);
  check_packed(op, "mins", mins, at::kHalf, kCols, groups, blocks / kSuperBlocks);
  check_packed(op, "sub_scales", sub_scales, at::kByte, kCols, groups, blocks);
  check_packed(op, "sub_mins", sub_mins, at::kByte, kCols, groups, blocks);
  const Weights w{byte_ptr(packed), half_ptr(scales), half_ptr(mins), byte_ptr(sub_scales), byte_ptr(sub_mins)};
  return run(op, x, packed, w, &KernelTable::q4_k);
}

at::Tensor q6_k_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high,
                       const at::Tensor& scales, const at::Tensor& sub_scales) {
  const char* op = "yggdrasil::q6_k_linear";
  const auto [groups, blocks] = check_codes(op, packed, at::kByte, kQ4Bytes, true);
  check_packed(op, "high", high, at::kByte, kQ6HighBytes, groups, blocks);
  check_packed(op, "scales", scales, at::kHalf, kCols, groups, blocks / kSuperBlocks);
  check_packed(op, "sub_scales", sub_scales, at::kChar, 2 * kCols, groups, blocks);
  const Weights w{byte_ptr(packed), half_ptr(scales), nullptr, byte_ptr(sub_scales), nullptr, byte_ptr(high)};
  return run(op, x, packed, w, &KernelTable::q6_k);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const char* op = "yggdrasil::q8_linear";
  const auto [groups, blocks] = check_codes(op, packed, at::kChar, kQ8Bytes, false);
  check_packed(op, "scales", scales, at::kHalf, kCols, groups, blocks);
  return run(op, x, packed, Weights{byte_ptr(packed), half_ptr(scales)}, &KernelTable::q8);
}

std::string kernel_isa() { return active_table().name; }

// Tests and per-path benchmarks only (kernels.forced_isa): every op takes `name`'s path from now on.
void set_kernel_isa(const std::string& name) { g_active.store(&resolve(name), std::memory_order_release); }

std::vector<std::string> kernel_isas() {
  std::vector<std::string> out;
  for (const Path& p : kPaths)
    if (p.supported()) out.emplace_back(p.table->name);
  return out;
}

}  // namespace ygg

TORCH_LIBRARY(yggdrasil, m) {
  m.def("q4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("q4_0_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("q4_k_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor sub_scales, Tensor sub_mins) -> Tensor");
  m.def("q6_k_linear(Tensor x, Tensor packed, Tensor high, Tensor scales, Tensor sub_scales) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("kernel_isa() -> str", &ygg::kernel_isa);
  m.def("kernel_isas() -> str[]", &ygg::kernel_isas);
  m.def("set_kernel_isa(str name) -> ()", &ygg::set_kernel_isa);
}

TORCH_LIBRARY_IMPL(yggdrasil, CPU, m) {
  m.impl("q4_linear", &ygg::q4_linear);
  m.impl("q4_0_linear", &ygg::q4_0_linear);
  m.impl("q4_k_linear", &ygg::q4_k_linear);
  m.impl("q6_k_linear", &ygg::q6_k_linear);
  m.impl("q8_linear", &ygg::q8_linear);
}

// AOTInductor calls these directly from a compiled graph (config aot_inductor.custom_ops_to_c_shims),
// instead of going through the ProxyExecutor's boxed dispatch. Name: aoti_torch_<device>_<op>.
extern "C" {

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_q4_linear(AtenTensorHandle x, AtenTensorHandle packed,
                                                          AtenTensorHandle scales, AtenTensorHandle mins,
                                                          AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    at::Tensor out = ygg::q4_linear(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(packed),
                                    *tensor_handle_to_tensor_pointer(scales), *tensor_handle_to_tensor_pointer(mins));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

#define YGG_TENSOR(h) (*torch::aot_inductor::tensor_handle_to_tensor_pointer(h))

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_q4_0_linear(AtenTensorHandle x, AtenTensorHandle packed,
                                                            AtenTensorHandle scales, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(ygg::q4_0_linear(YGG_TENSOR(x), YGG_TENSOR(packed), YGG_TENSOR(scales)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_q4_k_linear(AtenTensorHandle x, AtenTensorHandle packed,
                                                            AtenTensorHandle scales, AtenTensorHandle mins,
                                                            AtenTensorHandle sub_scales, AtenTensorHandle sub_mins,
                                                            AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(ygg::q4_k_linear(
        YGG_TENSOR(x), YGG_TENSOR(packed), YGG_TENSOR(scales), YGG_TENSOR(mins), YGG_TENSOR(sub_scales),
        YGG_TENSOR(sub_mins)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_q6_k_linear(AtenTensorHandle x, AtenTensorHandle packed,
                                                            AtenTensorHandle high, AtenTensorHandle scales,
                                                            AtenTensorHandle sub_scales, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(ygg::q6_k_linear(
        YGG_TENSOR(x), YGG_TENSOR(packed), YGG_TENSOR(high), YGG_TENSOR(scales), YGG_TENSOR(sub_scales)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_q8_linear(AtenTensorHandle x, AtenTensorHandle packed,
                                                          AtenTensorHandle scales, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    at::Tensor out = ygg::q8_linear(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(packed),
                                    *tensor_handle_to_tensor_pointer(scales));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

}  // extern "C"
