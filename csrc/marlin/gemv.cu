// The marlin kernel's path for one activation row (M = 1, token-by-token decode): the same 4-bit marlin
// layout as marlin.cu, multiplied on the CUDA cores in fp32. At M = 1 a tensor-core mma wastes 15 of
// its 16 rows, and the layer is a stream of weight bytes: what counts is the instructions per weight and
// the bytes in flight.
//
// Dequantization: a nibble is masked where it lies in its word and read as the bits of a *denormal*
//   fp32, q * 2^(b - 149) for a nibble at bit b, exactly; the activation it multiplies comes in scaled
//   by 2^(kXExponent - b), so every product is the normal fp32 x * q * 2^(kXExponent - 149), and the
//   FMAs take the denormal operand at full rate (CUDA does not flush fp32 denormals unless built with
//   -ftz=true, which this project never passes). Nibbles 5..7 reach the exponent bits (23+): they are
//   read from the word shifted right by 12, one shift for three. So a weight costs one lop3 (the AND)
//   and one FFMA; no OR with a magic exponent, no subtraction of it.
// Which activation a nibble multiplies: lane l holds, in each 16 x 64 tile, rows 2(l%4) + {0, 1, 8, 9}
//   of columns 8s + l/4 (s = 0..7, the B fragments of marlin.cu's layout); word j holds subtiles 2j and
//   2j + 1, nibble p the value NIBBLE_ORDER[p] (marlin.py): nibbles 0, 1, 4, 5 belong to subtile 2j and
//   rows +0, +8, +1, +9; nibbles 2, 3, 6, 7 to subtile 2j + 1, rows +0, +8, +1, +9. So a lane needs 4
//   activations per tile (two 32-bit loads) and 8 scaled copies of them, for 32 weights.
// Scale and zero point: per group, in fp32, after the sums: acc_s += scale_s * partial_s
//   - scale_s * z_s * sum_x (the lane's own rows; the 4 lanes of a column add up to all 16 rows of a tile).
// Work split: a block of kWarps warps takes one 64-column tile and one of `splits` k ranges; its warps
//   take consecutive 128-row chunks of that range. A warp streams its chunks through a ring of 8
//   registers (uint4), each refilled with the next chunk's tile as soon as it is read: 4 KB a warp in
//   flight, 64 KB an SM at kBlocksPerSm blocks. Warps add up through shared memory; with
//   several splits, each block writes fp32 partial sums and the last block of a column tile to finish
//   (counted on its lock, which it then resets to zero) adds them up and writes the output.
#include "common.cuh"

namespace litquant_marlin {
namespace {

constexpr int kWarps = 4;
// Blocks resident per SM: __launch_bounds__ then allows 128 registers a thread (ptxas: 121-124, no
// spills). Measured on an H200, 70B-up: 67.8 us at 4 blocks against 76-79 us at 3 (159 registers).
constexpr int kBlocksPerSm = 4;
constexpr int kChunkTiles = 8;  // k16 tiles per chunk: 128 rows, 8 uint4 per lane
// Products are x * q * 2^-49: normal fp32 for |x q| >= 2^-77; and x * 2^100 is finite for |x| < 2^27.
constexpr int kXExponent = 100;

// 2^e for a normal exponent (-126 <= e <= 127); folded to a constant where e is one
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }
__device__ __forceinline__ float unit() { return pow2(kXExponent - 149); }  // the value of 1 in the accumulators

// Nibble p of a word: its bit position as read (p >= 5 from the word >> 12), and the activation it
// multiplies: 0, 1, 2, 3 for rows +0, +1, +8, +9 of the lane's rows (odd nibbles: +8; p >= 4: +1).
__host__ __device__ constexpr int nibble_bit(int p) { return p < 5 ? 4 * p : 4 * p - 12; }
__host__ __device__ constexpr int nibble_x(int p) { return 2 * (p % 2) + p / 4; }

// 16 bytes read once (not kept in L1), if `valid`; else nothing is read and the value is undefined.
__device__ __forceinline__ uint4 load_streaming(const uint4* p, bool valid) {
  uint4 r;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "r"((int)valid));
  return r;
}

template <typename T, int kFoldTiles, bool kHasZeros>
struct Gemv {
  const GemmArgs& args;
  const int lane, column_tile;
  float acc[8] = {}, partial[8] = {}, x_sum = 0.f;

  __device__ Gemv(const GemmArgs& a, int col) : args(a), lane(threadIdx.x % 32), column_tile(col) {}

  // partial += the products of one tile; x_sum += its 4 activations of this lane.
  __device__ __forceinline__ void multiply_tile(const uint4& w, int tile) {
    const uint32_t* x = reinterpret_cast<const uint32_t*>(args.x) + tile * 8 + lane % 4;
    const uint32_t pair_low = __ldg(x), pair_high = __ldg(x + 4);  // rows +0 +1, rows +8 +9
    const float xv[4] = {Dtype<T>::low(pair_low), Dtype<T>::high(pair_low), Dtype<T>::low(pair_high),
                         Dtype<T>::high(pair_high)};
    x_sum += (xv[0] + xv[1]) + (xv[2] + xv[3]);
    float xs[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) xs[p] = xv[nibble_x(p)] * pow2(kXExponent - nibble_bit(p));
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t high = words[j] >> 12;
#pragma unroll
      for (int p = 0; p < 8; ++p) {
        const uint32_t field = (p < 5 ? words[j] : high) & (0xfu << nibble_bit(p));
        partial[2 * j + (p % 4) / 2] = fmaf(xs[p], __uint_as_float(field), partial[2 * j + (p % 4) / 2]);
      }
    }
  }

  // acc += scale * partial - scale * z * x_sum for the group of `tile`; then partial = x_sum = 0.
  __device__ __forceinline__ void fold(int tile) {
    const int group = args.group_shift < 0 ? 0 : (tile * 16) >> args.group_shift;
    const size_t at = (size_t)group * (args.N / 8) + column_tile * 8 + lane / 4;
    const uint4 s = __ldg(args.scales + at);
    uint2 z = make_uint2(kSymmetricZeros, kSymmetricZeros);
    if constexpr (kHasZeros) z = __ldg(args.zeros + at);
    const uint32_t scale_pairs[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float scale = i % 2 ? Dtype<T>::high(scale_pairs[i / 2]) : Dtype<T>::low(scale_pairs[i / 2]);
      const float zero = (float)(((i < 4 ? z.x : z.y) >> (4 * (i % 4))) & 0xf);
      acc[i] = fmaf(scale, partial[i], acc[i]);
      acc[i] = fmaf(-scale * zero * unit(), x_sum, acc[i]);
      partial[i] = 0.f;
    }
    x_sum = 0.f;
  }

  // Chunks [first, last), with a ring of kChunkTiles loads in flight: the register of tile t is
  // refilled with tile t of the next chunk as soon as it has been read, so a warp always has 8 uint4
  // (4 KB) on the way, in 32 registers. No branches: the loads past `last` are predicated off.
  __device__ __forceinline__ void run(int first, int last) {
    const uint4* column = args.qweight + column_tile * 32 + lane;
    const uint32_t stride = args.N / 64 * 32;  // uint4 from a tile to the next k16 tile
    uint32_t next = (uint32_t)first * kChunkTiles * stride;  // the next tile to load
    uint4 ring[kChunkTiles];
#pragma unroll
    for (int t = 0; t < kChunkTiles; ++t, next += stride)
      ring[t] = load_streaming(offset_by(column, next), first < last);
    for (int c = first; c < last; ++c) {
#pragma unroll
      for (int t = 0; t < kChunkTiles; ++t, next += stride) {
        const uint4 w = ring[t];
        ring[t] = load_streaming(offset_by(column, next), c + 1 < last);
        multiply_tile(w, c * kChunkTiles + t);
        if ((t + 1) % kFoldTiles == 0) fold(c * kChunkTiles + t);  // the end of a group
      }
    }
  }
};

template <typename T, int kFoldTiles, bool kHasZeros>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm) marlin_gemv_kernel(const GemmArgs args, int splits) {
  __shared__ float sums[kWarps][64];
  __shared__ bool last_block;
  const int column_tile = blockIdx.x, split = blockIdx.y, warp = threadIdx.x / 32;
  const int chunks = args.K / (kChunkTiles * 16);
  // warp w of split y takes the (y * kWarps + w)-th of splits * kWarps near-equal runs of chunks
  const int runs = splits * kWarps, run = split * kWarps + warp;
  Gemv<T, kFoldTiles, kHasZeros> gemv(args, column_tile);
  gemv.run(chunks * run / runs, chunks * (run + 1) / runs);

  // the 4 lanes of a column (lanes l, l^1, l^2, l^3) hold its 4 row pairs of every tile
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    gemv.acc[s] += __shfl_xor_sync(0xffffffffu, gemv.acc[s], 1);
    gemv.acc[s] += __shfl_xor_sync(0xffffffffu, gemv.acc[s], 2);
    if (gemv.lane % 4 == 0) sums[warp][8 * s + gemv.lane / 4] = gemv.acc[s];
  }
  __syncthreads();
  // thread t < 32 finishes columns 2t and 2t + 1 of the tile
  const int t = threadIdx.x, pair = column_tile * 32 + t;
  float2 total = make_float2(0.f, 0.f);
  if (t < 32) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total.x += sums[w][2 * t], total.y += sums[w][2 * t + 1];
  }
  if (splits > 1) {
    float2* partial = reinterpret_cast<float2*>(args.partial);
    if (t < 32) {
      partial[(size_t)split * (args.N / 2) + pair] = total;
      __threadfence();
    }
    __syncthreads();
    if (t == 0) last_block = atomicAdd(&args.locks[column_tile], 1) == splits - 1;
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    if (t < 32) {
      total = make_float2(0.f, 0.f);
      for (int y = 0; y < splits; ++y) {
        const float2 v = __ldcg(partial + (size_t)y * (args.N / 2) + pair);
        total.x += v.x, total.y += v.y;
      }
    }
    if (t == 0) args.locks[column_tile] = 0;  // every split has arrived: ready for the next call
  }
  if (t < 32) {
    using T2 = typename Dtype<T>::T2;
    const float2 b = args.bias ? Dtype<T>::unpack(static_cast<const T2*>(args.bias)[pair]) : make_float2(0.f, 0.f);
    static_cast<T2*>(args.out)[pair] = Dtype<T>::pack(total.x / unit() + b.x, total.y / unit() + b.y);
  }
}

// Splits of K (powers of two): the fewest that give at least 60% of a wave of blocks and at most 16
// chunks a warp, while each warp keeps 2 chunks or more. Measured on an H200 (bf16, g128), the best or
// within 5% of the best split on each Llama-2 7B/70B layer (benchmarks/results/2026-11-30-marlin-gemv.md).
int gemv_splits(const DeviceInfo& device, int K, int N) {
  const int column_tiles = N / 64, chunks = K / (kChunkTiles * 16), wave = kBlocksPerSm * device.sms;
  int splits = 1;
  while ((10 * column_tiles * splits < 6 * wave || chunks > 16 * kWarps * splits) && chunks >= 4 * kWarps * splits)
    splits *= 2;
  return splits;
}

template <typename T, int kFoldTiles>
const char* launch(const GemmArgs& args, int splits, cudaStream_t stream) {
  const dim3 grid(args.N / 64, splits);
  if (args.zeros)
    marlin_gemv_kernel<T, kFoldTiles, true><<<grid, kWarps * 32, 0, stream>>>(args, splits);
  else
    marlin_gemv_kernel<T, kFoldTiles, false><<<grid, kWarps * 32, 0, stream>>>(args, splits);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T>
const char* dispatch_group(const GemmArgs& args, int splits, cudaStream_t stream) {
  switch (args.group_shift) {  // fold once per group: 2, 4 or 8 tiles (one group over K: every 8)
    case 5: return launch<T, 2>(args, splits, stream);
    case 6: return launch<T, 4>(args, splits, stream);
    default: return launch<T, 8>(args, splits, stream);
  }
}

}  // namespace

bool gemv_serves(int M, int K) { return M == 1 && K % (kChunkTiles * 16) == 0; }

int64_t gemv_partial_floats(const DeviceInfo& device, int K, int N) {
  const int splits = gemv_splits(device, K, N);
  return splits > 1 ? (int64_t)splits * N : 0;
}

const char* gemv_gemm(const GemmArgs& args, bool is_bf16, const DeviceInfo& device, cudaStream_t stream) {
  const int splits = gemv_splits(device, args.K, args.N);
  return is_bf16 ? dispatch_group<__nv_bfloat16>(args, splits, stream) : dispatch_group<half>(args, splits, stream);
}

}  // namespace litquant_marlin
