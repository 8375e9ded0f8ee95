// Device helpers shared by the marlin kernels (marlin.cu: mma.sync, any GPU from sm_80; decode.cu: up
// to 16 or 32 rows, any GPU from sm_80; wgmma.cu: Hopper): PTX wrappers, the per-dtype mma and
// dequantization, the kernel arguments, and the GPU facts that the launches need. The weight layout
// and the dequantization trick are described in marlin.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstring>

namespace litquant_marlin {

// ---------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_dst), "l"(src));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16(smem_address(dst), src); }
// The same through L1 (.ca): for data that other blocks on the SM read at about the same time.
__device__ __forceinline__ void cp_async16_via_l1(uint32_t smem_dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(smem_dst), "l"(src));
}

// Copies 16 bytes, or writes 16 zero bytes when `valid` is false (rows past M).
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(src_bytes));
}

// p + offset (in uint4) as one mad.wide.u32, in place of the compiler's 64-bit index math. (ptxas lowers most of
// these to a LEA + LEA.HI.X pair on the ALU pipe all the same; in decode.cu, moving them to IMAD.WIDE on the FMA
// pipe took no time off: benchmarks/results/2026-12-03-decode-address-math.md.)
__device__ __forceinline__ const uint4* offset_by(const uint4* p, uint32_t offset) {
  const uint4* r;
  asm("mad.wide.u32 %0, %1, 16, %2;\n" : "=l"(r) : "r"(offset), "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_src));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, smem_address(p)); }
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t smem_src) {  // lanes 0-15 give the rows
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_src));
}

// (a & mask) | magic in one instruction: lop3 with lookup table (0xF0 & 0xCC) | 0xAA.
__device__ __forceinline__ uint32_t mask_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}

__device__ __forceinline__ int load_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// *p += v, returning the old value: a release of this thread's prior writes (and those ordered before it
// by a block barrier) and an acquire of those released by the earlier adds.
__device__ __forceinline__ int add_acq_rel(int32_t* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Programmatic dependent launch (sm_90 on; `launch_dependent` below): a kernel so launched may start while the
// kernel before it in the stream still runs, once every block of that one has called
// allow_dependent_launch (or exited). Before the wait, a kernel may only read the weight words: integer
// tensors that only the load writes, and the load ends with a device synchronization (scales are float
// and may be converted by a kernel just before). Everything else comes after the wait, which returns
// once the prior kernel has finished and its writes are visible. So a layer's first weights stream in
// while the kernel before it (often the previous layer) ends.
__device__ __forceinline__ void wait_for_prior_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// An mbarrier of this block expecting `count` arrivals a phase; fence_barrier_init makes the inits of this thread
// visible to the cluster (sm_90 on), before other threads or blocks arrive on them.
__device__ __forceinline__ void init_barrier(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count));
}
__device__ __forceinline__ void fence_barrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

template <typename To, typename From>
__device__ __forceinline__ To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Per dtype: the mma instruction, the dequantization of one weight word, and output conversion
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Dtype;

template <>
struct Dtype<half> {
  using T2 = half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // 1024.0 in both halves
  static constexpr uint32_t kOnes = 0x3c003c00u;   // 1.0 in both halves

  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {  // a * b + c, pairwise
    uint32_t r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
  }
  static __device__ __forceinline__ T2 pack(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  static __device__ __forceinline__ float2 unpack(T2 v) { return __half22float2(v); }
  static __device__ __forceinline__ float low(uint32_t pair) { return __low2float(bit_cast<T2>(pair)); }
  static __device__ __forceinline__ float high(uint32_t pair) { return __high2float(bit_cast<T2>(pair)); }
};

template <>
struct Dtype<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // 128.0 in both halves
  static constexpr uint32_t kOnes = 0x3f803f80u;   // 1.0 in both halves

  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {  // a * b + c, pairwise
    uint32_t r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
  }
  static __device__ __forceinline__ T2 pack(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
  static __device__ __forceinline__ float2 unpack(T2 v) { return __bfloat1622float2(v); }
  // bf16 -> fp32 is a shift of the bits into the high half
  static __device__ __forceinline__ float low(uint32_t pair) { return __uint_as_float(pair << 16); }
  static __device__ __forceinline__ float high(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }
};

// The zero-point word of a symmetric weight: every nibble 8.
constexpr uint32_t kSymmetricZeros = 0x88888888u;

// The zero points of one weight word of a lane (subtiles 2j and 2j + 1, see the layout in marlin.cu), ready to
// center its codes: q - z, exact in either dtype. The decode kernel multiplies the centered codes and scales the
// fp32 sums; the other kernels scale the pairs (WordConstants).
template <typename T>
struct WordCenters;

// WordCenters::center's default step after centering a pair: none.
struct Unchanged {
  __device__ __forceinline__ uint32_t operator()(uint32_t pair, int) const { return pair; }
};

template <>
struct WordCenters<half> {
  half2 zero_low[2];   // 1024 + z: subtracted from low-nibble pairs, which hold 1024 + q
  half2 zero_high[2];  // -(64 + z): added to high-nibble pairs (1024 + 16q) after their 1/16 scaling

  // The zero point of subtile 2j + i (i = 0, 1). zero_bits: that of subtile 2j at nibbles 0 and 4, that of 2j + 1
  // at nibbles 1 and 5.
  __device__ __forceinline__ void load(uint32_t zero_bits, int i) {
    zero_low[i] = bit_cast<half2>(mask_or(zero_bits >> (4 * i), 0x000f000fu, Dtype<half>::kMagic));
    zero_high[i] = __hsub2(bit_cast<half2>(0x63806380u), zero_low[i]);  // 960 - (1024 + z)
  }

  // The word -> the pairs then(q - z, i) {b0b1, b2b3} of subtile 2j, then of subtile 2j + 1 (i = 0..3). The odd
  // nibbles stay 4 bits up, where they lie (1024 + 16q), and one fma by 1/16 centers them: one shift a word.
  template <typename Then = Unchanged>
  __device__ __forceinline__ void center(uint32_t q, uint32_t (&b)[4], Then then = {}) const {
    const half2 sixteenth = bit_cast<half2>(0x2c002c00u);
    const uint32_t low0 = mask_or(q, 0x000f000fu, Dtype<half>::kMagic);
    const uint32_t high0 = mask_or(q, 0x00f000f0u, Dtype<half>::kMagic);
    q >>= 8;
    const uint32_t low1 = mask_or(q, 0x000f000fu, Dtype<half>::kMagic);
    const uint32_t high1 = mask_or(q, 0x00f000f0u, Dtype<half>::kMagic);
    b[0] = then(bit_cast<uint32_t>(__hsub2(bit_cast<half2>(low0), zero_low[0])), 0);
    b[1] = then(bit_cast<uint32_t>(__hfma2(bit_cast<half2>(high0), sixteenth, zero_high[0])), 1);
    b[2] = then(bit_cast<uint32_t>(__hsub2(bit_cast<half2>(low1), zero_low[1])), 2);
    b[3] = then(bit_cast<uint32_t>(__hfma2(bit_cast<half2>(high1), sixteenth, zero_high[1])), 3);
  }
};

template <>
struct WordCenters<__nv_bfloat16> {
  __nv_bfloat162 zero[2];  // 128 + z: subtracted from the pairs, which hold 128 + q

  __device__ __forceinline__ void load(uint32_t zero_bits, int i) {
    zero[i] = bit_cast<__nv_bfloat162>(mask_or(zero_bits >> (4 * i), 0x000f000fu, Dtype<__nv_bfloat16>::kMagic));
  }

  // (bf16's 7 mantissa bits leave no room for fp16's high nibbles: three shifts a word.)
  template <typename Then = Unchanged>
  __device__ __forceinline__ void center(uint32_t q, uint32_t (&b)[4], Then then = {}) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t biased = mask_or(q >> (4 * i), 0x000f000fu, Dtype<__nv_bfloat16>::kMagic);
      b[i] = then(bit_cast<uint32_t>(__hsub2(bit_cast<__nv_bfloat162>(biased), zero[i / 2])), i);
    }
  }
};

// The constants of one weight word of a lane: the zero point and scale of each of its two subtiles, ready for
// the pair arithmetic.
template <typename T>
struct WordConstants {
  using T2 = typename Dtype<T>::T2;
  T2 scale[2];
  WordCenters<T> centers;

  // scale_pair: (scale of subtile 2j, scale of 2j + 1); zero_bits as WordCenters takes them. (Each subtile's scale
  // and zero point in turn, below each pair scaled as soon as it is centered, and the scales first in the struct:
  // the order of the code before WordCenters was split out, which gives marlin.cu the same PTX. In other orders
  // ptxas allocated and scheduled its mma.sync kernel otherwise, and the Ampere build ran 2-5% slower on an H200 at
  // M = 64..128: benchmarks/results/2026-12-02-word-centers.md.)
  __device__ __forceinline__ void load(uint32_t scale_pair, uint32_t zero_bits) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      scale[i] = bit_cast<T2>(__byte_perm(scale_pair, 0, i ? 0x3232 : 0x1010));
      centers.load(zero_bits, i);
    }
  }

  // The word -> B fragments {b0b1, b2b3} of subtile 2j, then of subtile 2j + 1: (q - z) s.
  __device__ __forceinline__ void dequant(uint32_t q, uint32_t (&b)[4]) const {
    centers.center(q, b, [this](uint32_t pair, int i) {
      return bit_cast<uint32_t>(__hmul2(bit_cast<T2>(pair), scale[i / 2]));
    });
  }
};

// The zero-point bits of word j (subtiles 2j, 2j + 1) from a lane's zero-point uint2, in which word w
// holds the zeros of subtiles 4w..4w+3 at nibbles {s, s + 4}.
__device__ __forceinline__ uint32_t word_zero_bits(uint2 z, int j) { return (j < 2 ? z.x : z.y) >> (8 * (j % 2)); }

// The lane's constants for one quantization group: those of its 4 weight words (8 subtiles).
template <typename T>
struct GroupConstants {
  WordConstants<T> word[4];

  __device__ __forceinline__ void load(uint4 s, uint2 z) {
    const uint32_t pairs[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) word[j].load(pairs[j], word_zero_bits(z, j));
  }

  // Word j of a lane's tile -> B fragments {b0b1, b2b3} of subtile 2j, then of subtile 2j + 1.
  __device__ __forceinline__ void dequant(uint32_t q, int j, uint32_t (&b)[4]) const { word[j].dequant(q, b); }
};

// ---------------------------------------------------------------------------------------------
// Kernel arguments and GPU facts
// ---------------------------------------------------------------------------------------------
struct GemmArgs {
  const uint4* x;        // [M, K/8]
  const uint4* qweight;  // [K/16, N/64, 32]
  const uint4* scales;   // [G, N/8]
  const uint2* zeros;    // [G, N/8] or nullptr (symmetric)
  const void* bias;      // [N] or nullptr
  void* out;             // [M, N]
  float4* partial;       // fp32 scratch: columns cut between blocks (marlin.cu), k splits or shared tiles (wgmma.cu)
  int32_t* locks;        // one per column (marlin.cu), 64-column tile (decode.cu) or shared tile (wgmma.cu),
                         // zero between calls
  int M, K, N;
  int group_shift;       // log2(group_size), or -1 for one group over all of K
  int units_per_block;   // marlin.cu: the stripe of each block
};

// The multiprocessor count, compute capability (the build's where that is older: marlin.cu) and L2 size of the current
// GPU, read once per device, and whether its kernels are launched as programmatic dependents (sm_90 on, unless
// LITQUANT_PDL=0 in the environment).
struct DeviceInfo {
  int sms = 0;
  int major = 0, minor = 0;
  int64_t l2_bytes = 0;
  bool dependent_launch = false;
};
DeviceInfo current_device();

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the kernel before it in
// the stream when `dependent` (then the kernel must call wait_for_prior_kernel, see above), and in clusters
// of `cluster_y` blocks along y when that is more than 1 (sm_90 on).
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             bool dependent, int cluster_y, Args... args) {
  cudaLaunchAttribute attributes[2];
  int count = 0;
  if (dependent) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_y > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {1, (unsigned)cluster_y, 1};
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = smem, config.stream = stream;
  config.attrs = attributes, config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// The decode path (decode.cu) for up to 16 activation rows, 32 on layers twice as wide as deep or as deep as
// wide (and K a multiple of 128): `decode_serves` says whether it takes the call, `decode_partial_floats` is the
// fp32 scratch it needs and `decode_gemm` runs it.
bool decode_serves(int M, int K, int N);
int64_t decode_partial_floats(const DeviceInfo& device, int M, int K, int N);
const char* decode_gemm(const GemmArgs& args, bool is_bf16, const DeviceInfo& device, bool after_small_kernel,
                        cudaStream_t stream);

// The Hopper path (wgmma.cu) for many rows. `wgmma_serves` says whether it takes this call (a Hopper
// GPU, and M past the decode sizes); then `wgmma_partial_floats` is the fp32 scratch it needs,
// `wgmma_lock_count` the locks, and `wgmma_gemm` runs it.
bool wgmma_serves(const DeviceInfo& device, int M, int N);
int64_t wgmma_partial_floats(const DeviceInfo& device, int M, int K, int N);
int64_t wgmma_lock_count(const DeviceInfo& device, int M, int K, int N);
const char* wgmma_gemm(const GemmArgs& args, bool is_bf16, const DeviceInfo& device, cudaStream_t stream);

}  // namespace litquant_marlin
