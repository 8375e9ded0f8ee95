// Marlin-class GEMM: fp16/bf16 activations x 4-bit weights, fp32 accumulation on the tensor cores.
//
// Facts taken from the MARLIN paper (Frantar, Castro, Chen, Hoefler, Alistarh, 2024) and the public
// descriptions of IST-DASLab/marlin and vLLM's gptq_marlin; the code is our own.
//
// Weight layout ("marlin layout", built by litquant/kernels/marlin.py:repack_weight)
//   The weight W[K, N] is cut into warp tiles of 16 (k) x 64 (n). Inside a tile, the 64 columns are
//   8 subtiles of n8, each the B operand of one mma.m16n8k16. Lane l of the warp owns, per subtile s,
//   the 4 values of its B fragment: column 8s + l/4, rows 2(l%4) + {0, 1} (register b0b1) and
//   2(l%4) + {8, 9} (register b2b3). Its 32 values (8 subtiles x 4) are one uint4: word j holds
//   subtiles 2j and 2j+1 as the logical values e0..e7 = (b0 b1 b2 b3 of 2j, b0 b1 b2 b3 of 2j+1),
//   stored interleaved: nibble p holds e[{0, 2, 4, 6, 1, 3, 5, 7}[p]]. Then masking nibbles {0, 4}
//   yields the pair (e0, e1) in the two 16-bit halves, nibbles {1, 5} yields (e2, e3), and so on.
//   Tiles are stored k-tile major: qweight[k16][n64][lane] (uint4), i.e. int32 [K/16, 2N].
//
// Dequantization (the exponent trick): OR-ing a nibble q into the mantissa of 1024.0 (fp16 0x6400)
//   gives the fp16 number 1024 + q; a nibble at bits 4..7 gives 1024 + 16q. So one lop3 turns two
//   nibbles into a half2, and (x - (1024 + z)) or fma(x, 1/16, -(64 + z)) gives q - z exactly; one
//   hmul2 applies the group scale. bf16 has only 7 mantissa bits: 128.0 (0x4300) | q = 128 + q for the
//   low nibble only, so bf16 shifts the word by 4 for each pair instead. Both produce exactly the
//   dequantized values of the reference kernel ((q - z) rounded once by the scale multiply).
//
// Scales: [G, N] in the activation dtype, permuted inside each 64-column tile so that lane l finds its
//   8 scales (subtiles 0..7 of column l/4) in 16 contiguous bytes: position 8(c%8) + c/8 holds column c.
// Zero points: 4-bit, 8 bytes per (group, 64-column tile, l/4): word w holds the zeros of subtiles
//   4w..4w+3 at nibbles {s, s+4}, so one lop3 yields the half2 (1024 + z, 1024 + z) of a subtile.
//
// Work split: a block computes (MB*16 rows) x TN columns ("column") over TK-row k tiles ("units").
//   Units are ordered column-major (k fastest) and each block takes one contiguous stripe, so every
//   SM gets the same amount of weight to stream even when N/TN is small (decode). Its warps split the
//   block tile into 64-column warp tiles times kKGroups k slices; the k slices are summed through
//   shared memory at the end of each column. A column cut between blocks is summed through an fp32
//   scratch: each block but the column's first stores its part in a slot of its own, and the first
//   block, which reaches the column last, adds them up once the column's lock has counted them in.
// Pipeline: kStages-deep cp.async ring of (B, A, scales, zeros) per unit, continuous across columns.
//   A is read with ldmatrix from an XOR-swizzled tile (no bank conflicts).
//
// This file holds the mma.sync kernel (any GPU from sm_80), the dequantize kernel and the host entry
// points; up to 16 activation rows (32 on layers far from square) go to the decode kernel (decode.cu) when K
// is a multiple of 128, and on Hopper, calls past the decode sizes go to the wgmma kernel (wgmma.cu). Helpers
// shared by the kernels are in common.cuh.
#include "marlin.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.cuh"

namespace {
using namespace litquant_marlin;

// Row blocks of 16 per block tile (MB): all rows in one pass up to 48, passes of 32 beyond. Measured on an
// H200 running the Ampere build (benchmarks/results/2026-12-02-mma-rows-and-slots.md): one pass of 48 rows
// beats two of 32, but two passes of 48 are 6-8% slower than three of 32; 64-row tiles (MB = 4) need more
// than the 255 registers a thread can have, spill, and ran 18-33% slower than two passes of 32 at M = 64.
int row_blocks(int M) { return M <= 48 ? (M + 15) / 16 : 2; }

// ---------------------------------------------------------------------------------------------
// Tile shapes
// ---------------------------------------------------------------------------------------------
constexpr int kSmemBudget = 160 * 1024;  // fits an A100 (163 KB per block) as well as a Hopper

template <int MB, int TK, int TN>
struct Tile {
  static constexpr int kTN64 = TN / 64;  // warp tiles across the block's columns
  static constexpr int kKGroups = 8 / kTN64;  // warps along k: always 8 warps (16 measured slower)
  static constexpr int kWarps = kTN64 * kKGroups;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kK16PerWarp = TK / 16 / kKGroups;  // k16 steps of one warp per unit
  static constexpr int kMaxGroupRows = TK / 32;  // group sizes are >= 32
  // shared memory of one pipeline stage, in uint4
  static constexpr int kB = TK * TN / 32;
  static constexpr int kA = MB * 16 * TK / 8;
  static constexpr int kScales = kMaxGroupRows * TN / 8;
  static constexpr int kZeros = kMaxGroupRows * TN / 16;
  static constexpr int kStage = kB + kA + kScales + kZeros;
  // shared memory for summing the k-group warps, in float4
  static constexpr int kReduce = kKGroups > 1 ? kTN64 * MB * 8 * 32 : 0;
  // as many stages as fit the budget, 3 to 6
  static constexpr int kFit = (kSmemBudget / 16 - kReduce) / kStage;
  static constexpr int kStages = kFit > 6 ? 6 : (kFit < 3 ? 3 : kFit);
  static constexpr int kSmemBytes = 16 * (kStages * kStage + kReduce);
  static_assert(kK16PerWarp >= 1 && kK16PerWarp * kKGroups * 16 == TK, "k tile must split over the warps");
  static_assert(kB % kThreads == 0, "weight tile must split evenly over the threads");
  static_assert(kSmemBytes <= kSmemBudget, "tile does not fit in shared memory");
};

// A block's position in its stripe of units, ordered (n tile, row chunk, k tile) with k fastest.
// Advanced by counting, so the main loop does no integer division.
struct UnitCursor {
  int kt, chunk, nt;

  __host__ __device__ void start(int u, int k_tiles, int chunks) {
    const int col = u / k_tiles;
    kt = u - col * k_tiles;
    nt = col / chunks;
    chunk = col - nt * chunks;
  }
  __host__ __device__ void advance(int k_tiles, int chunks) {
    if (++kt == k_tiles) {
      kt = 0;
      if (++chunk == chunks) chunk = 0, ++nt;
    }
  }
  // Columns are ordered (n tile, row chunk): blocks next to each other share weight tiles in L2.
  __host__ __device__ int column(int chunks) const { return nt * chunks + chunk; }
};

template <typename T, int MB, int TK, int TN, bool kHasZeros>
__global__ void __launch_bounds__(Tile<MB, TK, TN>::kThreads, 1) marlin_gemm_kernel(const GemmArgs args) {
  using C = Tile<MB, TK, TN>;
  using T2 = typename Dtype<T>::T2;
  extern __shared__ uint4 smem[];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wn = warp % C::kTN64;  // this warp's 64-column tile
  const int wk = warp / C::kTN64;  // this warp's k slice of each unit
  const int M = args.M, K = args.K, N = args.N, shift = args.group_shift;
  const int k_tiles = K / TK, n_tiles = N / TN;
  const int chunks = (M + MB * 16 - 1) / (MB * 16);
  const int units = n_tiles * chunks * k_tiles;
  const int per_block = args.units_per_block;
  const int u_begin = blockIdx.x * per_block;
  const int u_end = min(units, u_begin + per_block);
  if (u_begin >= u_end) return;
  const int group_rows = shift < 0 ? 1 : max(1, TK >> shift);
  const size_t b_ktile_stride = (size_t)(TK / 16) * (N / 64) * 32;  // uint4 per k tile of the weight
  constexpr bool has_zeros = kHasZeros;  // a template parameter: symmetric weights fold the zero point

  // Each thread's share of a stage's copies is fixed: precompute its offsets once, so a fetch is a
  // few pointer adds and cp.async. Loops run a compile-time number of times, guarded where the
  // last round is partial.
  constexpr int kBCopies = C::kB / C::kThreads;
  constexpr int kACopies = (C::kA + C::kThreads - 1) / C::kThreads;
  uint32_t b_src[kBCopies];  // offset in qweight from the unit's first uint4
  int a_row[kACopies], a_src[kACopies], a_dst[kACopies];
#pragma unroll
  for (int it = 0; it < kBCopies; ++it) {
    const int i = it * C::kThreads + tid;
    b_src[it] = i / (C::kTN64 * 32) * (N / 64) * 32 + i % (C::kTN64 * 32);
  }
#pragma unroll
  for (int it = 0; it < kACopies; ++it) {
    const int i = it * C::kThreads + tid, r = i / (TK / 8), c = i % (TK / 8);
    a_row[it] = (C::kA % C::kThreads == 0 || i < C::kA) ? r : -1;  // -1: no copy in this round
    a_src[it] = r * (K / 8) + c;
    a_dst[it] = C::kB + r * (TK / 8) + (c ^ (r % 8));
  }
  const int s_copies = group_rows * (TN / 8), z_copies = group_rows * (TN / 16);
  const int s_src = tid / (TN / 8) * (N / 8) + tid % (TN / 8);
  const int z_src = tid / (TN / 16) * (N / 16) + tid % (TN / 16);
  static_assert(C::kScales <= C::kThreads, "one scale copy per thread");

  auto fetch = [&](const UnitCursor& cur, int stage) {
    uint4* st = smem + stage * C::kStage;
    const uint4* gb = args.qweight + (cur.kt * b_ktile_stride + cur.nt * (C::kTN64 * 32));
#pragma unroll
    for (int it = 0; it < kBCopies; ++it) cp_async16(st + it * C::kThreads + tid, offset_by(gb, b_src[it]));
    const int row0 = cur.chunk * MB * 16;
    const uint4* ga = args.x + ((size_t)row0 * (K / 8) + cur.kt * (TK / 8));
#pragma unroll
    for (int it = 0; it < kACopies; ++it) {
      if (C::kA % C::kThreads == 0 || a_row[it] >= 0) {
        const bool valid = row0 + a_row[it] < M;  // rows past M are zero-filled
        cp_async16_or_zero(st + a_dst[it], valid ? ga + a_src[it] : ga, valid);
      }
    }
    const int g0 = shift < 0 ? 0 : (cur.kt * TK) >> shift;
    if (tid < s_copies)
      cp_async16(st + C::kB + C::kA + tid, args.scales + ((size_t)g0 * (N / 8) + cur.nt * (TN / 8) + s_src));
    if (has_zeros && tid < z_copies)
      cp_async16(st + C::kB + C::kA + C::kScales + tid,
                 reinterpret_cast<const uint4*>(args.zeros) + ((size_t)g0 * (N / 16) + cur.nt * (TN / 16) + z_src));
  };

  float acc[MB][8][4];
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][s][i] = 0.f;

  // One unit: the warp's kK16PerWarp k16 steps. All shared-memory loads of the unit (weight words
  // and A fragments) are issued first so that their latencies overlap; the steps then only branch
  // where a new quantization group may start. Groups span at least two k16 steps, and a warp's
  // slice starts on a group boundary or inside one group.
  auto group_starts_at = [&](int t) {
    return t == 0 || (t % 2 == 0 && shift >= 0 && ((t * 16) & ((1 << shift) - 1)) == 0);
  };
  auto group_row_at = [&](int t) { return shift < 0 ? 0 : ((wk * C::kK16PerWarp + t) * 16) >> shift; };
  auto compute = [&](int stage) {
    const uint4* st = smem + stage * C::kStage;
    const uint4* st_scales = st + C::kB + C::kA + wn * 8;
    const uint2* st_zeros =
        has_zeros ? reinterpret_cast<const uint2*>(st + C::kB + C::kA + C::kScales) + wn * 8 : nullptr;
    uint4 q[C::kK16PerWarp];
    uint32_t a[C::kK16PerWarp][MB][4];
#pragma unroll
    for (int t = 0; t < C::kK16PerWarp; ++t) {
      const int kk = wk * C::kK16PerWarp + t;
      q[t] = st[kk * C::kTN64 * 32 + wn * 32 + lane];
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        const int row = m * 16 + lane % 8 + ((lane / 8) % 2) * 8;
        const int chunk = kk * 2 + lane / 16;
        ldmatrix_x4(a[t][m], st + C::kB + row * (TK / 8) + (chunk ^ (row % 8)));
      }
    }
    GroupConstants<T> consts;
#pragma unroll
    for (int t = 0; t < C::kK16PerWarp; ++t) {
      if (group_starts_at(t)) {
        const int g = group_row_at(t) * (TN / 8) + lane / 4;
        consts.load(st_scales[g], st_zeros ? st_zeros[g] : make_uint2(kSymmetricZeros, kSymmetricZeros));
      }
      const uint32_t words[4] = {q[t].x, q[t].y, q[t].z, q[t].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[4];
        consts.dequant(words[j], j, b);
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          Dtype<T>::mma(acc[m][2 * j], a[t][m], b[0], b[1]);
          Dtype<T>::mma(acc[m][2 * j + 1], a[t][m], b[2], b[3]);
        }
      }
    }
  };

  // End of a column's stripe in this block: sum the k-slice warps, then the blocks, then write.
  auto finish_column = [&](const UnitCursor& cur) {
    const int col = cur.column(chunks);
    if constexpr (C::kKGroups > 1) {
      float4* red = reinterpret_cast<float4*>(smem + C::kStages * C::kStage);
#pragma unroll 1
      for (int g = C::kKGroups - 1; g > 0; --g) {
        if (wk == g) {
#pragma unroll
          for (int m = 0; m < MB; ++m)
#pragma unroll
            for (int s = 0; s < 8; ++s) {
              float4& r = red[((wn * MB + m) * 8 + s) * 32 + lane];
              const float* v = acc[m][s];
              if (g == C::kKGroups - 1) r = make_float4(v[0], v[1], v[2], v[3]);
              else r = make_float4(r.x + v[0], r.y + v[1], r.z + v[2], r.w + v[3]);
            }
        }
        __syncthreads();
      }
      if (wk == 0) {
#pragma unroll
        for (int m = 0; m < MB; ++m)
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const float4 r = red[((wn * MB + m) * 8 + s) * 32 + lane];
            acc[m][s][0] += r.x, acc[m][s][1] += r.y, acc[m][s][2] += r.z, acc[m][s][3] += r.w;
          }
      }
    }

    // A column cut between blocks: every block but the column's first holds one part of it, and the column
    // is the one its stripe starts in, so each block has at most one part to hand over: it stores it in its
    // own slot of the scratch and counts itself in on the column's lock. The first block reaches the column
    // at the end of its stripe, last of all; it waits for the count, adds the slots in block order (the
    // same sum on every run) and writes the output. Nobody waits on a chain of other blocks' hand-overs.
    const int first_block = (col * k_tiles) / per_block;
    const int last_block = ((col + 1) * k_tiles - 1) / per_block;
    const bool writes_output = blockIdx.x == first_block;
    constexpr int kSlot = C::kTN64 * MB * 8 * 32;  // float4 of one block's part
    if (first_block != last_block) {
      if (!writes_output) {
        if (wk == 0) {
          float4* slot = args.partial + (size_t)blockIdx.x * kSlot + wn * MB * 8 * 32;
#pragma unroll
          for (int m = 0; m < MB; ++m)
#pragma unroll
            for (int s = 0; s < 8; ++s)
              __stcg(slot + (m * 8 + s) * 32 + lane, make_float4(acc[m][s][0], acc[m][s][1], acc[m][s][2], acc[m][s][3]));
        }
        // The barrier orders every writer's stores before thread 0's add, whose release is cumulative (as in
        // wgmma.cu's hand-over). A fence by each writer warp first took up to 2% more time on the small layers
        // (the Ampere build on an H100, M = 48..128:
        // benchmarks/results/2026-12-07-marlin-ampere-handover-release-ab.log).
        __syncthreads();
        if (tid == 0) add_acq_rel(args.locks + col, 1);
      } else {
        if (tid == 0)
          while (load_acquire(args.locks + col) != last_block - first_block) {
          }
        __syncthreads();
        if (wk == 0) {
#pragma unroll 1
          for (int b = first_block + 1; b <= last_block; ++b) {
            const float4* slot = args.partial + (size_t)b * kSlot + wn * MB * 8 * 32;
#pragma unroll
            for (int m = 0; m < MB; ++m)
#pragma unroll
              for (int s = 0; s < 8; ++s) {
                const float4 r = __ldcg(slot + (m * 8 + s) * 32 + lane);
                acc[m][s][0] += r.x, acc[m][s][1] += r.y, acc[m][s][2] += r.z, acc[m][s][3] += r.w;
              }
          }
        }
        if (tid == 0) args.locks[col] = 0;  // every part is in: no block touches this lock again in this call
      }
    }

    if (writes_output && wk == 0) {
      const T2* bias = static_cast<const T2*>(args.bias);
      T2* out = static_cast<T2*>(args.out);
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int n = cur.nt * TN + wn * 64 + s * 8 + (lane % 4) * 2;
        const float2 b = bias ? Dtype<T>::unpack(bias[n / 2]) : make_float2(0.f, 0.f);
#pragma unroll
        for (int m = 0; m < MB; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = cur.chunk * MB * 16 + m * 16 + lane / 4 + 8 * h;
            if (row < M) out[((size_t)row * N + n) / 2] = Dtype<T>::pack(acc[m][s][2 * h] + b.x, acc[m][s][2 * h + 1] + b.y);
          }
      }
    }
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][s][i] = 0.f;
  };

  UnitCursor fetch_at, compute_at;
  fetch_at.start(u_begin, k_tiles, chunks);
  compute_at = fetch_at;
#pragma unroll 1
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (u_begin + s < u_end) {
      fetch(fetch_at, s);
      fetch_at.advance(k_tiles, chunks);
    }
    cp_async_commit();
  }
  int compute_stage = 0, fetch_stage = C::kStages - 1;
#pragma unroll 1
  for (int u = u_begin; u < u_end; ++u) {
    cp_async_wait<C::kStages - 2>();
    __syncthreads();  // this unit's stage has landed for everyone, and nobody still reads the previous one
    if (u + C::kStages - 1 < u_end) {
      fetch(fetch_at, fetch_stage);
      fetch_at.advance(k_tiles, chunks);
    }
    cp_async_commit();
    compute(compute_stage);
    if (compute_at.kt == k_tiles - 1 || u == u_end - 1) finish_column(compute_at);
    compute_at.advance(k_tiles, chunks);
    compute_stage = compute_stage == C::kStages - 1 ? 0 : compute_stage + 1;
    fetch_stage = fetch_stage == C::kStages - 1 ? 0 : fetch_stage + 1;
  }
  cp_async_wait<0>();
}

template <typename T, int MB, int TK, int TN, bool kHasZeros>
const char* launch_kernel(GemmArgs args, int sms, cudaStream_t stream) {
  using C = Tile<MB, TK, TN>;
  auto kernel = marlin_gemm_kernel<T, MB, TK, TN, kHasZeros>;
  // Blocks wait for each other (the column locks), so all of them must be resident at once: one
  // block per SM, which the launch below asks for; a tile too large for this GPU fails here.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const int chunks = (args.M + MB * 16 - 1) / (MB * 16);
  const int units = (args.N / TN) * chunks * (args.K / TK);
  args.units_per_block = (units + sms - 1) / sms;
  const int grid = (units + args.units_per_block - 1) / args.units_per_block;
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(args);
  err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, int MB, int TK, int TN>
const char* launch_gemm(const GemmArgs& args, int sms, cudaStream_t stream) {
  return args.zeros ? launch_kernel<T, MB, TK, TN, true>(args, sms, stream)
                    : launch_kernel<T, MB, TK, TN, false>(args, sms, stream);
}

// Tile shape per row-block count, measured on an H200 (benchmarks/results/2026-11-30-marlin-decode.md).
// Up to 32 rows: 128 x 256 tiles (decode.cu takes M <= 16 when K is a multiple of 128); 64 x 256
// beyond (each A tile feeds more columns). Narrower tiles where N is not a multiple of 256; K or N
// is a multiple of 128.
template <typename T, int MB>
const char* dispatch_tile(const GemmArgs& args, int sms, cudaStream_t stream) {
  const int K = args.K, N = args.N;
  const bool k128 = K % 128 == 0, n256 = N % 256 == 0, n128 = N % 128 == 0;
  if constexpr (MB <= 2) {
    if (!k128) return launch_gemm<T, MB, 64, 128>(args, sms, stream);
    if (n256) return launch_gemm<T, MB, 128, 256>(args, sms, stream);
    return n128 ? launch_gemm<T, MB, 128, 128>(args, sms, stream) : launch_gemm<T, MB, 128, 64>(args, sms, stream);
  } else {
    if (n256) return launch_gemm<T, MB, 64, 256>(args, sms, stream);
    return n128 ? launch_gemm<T, MB, 64, 128>(args, sms, stream) : launch_gemm<T, MB, 128, 64>(args, sms, stream);
  }
}

template <typename T>
const char* dispatch_rows(const GemmArgs& args, int sms, cudaStream_t stream) {
  switch (row_blocks(args.M)) {
    case 1: return dispatch_tile<T, 1>(args, sms, stream);
    case 2: return dispatch_tile<T, 2>(args, sms, stream);
    default: return dispatch_tile<T, 3>(args, sms, stream);
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantize to a dense [K, N] matrix (the large-M path feeds it to cuBLAS)
// ---------------------------------------------------------------------------------------------
constexpr int kDequantWarps = 8;

template <typename T, int kPlanes>
__global__ void __launch_bounds__(32 * kDequantWarps) marlin_dequant_kernel(
    const uint4* qweight, const uint4* scales, const uint2* zeros, T* w, int K, int N, int gs) {
  // One warp per 16 x 64 tile of w; its values pass through shared memory so rows go out in 128-byte
  // stores. Rows are padded by 8 values so the 2-byte scatter of the fragments spreads over banks.
  // With two planes (an 8-bit weight as 4-bit high and low nibbles, litquant/kernels/marlin.py:
  // nibble_planes), w has K / 2 rows and row r is the sum of weight rows r and r + K / 2, each rounded
  // to T as the fused kernels see it, added in fp32.
  __shared__ __align__(16) T tile[kDequantWarps][16][72];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_tiles = N / 64, plane_ktiles = K / 16 / kPlanes;
  const int t = blockIdx.x * kDequantWarps + warp;
  if (t >= plane_ktiles * n_tiles) return;
  const int kt = t / n_tiles, nt = t % n_tiles;
  float sums[4][4][2] = {};
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
    const int ktile = kt + plane * plane_ktiles;
    const int g = gs < 0 ? 0 : ktile * 16 / gs;
    GroupConstants<T> consts;
    consts.load(scales[(size_t)g * (N / 8) + nt * 8 + lane / 4],
                zeros ? zeros[(size_t)g * (N / 8) + nt * 8 + lane / 4] : make_uint2(kSymmetricZeros, kSymmetricZeros));
    const uint4 q = qweight[((size_t)ktile * n_tiles + nt) * 32 + lane];
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b[4];
      consts.dequant(words[j], j, b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 pair = Dtype<T>::unpack(bit_cast<typename Dtype<T>::T2>(b[i]));
        sums[j][i][0] += pair.x, sums[j][i][1] += pair.y;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 2 * (lane % 4) + 8 * (i % 2);
      const int col = (2 * j + i / 2) * 8 + lane / 4;
      const auto pair = Dtype<T>::pack(sums[j][i][0], sums[j][i][1]);
      tile[warp][row][col] = pair.x;
      tile[warp][row + 1][col] = pair.y;
    }
  }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int row = it * 4 + lane / 8, chunk = lane % 8;
    *reinterpret_cast<uint4*>(w + (size_t)(kt * 16 + row) * N + nt * 64 + chunk * 8) =
        *reinterpret_cast<const uint4*>(&tile[warp][row][chunk * 8]);
  }
}

const char* check_shape(int K, int N, int group_size) {
  if (K <= 0 || N <= 0 || K % 64 != 0 || N % 64 != 0) return "marlin needs K and N to be positive multiples of 64";
  if (K % 128 != 0 && N % 128 != 0) return "marlin needs K or N to be a multiple of 128 (pad K with zero rows)";
  if (group_size != -1 && group_size != 32 && group_size != 64 && group_size != 128)
    return "marlin supports group_size -1, 32, 64 or 128";
  return nullptr;
}

}  // namespace

namespace litquant_marlin {

DeviceInfo current_device() {
  // Immutable facts, cached per device id: reading them costs microseconds, on every call otherwise.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];    // sms | major << 16 | minor << 24; 0 = not read yet
  static std::atomic<int> cached_l2[kMaxDevices];  // L2 bytes (stored before `cached`)
  DeviceInfo info;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return info;
  int packed = device < kMaxDevices ? cached[device].load(std::memory_order_acquire) : 0, l2 = 0;
  if (packed == 0) {
    if (cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess)
      return DeviceInfo{};
    packed = info.sms | (info.major << 16) | (info.minor << 24);
    if (device < kMaxDevices) {
      cached_l2[device].store(l2, std::memory_order_relaxed);
      cached[device].store(packed, std::memory_order_release);
    }
  } else {
    l2 = cached_l2[device].load(std::memory_order_relaxed);
  }
  info.sms = packed & 0xffff, info.major = (packed >> 16) & 0xff, info.minor = packed >> 24, info.l2_bytes = l2;
#if defined(LITQUANT_TARGET_ARCH)
  // Built for an older GPU than this one (LITQUANT_CUDA_ARCH, litquant/kernels/build.py: that GPU's PTX, compiled by
  // the driver for this one), the library holds only that GPU's kernels, and takes its paths: before sm_90 no
  // wgmma, no clusters, no dependent launches.
  if (info.major * 10 + info.minor > LITQUANT_TARGET_ARCH)
    info.major = LITQUANT_TARGET_ARCH / 10, info.minor = LITQUANT_TARGET_ARCH % 10;
#endif
  static const bool pdl_allowed = [] {
    const char* setting = std::getenv("LITQUANT_PDL");
    return setting == nullptr || std::strcmp(setting, "0") != 0;
  }();
  info.dependent_launch = info.major >= 9 && pdl_allowed;
  return info;
}

}  // namespace litquant_marlin

extern "C" {

int64_t litquant_marlin_partial_floats(int M, int K, int N) {
  const DeviceInfo device = current_device();
  if (decode_serves(M, K, N)) return decode_partial_floats(device, M, K, N);
  if (wgmma_serves(device, M, N)) return wgmma_partial_floats(device, M, K, N);
  return (int64_t)device.sms * row_blocks(M) * 16 * 256;  // one slot per block (marlin_gemm_kernel's finish_column)
}

int64_t litquant_marlin_lock_count(int M, int K, int N) {
  const DeviceInfo device = current_device();
  if (decode_serves(M, K, N)) return N / 64;
  if (wgmma_serves(device, M, N)) return wgmma_lock_count(device, M, K, N);
  const int rows = row_blocks(M) * 16;
  return (int64_t)((M + rows - 1) / rows) * (N / 64);
}

const char* litquant_marlin_gemm(const void* x, const int32_t* qweight, const void* scales, const int32_t* zeros,
                                 const void* bias, void* out, float* partial, int32_t* locks, int M, int K, int N,
                                 int group_size, int is_bf16, int after_small_kernel, cudaStream_t stream) {
  if (const char* bad = check_shape(K, N, group_size)) return bad;
  if (M <= 0) return nullptr;
  const DeviceInfo device = current_device();
  if (device.sms < 1) return "marlin: could not read the GPU's properties";
  GemmArgs args;
  args.x = static_cast<const uint4*>(x);
  args.qweight = reinterpret_cast<const uint4*>(qweight);
  args.scales = static_cast<const uint4*>(scales);
  args.zeros = reinterpret_cast<const uint2*>(zeros);
  args.bias = bias;
  args.out = out;
  args.partial = reinterpret_cast<float4*>(partial);
  args.locks = locks;
  args.M = M, args.K = K, args.N = N;
  args.group_shift = group_size == -1 ? -1 : group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  args.units_per_block = 0;
  if (decode_serves(M, K, N)) return decode_gemm(args, is_bf16, device, after_small_kernel != 0, stream);
  if (wgmma_serves(device, M, N)) return wgmma_gemm(args, is_bf16, device, stream);
  return is_bf16 ? dispatch_rows<__nv_bfloat16>(args, device.sms, stream)
                 : dispatch_rows<half>(args, device.sms, stream);
}

const char* litquant_marlin_dequant(const int32_t* qweight, const void* scales, const int32_t* zeros, void* w, int K,
                                    int N, int group_size, int planes, int is_bf16, cudaStream_t stream) {
  if (const char* bad = check_shape(K, N, group_size)) return bad;
  if (planes != 1 && (planes != 2 || K % 32 != 0))
    return "marlin dequant: planes must be 1, or 2 with K / 2 a multiple of 16";
  const int tiles = (K / 16 / planes) * (N / 64);
  const int grid = (tiles + kDequantWarps - 1) / kDequantWarps;
  const uint4* q = reinterpret_cast<const uint4*>(qweight);
  const uint4* s = static_cast<const uint4*>(scales);
  const uint2* z = reinterpret_cast<const uint2*>(zeros);
  auto launch = [&](auto* out, auto kernel_one, auto kernel_two) {
    (planes == 2 ? kernel_two : kernel_one)<<<grid, 32 * kDequantWarps, 0, stream>>>(q, s, z, out, K, N, group_size);
  };
  if (is_bf16)
    launch(static_cast<__nv_bfloat16*>(w), marlin_dequant_kernel<__nv_bfloat16, 1>,
           marlin_dequant_kernel<__nv_bfloat16, 2>);
  else
    launch(static_cast<half*>(w), marlin_dequant_kernel<half, 1>, marlin_dequant_kernel<half, 2>);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // extern "C"
