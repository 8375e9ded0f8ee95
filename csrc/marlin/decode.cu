// The marlin kernel's decode path: M = 1..16 activation rows (token-by-token decode, small batches,
// speculative drafts), on the same 4-bit marlin layout as marlin.cu. At these sizes a layer is a
// stream of weight bytes: what counts is the bytes in flight and the instructions per weight, so the
// weights go from global memory straight into registers (no shared-memory staging, no block barriers
// in the loop), at 16 warps per SM.
//
// One streaming loop, two ways to multiply:
//   RowOnCudaCores (M = 1), in fp32. A nibble is masked where it lies in its word and read as the
//     bits of a *denormal* fp32, q * 2^(b - 149) for a nibble at bit b, exactly; the activation it
//     multiplies comes in scaled by 2^(kXExponent - b), so every product is the normal fp32
//     x * q * 2^(kXExponent - 149), and the FMAs take the denormal operand at full rate (CUDA does not
//     flush fp32 denormals unless built with -ftz=true, which this project never passes). Nibbles
//     5..7 reach the exponent bits (23+): they are read from the word shifted right by 12, one shift
//     for three. So a weight costs one lop3 (the AND) and one FFMA. At M = 1 an mma would waste 15 of
//     its 16 rows. Scale and zero point per group in fp32, after the sums:
//     acc_s += scale_s * partial_s - scale_s * z_s * sum_x (the lane's own rows; the 4 lanes of a
//     column add up to all 16 rows of a tile). A lane needs, per tile, its 4 activations in 8 scaled
//     copies: it converts and scales them itself. (bf16 once had each chunk's copies prepared per warp in
//     shared memory, as its conversion takes integer instructions: up to 4% faster then, level or slower
//     once the group parameters were read early: benchmarks/results/2026-12-01-decode-streaming.md.)
//   RowsOnTensorCores (M = 2..16): a lane's uint4 of a 16 x 64 tile *is* its B fragments of the 8
//     n8 subtiles (the marlin layout); each word is dequantized per pair with the group's scale and
//     zero point (GroupConstants, as in marlin.cu) and fed to two mma.m16n8k16. Each warp copies the
//     activations of its next chunk (the M real rows of 128 k values) into its own shared-memory
//     double buffer with cp.async, through L1: the blocks on an SM stream the same k ranges (their
//     warp w takes the same chunks) at about the same time. ldmatrix reads the A fragments. (A
//     fragments read straight from global memory cost 8 cache lines a load, as the rows are K apart:
//     25-40% slower at M = 16, benchmarks/results/2026-11-30-marlin-decode-tc.md.)
// Which activation a nibble multiplies (the CUDA-core path): lane l holds, in each 16 x 64 tile, rows
//   2(l%4) + {0, 1, 8, 9} of columns 8s + l/4 (s = 0..7); word j holds subtiles 2j and 2j + 1, nibble
//   p the value NIBBLE_ORDER[p] (marlin.py): nibbles 0, 1, 4, 5 belong to subtile 2j and rows +0, +8,
//   +1, +9; nibbles 2, 3, 6, 7 to subtile 2j + 1, rows +0, +8, +1, +9.
// Work split: a block of kWarps warps takes one 64-column tile and one of `splits` k ranges; its warps
//   take consecutive 128-row chunks of that range. A warp streams its chunks through a ring of 8
//   registers (uint4), each refilled with the next chunk's tile as soon as it is read: 4 KB a warp in
//   flight, 64 KB an SM at 4 blocks (a deeper ring, 8-16 tiles in shared memory filled by cp.async, was
//   slower on nearly every layer, by up to 22%: benchmarks/results/2026-12-01-decode-streaming.md).
//   Warps add up through shared memory; with several splits, each block writes fp32 partial sums and
//   the last block of a column tile to finish (counted on its lock, which it then resets to zero) adds
//   them up and writes the output; on Hopper, 2 splits are a cluster of 2 blocks that add up each other's
//   sums straight from shared memory (distributed shared memory), with no global round trips. A grid
//   that fills the GPU is launched as a dependent of the kernel ahead (common.cuh): each warp's first
//   chunk of weights is on its way before it waits for that kernel.
#include <type_traits>

#include "common.cuh"

namespace litquant_marlin {
namespace {

constexpr int kWarps = 4;
// Blocks resident per SM: __launch_bounds__ then allows 128 registers a thread. Measured on an H200,
// 70B-up at M = 1: 67.8 us at 4 blocks against 76-79 us at 3 (159 registers).
constexpr int kBlocksPerSm = 4;
constexpr int kChunkTiles = 8;  // k16 tiles per chunk: 128 rows, 8 uint4 per lane
constexpr int kMaxRows = 16;    // one m16 row block
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

// A lane's scales (its 8 columns, in pairs) and zero points (nibbles) of the quantization group of `tile`,
// read at (group, 64-column tile, lane/4) of the permuted scales and the packed zero points.
struct GroupParams {
  uint4 scales;
  uint2 zeros;
};

template <bool kHasZeros>
__device__ __forceinline__ GroupParams load_group_params(const GemmArgs& args, int tile, int column_tile, int lane) {
  const int group = args.group_shift < 0 ? 0 : (tile * 16) >> args.group_shift;
  const size_t at = (size_t)group * (args.N / 8) + column_tile * 8 + lane / 4;
  GroupParams p{__ldg(args.scales + at), make_uint2(kSymmetricZeros, kSymmetricZeros)};
  if constexpr (kHasZeros) p.zeros = __ldg(args.zeros + at);
  return p;
}

// Tiles of a quantization group inside a chunk: 2, 4 or 8 (a group over all of K: every chunk)
__device__ __forceinline__ int tiles_per_group(const GemmArgs& args) {
  return args.group_shift < 0 ? kChunkTiles : min(kChunkTiles, 1 << (args.group_shift - 4));
}

// Each way to multiply keeps its own accumulators and a warp's shared memory (Staging), and provides:
// begin (before the warp's run of chunks), start_chunk, start_group / end_group (at the first and
// the last tile of each quantization group), multiply_tile (one 16 x 64 weight tile, one uint4 a
// lane; given the tile's index along K and its place in the chunk) and store (the warp's sums, as
// plain values, into a [kRows][64] tile).
template <typename T, bool kHasZeros>
struct RowOnCudaCores {
  static constexpr int kRows = 1;
  struct Staging {};  // none: a lane reads its activations from global memory (L1)
  const GemmArgs& args;
  const int lane, column_tile;
  float acc[8] = {}, partial[8] = {}, x_sum = 0.f;
  GroupParams params;  // those of the current group, read as it starts

  __device__ RowOnCudaCores(const GemmArgs& a, int col, Staging&) : args(a), lane(threadIdx.x % 32), column_tile(col) {}

  // The 8 copies of the 4 activations of class `cls` (rows 2 cls + {0, 1, 8, 9}) of `tile` that nibbles
  // 0..7 multiply; returns the sum of the 4.
  __device__ __forceinline__ float scaled_activations(int tile, int cls, float (&xs)[8]) const {
    const uint32_t* x = reinterpret_cast<const uint32_t*>(args.x) + tile * 8 + cls;
    const uint32_t pair_low = __ldg(x), pair_high = __ldg(x + 4);  // rows +0 +1, rows +8 +9
    const float xv[4] = {Dtype<T>::low(pair_low), Dtype<T>::high(pair_low), Dtype<T>::low(pair_high),
                         Dtype<T>::high(pair_high)};
#pragma unroll
    for (int p = 0; p < 8; ++p) xs[p] = xv[nibble_x(p)] * pow2(kXExponent - nibble_bit(p));
    return (xv[0] + xv[1]) + (xv[2] + xv[3]);
  }

  __device__ __forceinline__ void begin(int, int) {}
  __device__ __forceinline__ void start_chunk(int, int) {}

  // A group's scales and zero points are read as it starts, so the load has the group's tiles to land (read at
  // its end, where they are used, each warp waited one memory latency a group: they are not in L2, each is
  // read once, by one warp). Measured on an H200 (M = 1, g128, interleaved): 2-7% faster on every Llama-2
  // layer in fp16 and in bf16 without zero points (70B-up bf16 66.2-67.5 -> 63.0-63.4 us, 94% of the copy
  // bandwidth), bf16 with zero points within 1.5% (benchmarks/results/2026-12-01-decode-streaming.md).
  __device__ __forceinline__ void start_group(int tile) {
    params = load_group_params<kHasZeros>(args, tile, column_tile, lane);
  }

  // partial += the products of one tile; x_sum += its 4 activations of this lane.
  __device__ __forceinline__ void multiply_tile(const uint4& w, int tile, int) {
    float xs[8];
    x_sum += scaled_activations(tile, lane % 4, xs);
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

  // acc += scale * partial - scale * z * x_sum for the current group; then partial = x_sum = 0.
  __device__ __forceinline__ void end_group(int) {
    const uint4 s = params.scales;
    const uint2 z = params.zeros;
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

  // Row 0 of the tile: the 4 lanes of a column (l, l^1, l^2, l^3) hold its 4 row pairs of every tile.
  __device__ __forceinline__ void store(float (&sums)[kRows][64]) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      float v = acc[s] + __shfl_xor_sync(0xffffffffu, acc[s], 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (lane % 4 == 0) sums[0][8 * s + lane / 4] = v / unit();
    }
  }
};

template <typename T, bool kHasZeros>
struct RowsOnTensorCores {
  static constexpr int kRows = kMaxRows;
  // Per warp, two chunks of activations (double buffer): 16 rows x 16 uint4 (128 k values), rows
  // padded to 17 uint4 so that the 8 rows an ldmatrix matrix reads fall in 8 different bank groups;
  // a lane's ldmatrix address is then the same for every tile plus a constant offset.
  static constexpr int kRowStride = 17;
  struct Staging {
    uint4 x[2][kMaxRows * kRowStride];
  };
  static constexpr uint32_t kBufferBytes = sizeof(Staging) / 2;
  // bf16 reads each group's scales and zero points one group ahead (the first tile of a group uses them);
  // fp16, whose kernels then spill (20 -> 56 bytes), when the group starts. Measured on an H200 (g128, zero
  // points, interleaved): bf16 M = 2..16 70B-qkv 6-10% faster (25.5 -> 23.0 us at M = 16), the other Llama-2
  // layers level to 3% faster; fp16 ahead 3-10% slower (benchmarks/results/2026-12-01-decode-streaming.md).
  static constexpr bool kParamsAhead = std::is_same<T, __nv_bfloat16>::value;
  const GemmArgs& args;
  const int lane, column_tile;
  const uint32_t copy_to;    // shared address of the lane's first copy (row lane/16, k/8 = lane % 16), buffer 0
  const uint32_t read_from;  // shared address of the lane's ldmatrix row for tile 0, buffer 0
  int first = 0;
  uint32_t a_chunk = 0;  // read_from in the current chunk's buffer
  float acc[8][4] = {};  // subtile s: rows lane/4 + {0, 8} x columns 8s + 2(lane % 4) + {0, 1}
  GroupConstants<T> group;
  GroupParams next;  // kParamsAhead: those of the next group

  __device__ RowsOnTensorCores(const GemmArgs& a, int col, Staging& st)
      : args(a),
        lane(threadIdx.x % 32),
        column_tile(col),
        copy_to(smem_address(&st.x[0][(lane / 16) * kRowStride + lane % 16])),
        // ldmatrix: lane l gives row l % 16 of the matrix l / 8 (a0..a3: rows 0-7 / 8-15 x k 0-7 / 8-15)
        read_from(smem_address(&st.x[0][(lane % 16) * kRowStride + lane / 16])) {}

  // Chunk c's activations into buffer b: the lane copies k values 8(lane % 16).. of rows lane/16 + 2i
  // (rows past M are left as they are: an output row depends on its own A row only, and those
  // outputs are never written).
  __device__ __forceinline__ void copy_chunk(int c, int b) {
    const int rows_left = args.M - lane / 16;  // rows 2i + lane/16 < M
    const uint4* x = args.x + (size_t)(lane / 16) * (args.K / 8) + c * 16 + lane % 16;
    const uint32_t to = copy_to + b * kBufferBytes;
#pragma unroll
    for (int i = 0; i < kMaxRows / 2; ++i, x += args.K / 4) {
      if (2 * i < rows_left) cp_async16_via_l1(to + 2 * i * kRowStride * 16, x);
    }
    cp_async_commit();
  }

  __device__ __forceinline__ void begin(int first_chunk, int last_chunk) {
    first = first_chunk;
    if (first < last_chunk) copy_chunk(first, 0);
    if constexpr (kParamsAhead) next = load_group_params<kHasZeros>(args, first * kChunkTiles, column_tile, lane);
  }

  // Before chunk c: everyone is done with chunk c - 1's buffer, which now receives chunk c + 1;
  // chunk c's copy has landed (for every lane, after the __syncwarp).
  __device__ __forceinline__ void start_chunk(int c, int last_chunk) {
    __syncwarp();
    if (c + 1 < last_chunk) copy_chunk(c + 1, (c + 1 - first) & 1);
    else cp_async_commit();  // an empty group keeps the count of the wait below
    cp_async_wait<1>();
    __syncwarp();
    a_chunk = read_from + ((c - first) & 1) * kBufferBytes;
  }

  __device__ __forceinline__ void start_group(int tile) {
    if constexpr (kParamsAhead) {
      group.load(next.scales, next.zeros);
      // the next group's (the last group's again at the end of K: an address that exists)
      const int next_tile = min(tile + tiles_per_group(args), args.K / 16 - 1);
      next = load_group_params<kHasZeros>(args, next_tile, column_tile, lane);
    } else {
      const GroupParams p = load_group_params<kHasZeros>(args, tile, column_tile, lane);
      group.load(p.scales, p.zeros);
    }
  }

  __device__ __forceinline__ void end_group(int) {}

  // Tile t of the current chunk.
  __device__ __forceinline__ void multiply_tile(const uint4& w, int, int t) {
    uint32_t a[4];
    ldmatrix_x4(a, a_chunk + 32 * t);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b[4];
      group.dequant(words[j], j, b);
      Dtype<T>::mma(acc[2 * j], a, b[0], b[1]);
      Dtype<T>::mma(acc[2 * j + 1], a, b[2], b[3]);
    }
  }

  __device__ __forceinline__ void store(float (&sums)[kRows][64]) {
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) sums[lane / 4 + 8 * (i / 2)][8 * s + 2 * (lane % 4) + i % 2] = acc[s][i];
  }
};

// Chunks [first, last) of one 64-column tile, with a ring of kChunkTiles loads in flight: the
// register of tile t is refilled with tile t of the next chunk as soon as it has been read, so a warp
// always has 8 uint4 (4 KB) on the way, in 32 registers. No branches: the loads past `last` are
// predicated off.
template <int kGroupTiles, typename Multiplier>
__device__ __forceinline__ void stream_chunks(Multiplier& math, const GemmArgs& args, int column_tile, int first,
                                              int last) {
  const uint4* column = args.qweight + column_tile * 32 + threadIdx.x % 32;
  const uint32_t stride = args.N / 64 * 32;  // uint4 from a tile to the next k16 tile
  uint32_t next = (uint32_t)first * kChunkTiles * stride;  // the next tile to load
  uint4 ring[kChunkTiles];
#pragma unroll
  for (int t = 0; t < kChunkTiles; ++t, next += stride) ring[t] = load_streaming(offset_by(column, next), first < last);
  wait_for_prior_kernel();  // the first chunk's weights are on their way while the prior kernel ends
  math.begin(first, last);
  for (int c = first; c < last; ++c) {
    math.start_chunk(c, last);
#pragma unroll
    for (int t = 0; t < kChunkTiles; ++t, next += stride) {
      const uint4 w = ring[t];
      ring[t] = load_streaming(offset_by(column, next), c + 1 < last);
      const int tile = c * kChunkTiles + t;
      if (t % kGroupTiles == 0) math.start_group(tile);
      math.multiply_tile(w, tile, t);
      if ((t + 1) % kGroupTiles == 0) math.end_group(tile);
    }
  }
}

// Distributed shared memory (sm_90 on): a block cluster's blocks read each other's shared memory.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ float2 load_from_block(const float* local, int rank) {  // at `local` in block `rank`
  float2 v = make_float2(0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_address(local)), "r"(rank));
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
#endif
  return v;
}

template <typename T, template <typename, bool> class Math, int kGroupTiles, bool kHasZeros>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
    marlin_decode_kernel(const GemmArgs args, int splits, bool clustered) {
  using Multiplier = Math<T, kHasZeros>;
  __shared__ union {  // the warps' staging while they stream, then their sums
    typename Multiplier::Staging staging[kWarps];
    float sums[kWarps][Multiplier::kRows][64];
  } shared;
  __shared__ bool last_block;
  allow_dependent_launch();
  const int column_tile = blockIdx.x, split = blockIdx.y, warp = threadIdx.x / 32, t = threadIdx.x;
  const int chunks = args.K / (kChunkTiles * 16);
  // warp w of split y takes the (y * kWarps + w)-th of splits * kWarps near-equal runs of chunks
  const int runs = splits * kWarps, run = split * kWarps + warp;
  {
    Multiplier math(args, column_tile, shared.staging[warp]);
    stream_chunks<kGroupTiles>(math, args, column_tile, chunks * run / runs, chunks * (run + 1) / runs);
    __syncthreads();  // every warp is done with its staging
    math.store(shared.sums[warp]);
  }
  __syncthreads();

  // Thread t takes the column pairs i = t, t + 128, ... of the [M, 32] pairs of the tile.
  const int pairs = args.M * 32;
  const size_t row_pairs = args.N / 2;  // float2 / T2 in a row of the output
  auto at = [&](int i) { return (size_t)(i / 32) * row_pairs + column_tile * 32 + i % 32; };
  auto write = [&](int i, float2 total) {
    using T2 = typename Dtype<T>::T2;
    const int pair = column_tile * 32 + i % 32;
    const float2 b = args.bias ? Dtype<T>::unpack(static_cast<const T2*>(args.bias)[pair]) : make_float2(0.f, 0.f);
    static_cast<T2*>(args.out)[at(i)] = Dtype<T>::pack(total.x + b.x, total.y + b.y);
  };
  auto warp_sum = [&](int i) {
    float2 total = make_float2(0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* sums = &shared.sums[w][i / 32][2 * (i % 32)];
      total.x += sums[0], total.y += sums[1];
    }
    return total;
  };
  if (splits == 1) {
    for (int i = t; i < pairs; i += kWarps * 32) write(i, warp_sum(i));
    return;
  }
  if (clustered) {  // the splits of this column tile are one cluster, block `split` its rank
    // Each block adds up its warps' sums (into warp 0's place), then takes its share of the tile's pairs
    // and adds up the blocks' sums in rank order, reading them from their shared memory. The second
    // barrier keeps every block's shared memory alive until the others have read it.
    for (int i = t; i < pairs; i += kWarps * 32) {
      const float2 total = warp_sum(i);
      shared.sums[0][i / 32][2 * (i % 32)] = total.x, shared.sums[0][i / 32][2 * (i % 32) + 1] = total.y;
    }
    cluster_sync();
    for (int i = pairs * split / splits + t; i < pairs * (split + 1) / splits; i += kWarps * 32) {
      float2 total = make_float2(0.f, 0.f);
      for (int rank = 0; rank < splits; ++rank) {
        const float2 v = load_from_block(&shared.sums[0][i / 32][2 * (i % 32)], rank);
        total.x += v.x, total.y += v.y;
      }
      write(i, total);
    }
    cluster_sync();
    return;
  }
  float2* partial = reinterpret_cast<float2*>(args.partial);
  const size_t split_pairs = (size_t)args.M * row_pairs;
  for (int i = t; i < pairs; i += kWarps * 32) partial[split * split_pairs + at(i)] = warp_sum(i);
  // One add with release and acquire semantics by one thread, after the block barrier (in place of a fence by
  // every thread before a relaxed add, and another after it): 1-3% faster on the layers of 4 and 8 splits
  // (7B-down M = 1 11.2 -> 10.8 us, 70B-qkv 18.5 -> 18.2).
  __syncthreads();
  if (t == 0) last_block = add_acq_rel(&args.locks[column_tile], 1) == splits - 1;
  __syncthreads();
  if (!last_block) return;
  for (int i = t; i < pairs; i += kWarps * 32) {
    float2 total = make_float2(0.f, 0.f);
    for (int y = 0; y < splits; ++y) {
      const float2 v = __ldcg(partial + y * split_pairs + at(i));
      total.x += v.x, total.y += v.y;
    }
    write(i, total);
  }
  if (t == 0) args.locks[column_tile] = 0;  // every split has arrived: ready for the next call
}

// How evenly `blocks` blocks of equal work spread over the SMs: their count over the SMs times the
// most blocks one SM runs.
double balance(int blocks, int sms) { return blocks / (double)(sms * ((blocks + sms - 1) / sms)); }

// Splits of K (powers of two): the fewest that give at least 60% of a wave of blocks and at most 16
// chunks a warp, while each warp keeps 2 chunks or more; then twice as many if that spreads the blocks
// over the SMs better by a tenth or more. Measured on an H200 (bf16, g128, M = 1), the best or within 5%
// of the best split on each Llama-2 7B/70B layer (benchmarks/results/2026-11-30-marlin-gemv.md); the last
// step takes 70B-qkv from 2 splits (320 blocks: 2 or 3 an SM, 81%) to 4 (640: 4 or 5, 97%), 19.4 -> 18.5 us,
// where 7B-qkv (384 -> 768 blocks) and 7B-up (344 -> 688) spread no better and were 10-12% slower
// (benchmarks/results/2026-11-30-dependent-launch.md).
int decode_splits(const DeviceInfo& device, int K, int N) {
  const int column_tiles = N / 64, chunks = K / (kChunkTiles * 16), wave = kBlocksPerSm * device.sms;
  int splits = 1;
  while ((10 * column_tiles * splits < 6 * wave || chunks > 16 * kWarps * splits) && chunks >= 4 * kWarps * splits)
    splits *= 2;
  if (chunks >= 4 * kWarps * splits &&
      balance(2 * column_tiles * splits, device.sms) >= balance(column_tiles * splits, device.sms) + 0.1)
    splits *= 2;
  return splits;
}

// Whether a grid of `blocks` is launched as a dependent of the kernel before it (common.cuh): only when it
// takes 90% of the resident slots or more. A smaller grid's blocks, let in early, take the slots that the
// kernel before leaves free, so more of them land on some SMs than on others, and the SMs that get more
// finish last. Measured on an H200 (bf16, g128, M = 1, interleaved): at 0.6-0.7 of a wave 16-24% slower
// (7B-qkv 12.0 -> 13.8 us, 7B-up 17.4 -> 21.5, 70B-qkv on 2 splits 19.4 -> 23.3); at a wave or more 1-8%
// faster (7B-down 11.9 -> 11.3, 70B-down 39.5 -> 39.0, 70B-up 68.0 -> 67.4, 7B-qkv on 4 splits 13.2 -> 12.2;
// benchmarks/results/2026-11-30-dependent-launch.md).
bool decode_launch_dependent(const DeviceInfo& device, int blocks) {
  return device.dependent_launch && 10 * blocks >= 9 * kBlocksPerSm * device.sms;
}

// Whether the k splits add up in a block cluster (sm_90 on) rather than through global memory and a lock: for
// 2 splits. Measured on an H200 (g128, interleaved; benchmarks/results/2026-12-01-decode-reduction.md): the
// lock path's last-block sum costs 1.0-3.2 us (13-19% on the 7B layers of 2 and 8 splits); clusters of 2 take
// 7B-qkv (2 splits) 6-15% faster (M = 1 11.8 -> 10.9 us, M = 16 17.2 -> 14.6); clusters of 4 and 8 were up to
// 27% slower where the grid is about one wave (70B-down M = 1 38.2 -> 45.5 us, 7B-down 11.1 -> 13.2), level on
// 70B-qkv (1.2 waves), presumably as fewer blocks fit at once when the blocks of a cluster must be placed together.
bool decode_clustered(const DeviceInfo& device, int splits) {
  return device.major >= 9 && splits == 2;
}

// How a layer runs on this GPU: its k splits, whether the grid is a programmatic dependent of the kernel ahead,
// and whether the splits add up in a cluster.
struct DecodePlan {
  int splits;
  bool dependent, clustered;
};

DecodePlan plan_decode(const DeviceInfo& device, int K, int N) {
  const int splits = decode_splits(device, K, N);
  return {splits, decode_launch_dependent(device, N / 64 * splits), decode_clustered(device, splits)};
}

template <typename T, template <typename, bool> class Math, int kGroupTiles>
const char* launch(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  auto kernel = args.zeros ? marlin_decode_kernel<T, Math, kGroupTiles, true>
                           : marlin_decode_kernel<T, Math, kGroupTiles, false>;
  const cudaError_t err =
      launch_dependent(kernel, dim3(args.N / 64, plan.splits), dim3(kWarps * 32), 0, stream, plan.dependent,
                       plan.clustered ? plan.splits : 1, args, plan.splits, plan.clustered);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, template <typename, bool> class Math>
const char* dispatch_group(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  switch (args.group_shift) {  // a group every 2, 4 or 8 tiles (one group over K: every chunk)
    case 5: return launch<T, Math, 2>(args, plan, stream);
    case 6: return launch<T, Math, 4>(args, plan, stream);
    default: return launch<T, Math, 8>(args, plan, stream);
  }
}

template <typename T>
const char* dispatch_rows(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  return args.M == 1 ? dispatch_group<T, RowOnCudaCores>(args, plan, stream)
                     : dispatch_group<T, RowsOnTensorCores>(args, plan, stream);
}

}  // namespace

bool decode_serves(int M, int K) { return M <= kMaxRows && K % (kChunkTiles * 16) == 0; }

int64_t decode_partial_floats(const DeviceInfo& device, int M, int K, int N) {
  const DecodePlan plan = plan_decode(device, K, N);
  return plan.splits > 1 && !plan.clustered ? (int64_t)plan.splits * M * N : 0;
}

const char* decode_gemm(const GemmArgs& args, bool is_bf16, const DeviceInfo& device, cudaStream_t stream) {
  const DecodePlan plan = plan_decode(device, args.K, args.N);
  return is_bf16 ? dispatch_rows<__nv_bfloat16>(args, plan, stream) : dispatch_rows<half>(args, plan, stream);
}

}  // namespace litquant_marlin
