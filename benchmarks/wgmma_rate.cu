// How fast Hopper's wgmma runs at the shapes the marlin kernel issues, with nothing else in the loop: cycles an SM
// spends per m64nNk16 instruction (bf16, fp32 accumulators) against the tensor cores' peak, N / 2 cycles
// (4096 flops a cycle an SM). Ways to give the instruction its A operand (64 rows x 16 k):
//   registers    wgmma_rs from fixed registers;
//   shared       wgmma_ss from a fixed shared tile (a plain bf16 GEMM's mainloop);
//   stored       the warps first write their register fragments to shared memory (stmatrix, the proxy fence,
//                the warpgroup's barrier), then wgmma_ss: what a kernel pays to feed dequantized weights as
//                a shared-memory operand;
//   dequantized  wgmma_rs from fragments dequantized each half from 4-bit words in shared memory, with the
//                kernel's own arithmetic (common.cuh: bf16, zero points), as litquant/csrc/marlin/wgmma.cu does; one
//                group in flight while the next half is dequantized (two register sets), or two (three sets);
//   shared+alu   wgmma_ss from the fixed tile while the same warps do that dequantization beside it (results
//                folded into one register): whether the arithmetic overlaps the tensor work;
//   alu only     the dequantization alone, no wgmma.
// A second table (decode_kernel) asks the same at decode sizes, N = 8..32 tokens, with the weight words read as the
// kernel reads them and, beside the kernel's dequantization, decode.cu's cheaper one (biased codes, groups scaled in
// fp32).
// B is N activation rows x 64 k in shared memory with the 128-byte swizzle, as in the kernel. Each warpgroup
// issues groups of 4 instructions (one 64-k half), one group in flight while it prepares the next (as the kernel
// does) unless said otherwise; 1, 2 or 4 warpgroups a block, one block an SM, every SM busy. `stored` is checked
// against `registers` (same fragments, so the same sums).
//
// Build and run on a Hopper GPU, from the repository root:
//   nvcc -std=c++17 -O3 -arch=sm_90a -I litquant/csrc/marlin benchmarks/wgmma_rate.cu -o /tmp/wgmma_rate
//   /tmp/wgmma_rate
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.cuh"
#include "wgmma_ptx.cuh"

using namespace litquant_marlin;

enum class AFrom { kRegisters, kShared, kStored, kDequantized, kSharedBesideAlu, kAluOnly };

constexpr int kHalves = 8192;              // groups of 4 instructions per warpgroup
constexpr int kABytes = 64 * 128;          // one A tile: 64 rows x 64 k of bf16, 128-byte swizzle
constexpr int kInitWords = 2 * 32 * 1024;  // uint4 of random bf16 that fill shared memory and the fragments

// Writes a warp's A fragment of one k16 step (rows 16 w .. 16 w + 15 of the tile) into the swizzled tile: the four
// 8 x 8 matrices of stmatrix.x4 are registers 0..3 of the fragment (rows +0/+8, k +0/+8); lane l gives the address
// of row l % 8 of matrix l / 8.
__device__ __forceinline__ void store_fragment(uint32_t tile, int w, int kk, int lane, const uint32_t (&a)[4]) {
  const int m = lane / 8, row = 16 * w + (m & 1) * 8 + lane % 8, chunk = 2 * kk + (m >> 1);
  const uint32_t address = tile + row * 128 + ((chunk ^ (row % 8)) * 16);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3])
               : "memory");
}

template <int N, AFrom kA, int kWarpgroups, int kSets>
__global__ void __launch_bounds__(128 * kWarpgroups, 1)
    rate_kernel(const uint4* init, float* out, long long* cycles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  constexpr int kBBytes = N * 128;
  constexpr int kBytes = kBBytes + kWarpgroups * 2 * kABytes;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4, w = warp % 4;
  for (int i = tid; i < kBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = init[i];
  fence_proxy_async();
  __syncthreads();

  const uint32_t b_low = swizzled_descriptor_low(smem_address(smem));
  const uint32_t a_tiles = smem_address(smem + kBBytes + wg * 2 * kABytes);  // this warpgroup's two A tiles
  uint32_t fragments[kSets][4][4];  // [register set][k16 step][register]
  for (int s = 0; s < kSets; ++s)
    for (int kk = 0; kk < 4; ++kk)
      for (int r = 0; r < 4; ++r)
        fragments[s][kk][r] =
            reinterpret_cast<const uint32_t*>(init)[(((s * 4 + kk) * 4 + r) * 128 + tid) % (4 * kInitWords)];
  float acc[N / 2];
  // The dequantization's constants (a random scale pair and zero points) and its words: B's bytes, 4 a half.
  WordConstants<__nv_bfloat16> consts;
  consts.load(fragments[0][0][0], fragments[0][0][1]);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(smem);
  uint32_t sink = 0;
  constexpr bool kDequantizes = kA == AFrom::kDequantized || kA == AFrom::kSharedBesideAlu || kA == AFrom::kAluOnly;

  // One half: 4 instructions as one group; after its issue, the groups older than the last kSets - 1 are waited
  // for. Register sets (and A tiles) take turns, so that none is written while a group in flight reads it.
  auto half = [&](int s, int h) {
    const bool first = h == 0;
    if constexpr (kDequantizes) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t b[4];
        consts.dequant(words[((h * 4 + kk) * 128 + tid % 128) % (N * 32)], b);
        if constexpr (kA == AFrom::kDequantized) {
          uint32_t(&a)[4] = fragments[s][kk];
          a[0] = b[0], a[1] = b[2], a[2] = b[1], a[3] = b[3];  // (the register order of wgmma.cu)
        } else {
          sink ^= b[0] ^ b[1] ^ b[2] ^ b[3];
        }
      }
      if constexpr (kA == AFrom::kAluOnly) return;
    }
    if constexpr (kA == AFrom::kStored) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) store_fragment(a_tiles + s % 2 * kABytes, w, kk, lane, fragments[s][kk]);
      fence_proxy_async();  // the generic-proxy writes before the wgmmas' async-proxy reads
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");  // all four warps' rows are written
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t b = swizzled_descriptor(b_low + 2 * kk);
      const int accumulate = !first || kk > 0;
      if constexpr (kA == AFrom::kRegisters || kA == AFrom::kDequantized) {
        wgmma_rs<__nv_bfloat16, N>(acc, fragments[s][kk], b, accumulate);
      } else {
        const uint32_t tile = kA == AFrom::kShared ? a_tiles : a_tiles + s % 2 * kABytes;
        wgmma_ss<__nv_bfloat16, N>(acc, swizzled_descriptor(swizzled_descriptor_low(tile) + 2 * kk), b, accumulate);
      }
    }
    wgmma_commit();
    wgmma_wait<kSets - 1>();
  };

  const long long start = clock64();
#pragma unroll 1
  for (int h = 0; h + kSets <= kHalves; h += kSets) {
#pragma unroll
    for (int s = 0; s < kSets; ++s) half(s, h + s);
  }
  wgmma_wait<0>();
  const long long end = clock64();
  if (blockIdx.x == 0)
    for (int j = 0; j < N / 2; ++j)
      out[j * blockDim.x + tid] = kA == AFrom::kAluOnly ? (float)sink : acc[j] + sink * 0.f;  // (keeps `sink` alive)
  if (tid % 128 == 0) cycles[blockIdx.x * kWarpgroups + wg] = end - start;
#endif
}

// ---------------------------------------------------------------------------------------------
// Decode shapes: the tokens (M <= 32) as wgmma's N, the weights dequantized as above
// ---------------------------------------------------------------------------------------------
// Each warpgroup takes one 64-feature tile, as in wgmma.cu, and reads its weight words from a ring of 8 half stages
// in shared memory the way that kernel does (warp w reads word w of each lane's 16 bytes: 4-way bank conflicts).
// Two ways to dequantize:
//   full    the kernel's arithmetic (each pair scaled and shifted by its zero point; one accumulator set), with the
//           group's constants read every 128 k;
//   biased  the codes enter as 128 + q (a shift and a lop3 a pair, as decode.cu feeds mma.sync), each group of 128 k
//           into fresh accumulators, and a finished group is added to the total with two fma an accumulator
//           (out += s acc - s (128 + z) sum(x): the scales, zero-point terms and the tokens' sums read per group).
constexpr int kRingHalves = 8;

template <int N, bool kBiased, int kWarpgroups>
__global__ void __launch_bounds__(128 * kWarpgroups, 1)
    decode_kernel(const uint4* init, float* out, long long* cycles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  constexpr int kBBytes = N * 128 < 1024 ? 1024 : N * 128;  // (at least one swizzle atom)
  constexpr int kWordBytes = kRingHalves * 4 * kWarpgroups * 512;
  constexpr int kBytes = kBBytes + kWordBytes + 256 * 16;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4, w = warp % 4;
  for (int i = tid; i < kBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = init[i];
  fence_proxy_async();
  __syncthreads();

  const uint32_t b_low = swizzled_descriptor_low(smem_address(smem));
  const uint32_t* words = reinterpret_cast<const uint32_t*>(smem + kBBytes) + wg * 128 + lane * 4 + w;
  const float4* params = reinterpret_cast<const float4*>(smem + kBBytes + kWordBytes);  // 256 per group, any values
  const uint32_t* param_words = reinterpret_cast<const uint32_t*>(params);
  WordConstants<__nv_bfloat16> consts;
  uint32_t fragments[2][4][4];
  float acc[N / 2], total[N / 2];
  for (int j = 0; j < N / 2; ++j) total[j] = 0.f;

  auto dequantize_half = [&](int s, int h) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t q = words[((h % kRingHalves) * 4 + kk) * kWarpgroups * 128];
      uint32_t b[4];
      if constexpr (kBiased) {
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = mask_or(q >> (4 * i), 0x000f000fu, Dtype<__nv_bfloat16>::kMagic);
      } else {
        consts.dequant(q, b);
      }
      uint32_t(&a)[4] = fragments[s][kk];
      a[0] = b[0], a[1] = b[2], a[2] = b[1], a[3] = b[3];
    }
  };
  auto issue = [&](int s, float (&d)[N / 2], bool fresh) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_rs<__nv_bfloat16, N>(d, fragments[s][kk], swizzled_descriptor(b_low + 2 * kk), !fresh || kk > 0);
    wgmma_commit();
    wgmma_wait<1>();
  };
  // Accumulator j: feature g or g + 8 (j % 4 >= 2), token column 8 (j / 4) + 2 (lane % 4) + j % 2.
  auto add_group = [&](const float (&d)[N / 2], int group) {
    const float4 p = params[(group * 128 + tid % 128) % 256];  // scales and zero-point terms of the two features
    float4 sums[N >= 16 ? N / 16 : 1];  // the activation sums of the thread's N / 4 token columns
#pragma unroll
    for (int i = 0; i < (N >= 16 ? N / 16 : 1); ++i) sums[i] = params[(group * 7 + i * 32 + lane) % 256];
    const float* sum = reinterpret_cast<const float*>(sums);
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const bool high = j % 4 >= 2;
      total[j] = fmaf(d[j], high ? p.y : p.x, fmaf(high ? p.w : p.z, sum[j / 4 * 2 + j % 2], total[j]));
    }
  };

  const long long start = clock64();
  if constexpr (kBiased) {
    // A group's sums are read once its wgmmas are all done (ptxas serializes the wgmmas if the accumulators of one
    // are read while another is in flight, even another set's): the warpgroup drains at each group's end, while the
    // block's other warpgroups keep the tensor cores busy.
#pragma unroll 1
    for (int h = 0; h + 2 <= kHalves; h += 2) {
      dequantize_half(0, h);
      issue(0, acc, true);
      dequantize_half(1, h + 1);
      issue(1, acc, false);
      wgmma_wait<0>();
      add_group(acc, h / 2);
    }
  } else {
#pragma unroll 1
    for (int h = 0; h + 2 <= kHalves; h += 2) {
      consts.load(param_words[(h * 64 + tid) % 1024], param_words[(h * 64 + tid + 512) % 1024]);
      dequantize_half(0, h);
      issue(0, acc, h == 0);
      dequantize_half(1, h + 1);
      issue(1, acc, false);
    }
    wgmma_wait<0>();
    for (int j = 0; j < N / 2; ++j) total[j] = acc[j];
  }
  const long long end = clock64();
  if (blockIdx.x == 0)
    for (int j = 0; j < N / 2; ++j) out[j * blockDim.x + tid] = total[j];
  if (tid % 128 == 0) cycles[blockIdx.x * kWarpgroups + wg] = end - start;
#endif
}

struct Result {
  double cycles_per_instruction, percent_of_peak;
};

using Kernel = void (*)(const uint4*, float*, long long*);

// Runs `kernel` on every SM (twice: the first warms up) and returns the slowest warpgroup's cycles per instruction
// (an SM issues `instructions` of N columns); `sums` gets block 0's accumulators.
Result time_kernel(Kernel kernel, int sms, int threads, int smem, double instructions, int N, const uint4* init,
                   float* out, long long* cycles, std::vector<float>* sums) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int i = 0; i < 2; ++i) kernel<<<sms, threads, smem>>>(init, out, cycles);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  std::vector<long long> c(sms * threads / 128);
  cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  long long most = 0;
  for (long long v : c) most = v > most ? v : most;
  sums->resize(N / 2 * threads);
  cudaMemcpy(sums->data(), out, sums->size() * sizeof(float), cudaMemcpyDeviceToHost);
  const double per_instruction = most / instructions;
  return {per_instruction, 100.0 * (N / 2) / per_instruction};
}

template <int N, AFrom kA, int kWarpgroups, int kSets = 2>
Result run(int sms, const uint4* init, float* out, long long* cycles, std::vector<float>* sums) {
  static_assert(kA != AFrom::kStored || kSets == 2, "stored: two A tiles");
  return time_kernel(rate_kernel<N, kA, kWarpgroups, kSets>, sms, 128 * kWarpgroups,
                     N * 128 + kWarpgroups * 2 * kABytes + 1024, 4.0 * (kHalves / kSets * kSets) * kWarpgroups, N, init,
                     out, cycles, sums);
}

template <int N, int kWarpgroups>
void row(int sms, const uint4* init, float* out, long long* cycles) {
  std::vector<float> from_registers, stored, unused;
  const Result r = run<N, AFrom::kRegisters, kWarpgroups>(sms, init, out, cycles, &from_registers);
  const Result s = run<N, AFrom::kShared, kWarpgroups>(sms, init, out, cycles, &unused);
  const Result t = run<N, AFrom::kStored, kWarpgroups>(sms, init, out, cycles, &stored);
  const Result d = run<N, AFrom::kDequantized, kWarpgroups>(sms, init, out, cycles, &unused);
  const Result b = run<N, AFrom::kSharedBesideAlu, kWarpgroups>(sms, init, out, cycles, &unused);
  const Result a = run<N, AFrom::kAluOnly, kWarpgroups>(sms, init, out, cycles, &unused);
  // (Three register sets of 64 accumulators do not fit 4 warpgroups' registers: ptxas would serialize the wgmmas.)
  Result d3{0, 0};
  if constexpr (N * kWarpgroups <= 256)
    d3 = run<N, AFrom::kDequantized, kWarpgroups, 3>(sms, init, out, cycles, &unused);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < stored.size(); ++i) {
    diff += (stored[i] - from_registers[i]) * (double)(stored[i] - from_registers[i]);
    norm += from_registers[i] * (double)from_registers[i];
  }
  std::printf("| m64n%dk16 | %d |", N, kWarpgroups);
  for (const Result& x : {r, s, t, d, d3, b}) {
    if (x.cycles_per_instruction > 0) std::printf(" %.1f / %.0f%% |", x.cycles_per_instruction, x.percent_of_peak);
    else std::printf(" - |");
  }
  std::printf(" %.1f | %.1e |\n", a.cycles_per_instruction, std::sqrt(diff / norm));
}

// The time a 70B-up layer (8192 x 57344: 3475 instructions of 64 features x 16 k an SM) would take at `cycles` an
// instruction and 1.55 GHz (the clock of marlin's M = 64 benchmark on the H200).
double us_70b_up(double cycles) { return 8192.0 / 16 * 57344 / 64 / 132 * cycles / 1550.0; }

template <int N, int kWarpgroups>
void decode_row(int sms, const uint4* init, float* out, long long* cycles) {
  std::vector<float> unused;
  const int smem = (N * 128 < 1024 ? 1024 : N * 128) + kRingHalves * 4 * kWarpgroups * 512 + 256 * 16 + 1024;
  const Result r = run<N, AFrom::kRegisters, kWarpgroups>(sms, init, out, cycles, &unused);
  const Result f = time_kernel(decode_kernel<N, false, kWarpgroups>, sms, 128 * kWarpgroups, smem,
                               4.0 * kHalves * kWarpgroups, N, init, out, cycles, &unused);
  const Result b = time_kernel(decode_kernel<N, true, kWarpgroups>, sms, 128 * kWarpgroups, smem,
                               4.0 * kHalves * kWarpgroups, N, init, out, cycles, &unused);
  std::printf("| m64n%dk16 | %d |", N, kWarpgroups);
  for (const Result& x : {r, f, b})
    std::printf(" %.1f (%.0f us) |", x.cycles_per_instruction, us_70b_up(x.cycles_per_instruction));
  std::printf("\n");
}

int main() {
  cudaDeviceProp props;
  cudaGetDeviceProperties(&props, 0);
  if (props.major != 9) {
    std::printf("wgmma needs a Hopper GPU (sm_90); this is %s\n", props.name);
    return 1;
  }
  const int sms = props.multiProcessorCount;
  std::vector<uint16_t> host(kInitWords * 8);
  srand(1);
  for (uint16_t& v : host) {  // bf16 in [-1, 1): sign, exponent 0x3f - (0..3), random mantissa
    const uint32_t bits = (uint32_t)(rand() & 1) << 15 | (uint32_t)(0x7e - rand() % 4) << 7 | (uint32_t)(rand() & 0x7f);
    v = (uint16_t)bits;
  }
  uint4* init;
  float* out;
  long long* cycles;
  cudaMalloc(&init, host.size() * 2);
  cudaMalloc(&out, 128 * 4 * 128 * sizeof(float));
  cudaMalloc(&cycles, sms * 4 * sizeof(long long));
  cudaMemcpy(init, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
  std::printf("%s, %d SMs, %d instructions a warpgroup; each cell: cycles an SM per instruction / %% of the peak "
              "(N / 2); "
              "alu only: cycles an SM per half's worth of dequantization / 4\n\n",
              props.name, sms, 4 * kHalves);
  std::printf("| instruction | warpgroups a block | registers | shared | stored | dequantized | "
              "dequantized, 2 in flight | shared+alu | alu only | "
              "stored vs registers |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  row<32, 2>(sms, init, out, cycles), row<32, 4>(sms, init, out, cycles);
  row<64, 1>(sms, init, out, cycles), row<64, 2>(sms, init, out, cycles), row<64, 4>(sms, init, out, cycles);
  row<128, 1>(sms, init, out, cycles), row<128, 2>(sms, init, out, cycles), row<128, 4>(sms, init, out, cycles);
  row<256, 1>(sms, init, out, cycles), row<256, 2>(sms, init, out, cycles);
  std::printf("\nDecode shapes: cycles an SM per instruction (a 70B-up layer's instructions at 1.55 GHz), the weight "
              "words read as wgmma.cu reads them\n\n| instruction | warpgroups a block | registers | "
              "full dequantization | biased codes, groups scaled in fp32 |\n|---|---:|---:|---:|---:|\n");
  decode_row<8, 4>(sms, init, out, cycles);
  decode_row<16, 2>(sms, init, out, cycles), decode_row<16, 4>(sms, init, out, cycles);
  decode_row<32, 4>(sms, init, out, cycles);
  return 0;
}
