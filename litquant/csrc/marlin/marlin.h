// Host API of the marlin kernels: plain C, raw pointers, no torch. The torch binding (binding.cpp)
// and anything else may call it. Every function launches on `stream` and returns NULL on success,
// or a static message saying what was wrong (bad arguments, or the CUDA error of the launch).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// out[M, N] = x[M, K] @ W[K, N] (+ bias), W 4-bit in the marlin layout (see marlin.cu).
//   x, out, bias: fp16 (is_bf16 = 0) or bf16 (is_bf16 = 1), row-major, 16-byte aligned; bias may be NULL.
//   qweight: int32 [K/16, 2N];  scales: [G, N] in x's dtype, columns permuted;
//   zeros: uint8 nibbles [G, N/2] (as int32 [G, N/4]) or NULL for symmetric weights (zero point 8).
//   group_size: -1 (one group over K), 32, 64 or 128; G = ceil(K / group_size).
//   partial: fp32 scratch of litquant_marlin_partial_floats(M, K, N) floats (any content).
//   locks: int32 [litquant_marlin_lock_count(M, K, N)], all zero; they are zero again when the kernel ends.
//   after_small_kernel: 1 where the kernel ahead in the stream leaves most of the GPU free (not another
//   quantized matmul: a fused elementwise kernel, a norm, attention); a hint for how the call is launched.
// Needs K % 64 == 0, N % 64 == 0, and K or N a multiple of 128; M is any size >= 1.
const char* litquant_marlin_gemm(const void* x, const int32_t* qweight, const void* scales,
                                 const int32_t* zeros, const void* bias, void* out, float* partial,
                                 int32_t* locks, int M, int K, int N, int group_size, int is_bf16,
                                 int after_small_kernel, cudaStream_t stream);

// Floats of the `partial` scratch and ints of the `locks` workspace that a call needs on the current GPU.
int64_t litquant_marlin_partial_floats(int M, int K, int N);
int64_t litquant_marlin_lock_count(int M, int K, int N);

// w[K / planes, N] (row-major, x's dtype) = the dequantized weight, for the dense path of large M. planes = 2:
// qweight holds an 8-bit weight as two 4-bit planes of K / 2 rows each (high nibbles, then low nibbles), and
// w is their sum.
const char* litquant_marlin_dequant(const int32_t* qweight, const void* scales, const int32_t* zeros,
                                    void* w, int K, int N, int group_size, int planes, int is_bf16,
                                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif
