// Torch binding of the marlin kernels: checks the tensors, allocates outputs and scratch through
// torch, and launches on the current CUDA stream. Registered as the ops `litquant_marlin::*`; their
// fake (meta) implementations, for torch.compile, are in litquant/kernels/marlin.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "marlin.h"

namespace {

// Error messages are built here as one std::string, numbers by std::to_string: TORCH_CHECK would format several
// arguments with an ostringstream of this library, and where the host compiler links its own static libstdc++ into
// the extension (the GPU machine's g++ does), that stream's number formatting crashes (SIGSEGV in
// std::ostream::_M_insert<long>) instead of raising. One string argument reaches torch untouched.
std::string text(const char* s) { return s; }
std::string text(int64_t v) { return std::to_string(v); }
std::string text(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}
template <typename... Parts>
std::string message(const Parts&... parts) {
  return (std::string() + ... + text(parts));
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_weight(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                  int64_t K, int64_t N, at::ScalarType dtype) {
  TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.is_contiguous(),
              "marlin: qweight must be a contiguous int32 CUDA tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) * 16 == K && qweight.size(1) == 2 * N,
              message("marlin: qweight must have shape [K/16, 2N] = [", K / 16, ", ", 2 * N, "], got ",
                      qweight.sizes()));
  TORCH_CHECK(scales.scalar_type() == dtype && scales.is_contiguous() && scales.dim() == 2 && scales.size(1) == N,
              "marlin: scales must be contiguous [G, N] in the activation dtype");
  if (zeros) {
    TORCH_CHECK(zeros->scalar_type() == at::kInt && zeros->is_contiguous() && zeros->dim() == 2 &&
                    zeros->size(0) == scales.size(0) && zeros->size(1) == N / 4,
                "marlin: zeros must be contiguous int32 [G, N/4]");
  }
}

void gemm_out(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
              const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, const at::Tensor& locks,
              int64_t group_size, const at::Tensor& out, bool after_small_kernel) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "marlin: x must be a 2-D CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "marlin: x must be fp16 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(1);
  check_weight(qweight, scales, zeros, K, N, x.scalar_type());
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == N && aligned16(out),
              "marlin: out must be a contiguous, 16-byte aligned [M, N] tensor in x's dtype");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == N,
                "marlin: bias must be contiguous [N] in x's dtype");
  }
  TORCH_CHECK(locks.scalar_type() == at::kInt && locks.numel() >= litquant_marlin_lock_count(M, K, N),
              message("marlin: locks must hold ", litquant_marlin_lock_count(M, K, N), " int32 for M=", M));
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  // cp.async and the copy engine read 16-byte pieces: a view at an odd offset is copied first.
  const at::Tensor xc = (x.is_contiguous() && aligned16(x)) ? x : x.contiguous().clone();
  const at::Tensor partial = at::empty({litquant_marlin_partial_floats(M, K, N)}, x.options().dtype(at::kFloat));
  const char* err = litquant_marlin_gemm(
      xc.data_ptr(), qweight.data_ptr<int32_t>(), scales.data_ptr(), zeros ? zeros->data_ptr<int32_t>() : nullptr,
      bias ? bias->data_ptr() : nullptr, out.data_ptr(), partial.data_ptr<float>(), locks.data_ptr<int32_t>(),
      static_cast<int>(M), static_cast<int>(K), static_cast<int>(N), static_cast<int>(group_size),
      x.scalar_type() == at::kBFloat16, after_small_kernel, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(err == nullptr, message("marlin gemm: ", err));
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, const at::Tensor& locks,
                int64_t group_size, bool after_small_kernel) {
  at::Tensor out = at::empty({x.size(0), scales.size(1)}, x.options());
  gemm_out(x, qweight, scales, zeros, bias, locks, group_size, out, after_small_kernel);
  return out;
}

void dequant_out(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                 int64_t group_size, const at::Tensor& out) {
  const int64_t K = qweight.size(0) * 16, N = scales.size(1);
  check_weight(qweight, scales, zeros, K, N, scales.scalar_type());
  // out has K rows, or K / 2: the sum of the two 4-bit planes of an 8-bit weight
  TORCH_CHECK(out.scalar_type() == scales.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  (out.size(0) == K || 2 * out.size(0) == K) && out.size(1) == N && aligned16(out),
              "marlin: out must be a contiguous, 16-byte aligned [K, N] (or [K / 2, N], two planes) tensor in the "
              "scales' dtype");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const char* err = litquant_marlin_dequant(
      qweight.data_ptr<int32_t>(), scales.data_ptr(), zeros ? zeros->data_ptr<int32_t>() : nullptr, out.data_ptr(),
      static_cast<int>(K), static_cast<int>(N), static_cast<int>(group_size), static_cast<int>(K / out.size(0)),
      scales.scalar_type() == at::kBFloat16, c10::cuda::getCurrentCUDAStream(qweight.get_device()).stream());
  TORCH_CHECK(err == nullptr, message("marlin dequant: ", err));
}

}  // namespace

// `locks` is a workspace the kernel leaves as it found it (all zero), so it is not declared mutated.
// `after_small_kernel`: the kernel ahead leaves most of the GPU free (see marlin.h), a launch hint.
TORCH_LIBRARY(litquant_marlin, m) {
  m.def("gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, Tensor locks, "
        "int group_size, bool after_small_kernel=False) -> Tensor");
  m.def("gemm_out(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, Tensor locks, "
        "int group_size, Tensor(a!) out, bool after_small_kernel=False) -> ()");
  m.def("dequant_out(Tensor qweight, Tensor scales, Tensor? zeros, int group_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(litquant_marlin, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_out", &gemm_out);
  m.impl("dequant_out", &dequant_out);
}
