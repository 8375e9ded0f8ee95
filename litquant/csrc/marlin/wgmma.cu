// The marlin kernel's path for M > 16 on Hopper: the same 4-bit marlin layout as marlin.cu, the
// tensor-core work on wgmma (sm_90a), which mma.sync cannot match there once M passes decode sizes.
//
// Facts from the PTX ISA (wgmma.mma_async, its register fragments, shared-memory matrix descriptors and
// the 128-byte swizzle) and from public descriptions of Hopper mixed-input GEMMs (CUTLASS's sm90
// collectives; vLLM's Machete: the quantized operand is dequantized into registers and fed as wgmma's
// register operand); the code is our own.
//
// Orientation: wgmma takes its A operand from registers or shared memory, its B operand only from
//   shared memory. The weight is dequantized in registers, so the kernel computes the transposed product
//   out^T[N, M] = W^T[N, K] x^T[K, M]: A = W^T (64 output features x 16 k per instruction) and B = x^T,
//   whose "K-major" shared layout is simply rows of x. One m64nBMk16 instruction multiplies 64 output features by
//   the block's BM activation rows. Alone, that instruction runs at the full tensor rate from BM = 64
//   (benchmarks/wgmma_rate.cu: 32 cycles an SM for m64n64k16, A from registers or from shared memory alike); what
//   slows M = 64 down is the dequantization in the same warps, which overlaps the tensor work only in part (there:
//   73% of the peak with the kernel's arithmetic between the groups of 4 warpgroups, 97% at BM = 128). Feeding the
//   dequantized weights through shared memory instead (stmatrix, then A from shared memory) reached 57% there, and
//   the other orientation (tokens as A from shared memory, the weights dequantized into shared memory as B) was
//   33-50% slower in the kernel (2026-11-30-wgmma-warpgroups.md). Under sustained load the kernel holds the GPU at
//   its 700 W cap: at M = 64 a call takes 18-29% longer than from idle, its time then set by its energy, of which the
//   wgmmas take a third or more and the dequantization about a fifth (2026-12-05-power-cap.md, on H100s).
//   Narrower instructions hardly take less time: with 8-, 16- and 32-row tiles, 70B-up took 126-141 us at
//   M = 1..32 against 150-153 on 64-row tiles, so the instruction count (one per 64 features x 16 k, whatever BM)
//   sets the pace at small M, and decode.cu's mma.sync is 1.3-2x faster up to 16 rows
//   (2026-12-01-wgmma-small-tiles.md).
// Weight fragments: the A fragment of warp w of a warpgroup (rows 16w..16w+15 of the 64) is laid out
//   like mma.m16n8k16's A fragment. In the marlin layout, word j of a lane's uint4 (one 16 x 64 tile)
//   dequantizes to the B fragments of subtiles 2j and 2j + 1, which together are exactly that A fragment
//   for output features 16j..16j+15 of the tile: rows g (subtile 2j) and g + 8 (subtile 2j + 1), in the
//   register order {b0b1 of 2j, b0b1 of 2j+1, b2b3 of 2j, b2b3 of 2j+1}. So warp w reads word w of each
//   lane's uint4 of its warpgroup's tile, and the instruction covers the tile's 64 features in order. Those loads
//   are 4-way bank conflicted (a warp's 32 words lie in the banks = w mod 4); lanes reading word (lane / 8 + w) % 4
//   instead (features permuted to match) removed the conflicts and changed no time where K is not split: the
//   dequantization's latency hides them (benchmarks/results/2026-12-02-wgmma-rotated-words.md).
// Block tile: for BM = 32 or 64 rows, 256 output features (4 tiles of 64) on four warpgroups, warpgroup
//   h taking tile h (one m64nBMk16 instruction a k16 step: at these sizes the kernel waits on latency more
//   than on issue, and twice the warps of two-tile warpgroups made M = 64-128 3-9% faster on the layers
//   that split K, level elsewhere: 2026-11-30-wgmma-warpgroups.md); for BM = 128, 160, 192 or 256 (M > 64), 128
//   features on two warpgroups (warpgroup h takes tile h, one m64nBMk16 instruction): the same tensor work a stage
//   as two m64n128k16 a warpgroup, half the dequantization per product (M = 256-512: 2-15% faster,
//   2026-11-30-wgmma-stream-k.md), for twice the activation bytes a stage; and with four warpgroups the
//   accumulators of 160 to 256 rows would not fit, nor those of 128 beside a producer (below). Stages of 128 k,
//   in two halves of 64 k. The activations of a half, BM rows x 128 bytes, are stored with the 128-byte swizzle
//   the B descriptor declares (16-byte chunk c of row r at chunk c ^ (r % 8), 1024-byte aligned atoms of 8 rows),
//   so that the tensor cores read them without bank conflicts; the k16 steps inside the half are the descriptor's
//   start address moved by 32 bytes.
// Pipeline: a ring of stages filled by the copy engine (TMA), five tensor-map copies a stage (the two halves
//   of activations, with the swizzle and zeros past M; the weight words of the eight k16 steps; the scale
//   rows; the zero-point rows), all counted on the stage's "full" mbarrier. A producer warpgroup issues them
//   (one thread; the group gives its registers to the others), and the consumer warpgroups only dequantize and
//   multiply.
//   Each half dequantizes its weights into one of two register sets while the previous half's wgmmas still run,
//   issues its own (4 per warpgroup) and waits for the previous ones; a stage is released on its "empty" mbarrier
//   once the next stage's first half is issued. On Hopper the kernel is launched as a dependent of the kernel ahead
//   (common.cuh): the copying thread fetches the weight words of the block's first stages before it waits for that
//   kernel.
//   A first version filled the ring with cp.async from every thread; the copies'
//   address arithmetic, the proxy fence that cp.async data needs before wgmma reads it, and the block
//   barrier of every step cost 20-25% at large M (ncu: a third of the warps' time at the barrier).
// Work split (see `plan_wgmma`): a layer with fewer tiles than SMs is split along K where a split's run is
// not much longer than a stream-K share, the splits' fp32 partial sums added up by a second kernel (with the
// bias). Otherwise the blocks take whole tiles, one block per SM, in rounds; or whole tiles and then an equal
// share of the remaining tiles' k stages ("stream-K"), so that no wave runs part-empty; or, past one round, k
// splits of every tile in rounds of blocks; whichever a cost model measured on the Llama layers puts first. The
// output goes through shared memory, to be written in full 16-byte rows.
#include <cuda.h>  // CUtensorMap (the driver function is looked up at run time: no link to libcuda)
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "wgmma_ptx.cuh"

// Built for GPUs other than sm_90a, the kernel's body is compiled out (it only traps), and the
// front end would warn that the helpers it uses are unused.
#pragma nv_diag_suppress 177

namespace litquant_marlin {
namespace {

constexpr int kWgK = 128;        // k per stage: two halves of 64 k, each one 128-byte row of activations
constexpr int kHalfK = 64;       // k per half stage: one wgmma group of 4 k16 steps
constexpr int kMinRun = 512 / kWgK;  // stages: the least k a split or a stream-K share takes

// Group rows of scales (and zero points) a stage reads: groups of 32, 64 and 128 k or one group (shift -1).
__host__ __device__ constexpr int stage_group_rows(int group_shift) {
  return group_shift < 0 || group_shift >= 7 ? 1 : kWgK >> group_shift;
}
constexpr int kGroupM = 8;       // row tiles that sweep the column tiles together (L2 reuse at large M)

// Block tiles (see the top of the file): BM = 32 or 64 rows x 256 columns on four warpgroups, 128, 160, 192 or 256
// rows x 128 columns on two; each warpgroup one 64-column tile, one instruction a k16 step.
constexpr int block_columns(int bm) { return bm >= 128 ? 128 : 256; }
template <int BM>
struct WgTile {
  static constexpr int kThreads = 2 * block_columns(BM);  // the consumers: the warpgroups that dequantize and multiply
  // One more warpgroup, the producer, issues every copy (see the kernel), and the consumers only dequantize and
  // multiply. The registers follow the work (setmaxnreg): the producer gives back all but 24 a thread, and the
  // consumers take the rest: launched at 96 a thread (640 threads), 112 (the 64-row kernels used 90-105 before the
  // producer, none spill); launched at 168 (384 threads), 240 (the 256-row kernels use up to 237, none spill).
  // The counts must balance: the consumers' increase takes only what the producer gave back to the block's pool
  // (at 168, 128 x 144 registers freed for 256 x 72 taken; a producer of 32 leaves 1024 short, and with it the
  // marlin GPU tests hung: benchmarks/results/2026-12-06-wgmma-releaser-hang.log).
  static constexpr int kBlockThreads = kThreads + 128;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = kThreads == 512 ? 112 : 240;
  static constexpr int kWarpgroups = kThreads / 128;
  static constexpr int kTiles = kWarpgroups;  // 64-column tiles per block
  static constexpr int kWgN = 64 * kTiles;    // output features per block
  static constexpr int kXHalf = BM * 128;      // bytes of activations per half stage (a multiple of 1024)
  static constexpr int kX = 2 * kXHalf;         // bytes of activations per stage
  static constexpr int kW = kWgK * kWgN / 2;    // bytes of weights per stage: [k16][tile][lane] uint4
  static constexpr int kScaleRow = kWgN * 2;    // bytes of one group row of scales (2 a column)
  static constexpr int kZeroRow = kWgN;         // bytes of one group row of zero points (1 a column)
  static constexpr int kScales = 4 * kScaleRow;  // room for four group rows (groups of 32)
  static constexpr int kZeros = 4 * kZeroRow;
  static constexpr int kStage = (kX + kW + kScales + kZeros + 1023) / 1024 * 1024;  // swizzle atoms: 1024-aligned
  // As many stages as fit the 227 KB a block may take (3 at BM = 192 and 256, 4 at 160, 5 at 128, 6 at 64, 8 at 32).
  static constexpr int kStages = (227 * 1024 - 1024) / kStage;
  // The block's first kEarly stages fetch their weights before the prior kernel ends, half the ring (see the
  // producer).
  static constexpr int kEarly = kStages - kStages / 2;
  static constexpr int kOutRow = kWgN + 8;  // staged output row, padded so the fragment scatter hits all banks
  // The output tile is staged in the slot of the run's last stage, which the consumers release only once it is
  // written out: the producer fills the other slots meanwhile.
  static_assert(BM * kOutRow * 2 <= kStage, "the staged output must fit in one stage");
  static constexpr int kSmemBytes = kStages * kStage + 1024;  // + alignment
  static constexpr int kAcc = BM / 2;  // fp32 accumulators per thread
};

// ---------------------------------------------------------------------------------------------
// mbarriers and bulk copies (the Hopper copy engine: async proxy, completion counted in bytes)
// ---------------------------------------------------------------------------------------------
// (init_barrier and fence_barrier_init: common.cuh)
__device__ __forceinline__ void arrive_barrier(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// Arrives, and adds `bytes` to what the barrier's current phase waits for.
__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wait_barrier(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_address(bar)), "r"(parity)
                 : "memory");
  } while (!done);
}
// The box of the 2-D tensor map at (element `column`, `row`) to shared `dst`, counted on `bar`.
__device__ __forceinline__ void load_tile(void* dst, const CUtensorMap* map, int column, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_address(dst)),
      "l"(map), "r"(column), "r"(row), "r"(smem_address(bar))
      : "memory");
}
// Keeps the compiler from moving reads of an accumulator above the wgmma wait.
__device__ __forceinline__ void fence_register(float& r) { asm volatile("" : "+f"(r)::"memory"); }

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same<T, half>::value) return __float2half_rn(v);
  else return __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same<T, half>::value) return __half2float(v);
  else return __bfloat162float(v);
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------
// The tensor maps of a call (see `encode_maps`): one copy each fills a stage's part.
struct WgMaps {
  CUtensorMap x;        // bf16/fp16 [M, K]: boxes of BM rows x 64 columns, 128-byte swizzle
  CUtensorMap weights;  // 8-byte words [K / 16, N / 64 * 64]: boxes of 4 k16 rows x 4 tiles (2 KB a row)
  CUtensorMap scales;   // 8-byte words [groups, N / 4]: boxes of the stage's group rows x 256 columns
  CUtensorMap zeros;    // 8-byte words [groups, N / 8]: likewise (unused for symmetric weights)
};

// The work of a launch (see `plan_wgmma`).
// k splits (splits > 1): block b takes tile b % tiles, stages [split, split + 1) x units_per_block of it,
//   split = b / tiles, and writes fp32 partial sums [split][M][N] for the second kernel.
// Otherwise each block first takes `whole_rounds` tiles whole (block b: tiles b, b + grid, ...: the blocks
//   running at once take neighbouring tiles, as in one wave of a plain launch), then a run of
//   `units_per_block` k stages of the remaining tiles, cut across tile boundaries. A tile cut between blocks
//   is finished by the block holding its first stages, which reaches them last in its run: the blocks
//   holding the rest of the tile have written their fp32 sums by then (each its own slot of `partial`,
//   counted on the tile's lock), and it adds them to its accumulators (before that run, where they are written
//   well before it starts: see take_sums) and writes the output. A block waits only for higher blocks, and hands
//   its own sums over in its first shared run, before any wait of its own: so the waits end even when fewer SMs
//   than blocks are free.
struct WgWork {
  int k_stages;         // 128-k stages of a tile
  int splits;           // k splits (1: whole rounds and shared tiles instead)
  int units_per_block;  // stages of a split, or of a block's run of the shared tiles
  int whole_rounds;     // tiles each block takes whole
  int shared_units;     // k stages of the tiles after those
};

// kSplits: the launch is k splits (work.splits > 1), compiled apart from stream-K so that neither pays for the
// other's registers (the split kernel then knows its one run starts the ring). kGroupRows: stage_group_rows of the
// group size, compiled in so that the loop has no branches on it: on an H200 (bf16 and fp16 g128, interleaved A/B,
// benchmarks/results/2026-12-02-word-centers.md) M = 64 1-5% less time, M = 256 and 1024 0-1.7%; the loop of a
// stage at g128 has 324 instructions (bf16, 64 rows, zero points), where the code for any group size had 465 (not
// all of them run at g128).
template <typename T, int BM, int kGroupRows, bool kHasZeros, bool kSplits>
__global__ void __launch_bounds__(WgTile<BM>::kBlockThreads, 1)
    marlin_wgmma_kernel(const GemmArgs args, const __grid_constant__ WgMaps maps, const WgWork work) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WgTile<BM>;
  __shared__ uint64_t full[C::kStages], empty[C::kStages];
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wg = warp / 4, w = warp % 4;  // warpgroup, and warp in it
  constexpr int kWgN = C::kWgN;
  const int M = args.M, N = args.N, shift = args.group_shift;
  const int tiles64 = N / 64;

  // Tiles are ordered in groups of kGroupM row tiles that sweep the column tiles together (row tile
  // fastest): the blocks running at once share weight tiles in L2, and a group's activations stay in
  // L2 for its whole sweep. `m0` is the tile's first row, `t0` its first 64-column tile.
  const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + kWgN - 1) / kWgN;
  auto tile_origin = [&](int tile, int& m0, int& t0) {
    const int per_group = kGroupM * n_tiles, first_m = tile / per_group * kGroupM;
    const int group_m = min(m_tiles - first_m, kGroupM);
    m0 = (first_m + (tile % per_group) % group_m) * BM;
    t0 = (tile % per_group) / group_m * C::kTiles;
  };

  // The copies of a stage, issued by one thread and tracked by the stage's "full" barrier: one
  // tensor-map box each for the two halves of activations, the weight words, the scales and the zero points. The
  // copy engine zero-fills what lies past the tensors (rows past M, tiles past N) and counts the
  // whole box. (The weights, scales and zeros were once 5 to 8 bulk copies a stage: issuing them took
  // ~170 dependent instructions, and ncu showed the issuing warp 44% busy with them and the others
  // waiting for it at their wgmmas and for the late stages at their barriers.)
  // Stages go through the ring in the order the block takes them, over all its tiles: its g-th stage
  // sits in slot g % kStages, and the slot is free again when all threads have released stage g - kStages.
  const uint32_t stage_bytes = C::kX + C::kW + kGroupRows * (C::kScaleRow + (kHasZeros ? C::kZeroRow : 0));
  // In two parts, so that a block's first stages can fetch their weight words before the prior kernel
  // has ended (see accumulate): the weight words, then the rest.
  auto fetch_weights = [&](uint32_t g, int t0, int k_stage) {
    const int slot = g % C::kStages;
    if (g >= C::kStages) wait_barrier(&empty[slot], (g / C::kStages - 1) & 1);
    expect_bytes(&full[slot], stage_bytes);
    load_tile(smem + slot * C::kStage + C::kX, &maps.weights, t0 * 64, k_stage * kWgK / 16, &full[slot]);
  };
  auto fetch_rest = [&](uint32_t g, int m0, int t0, int k_stage) {
    uint8_t* st = smem + g % C::kStages * C::kStage;
    uint64_t* bar = &full[g % C::kStages];
    const int k0 = k_stage * kWgK, g0 = shift < 0 ? 0 : k0 >> shift;
    load_tile(st, &maps.x, k0, m0, bar);
    load_tile(st + C::kXHalf, &maps.x, k0 + kHalfK, m0, bar);  // (past K when K is an odd multiple of 64: zeros)
    load_tile(st + C::kX + C::kW, &maps.scales, t0 * 16, g0, bar);
    if (kHasZeros) load_tile(st + C::kX + C::kW + C::kScales, &maps.zeros, t0 * 8, g0, bar);
  };

  // The A fragments of one half stage (4 k16 steps) for this thread: [k16 step][register]. Warp w reads word w of
  // each lane's uint4 of its warpgroup's tile (tile wg of the block). The group's scales and zero points (`consts`)
  // are read where a group row starts: the second half keeps the first's for groups of 128 or one group.
  using Fragments = uint32_t[4][4];
  auto dequantize = [&](const uint8_t* st, int half, Fragments& a, WordConstants<T>& consts) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(st + C::kX) + half * 4 * C::kTiles * 128;
    const uint32_t* scale_pairs = reinterpret_cast<const uint32_t*>(st + C::kX + C::kW);
    const uint32_t* zero_words = reinterpret_cast<const uint32_t*>(st + C::kX + C::kW + C::kScales);
    uint32_t q[4];  // per k16 step
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) q[kk] = words[((kk * C::kTiles + wg) * 32 + lane) * 4 + w];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk == 0 ? half == 0 || kGroupRows > 1 : kk == 2 && kGroupRows == 4) {  // (groups of 32: two a half)
        const int row = (half * kHalfK + kk * 16) * kGroupRows / kWgK;  // the stage's group row
        const int at = row * (kWgN / 8) + wg * 8 + lane / 4;  // uint4 of scales / uint2 of zeros of column lane / 4
        const uint32_t zeros = kHasZeros ? zero_words[at * 2 + w / 2] >> (8 * (w % 2)) : kSymmetricZeros;
        consts.load(scale_pairs[at * 4 + w], zeros);
      }
      uint32_t b[4];
      consts.dequant(q[kk], b);
      a[kk][0] = b[0], a[kk][1] = b[2], a[kk][2] = b[1], a[kk][3] = b[3];
    }
  };

  float acc[C::kAcc];  // written first by the wgmmas of a run's first stage, which do not accumulate

  // The 4 wgmmas of a half stage as one group. Their descriptors are the half's plus 32 bytes each (2 in the
  // descriptor's 16-byte units: the address field cannot carry over, as shared addresses stay below 2^18).
  auto issue = [&](uint32_t descriptor_low, const Fragments& a, bool first) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_rs<T, BM>(acc, a[kk], swizzled_descriptor(descriptor_low + 2 * kk), !first || kk > 0);
    wgmma_commit();
  };

  // The block's runs of k stages, in order, each as (tile, first stage, stages): with k splits its one split of one
  // tile; otherwise its whole tiles, then its share of the other tiles' stages, cut at tile ends. The producer and
  // the consumers walk them alike.
  const int first_shared = work.whole_rounds * gridDim.x;
  auto for_each_run = [&](auto&& run) {
    if constexpr (kSplits) {
      const int tiles = m_tiles * n_tiles, k_first = blockIdx.x / tiles * work.units_per_block;
      run(blockIdx.x % tiles, k_first, min(work.k_stages - k_first, work.units_per_block));
    } else {
      for (int round = 0; round < work.whole_rounds; ++round) {
        const int tile = blockIdx.x + round * gridDim.x;
        if (tile >= m_tiles * n_tiles) return;  // (whole tiles only: the last round may be partial)
        run(tile, 0, work.k_stages);
      }
      const int share_end = min(work.shared_units, (blockIdx.x + 1) * work.units_per_block);
      for (int unit = blockIdx.x * work.units_per_block; unit < share_end;) {
        const int tile = first_shared + unit / work.k_stages, k_first = unit % work.k_stages;
        const int stages = min(work.k_stages - k_first, share_end - unit);
        run(tile, k_first, stages);
        unit += stages;
      }
    }
  };

  allow_dependent_launch();
  if (tid == 0) {
    for (int i = 0; i < C::kStages; ++i) init_barrier(&full[i], 1), init_barrier(&empty[i], C::kThreads);
    fence_barrier_init();
  }
  __syncthreads();
  if (wg == C::kWarpgroups) {  // the producer: one thread issues every copy, as soon as its slot is free
    release_registers<C::kProducerRegisters>();
    if (tid == C::kThreads) {
      uint32_t g = 0;  // stages put through the ring
      for_each_run([&](int tile, int k_first, int stages) {
        int m0, t0;
        tile_origin(tile, m0, t0);
        // The block's first kEarly stages fetch their weights while the prior kernel ends; then the rest of the
        // ring follows. (Fetching the weights of the whole ring first, 6 stages at 64 rows, was 4-8% slower on the
        // layers whose blocks take 11-22 stages: their first stage arrived later.)
        const int early = g == 0 ? min(stages, C::kEarly) : 0;
        for (int s = 0; s < early; ++s) fetch_weights(g + s, t0, k_first + s);
        if (g == 0) wait_for_prior_kernel();
        for (int s = 0; s < stages; ++s) {
          if (s >= early) fetch_weights(g + s, t0, k_first + s);
          fetch_rest(g + s, m0, t0, k_first + s);
        }
        g += stages;
      });
    }
    return;
  }
  claim_registers<C::kConsumerRegisters>();
  wait_for_prior_kernel();

  // acc = the products of a run: the next `stages` stages through the ring, which the producer fills. A stage runs
  // in two halves of 64 k, one wgmma group each: a half's weights are dequantized into one register set while the
  // other half's wgmmas run. The barrier wait and the stage's release come once a stage, that is once per 128 k: with
  // 64-k stages they took about a sixth of the main loop's instructions (ncu, benchmarks/results/
  // 2026-12-02-marlin-wgmma-plan.md). A warp's main loop went from ~146 instructions per 64 k to ~123, and the
  // kernel's time on an H200 by up to 17% at M = 64..1024, 6-10% at M = 1024 (both builds timed in turn,
  // benchmarks/results/2026-12-02-marlin-stage128.md). Issuing each k16 step's wgmma as soon as its fragment is
  // dequantized (a group a step, as triton's kernel does) was 0-8% slower than a group a half.
  // Stage s releases stage s - 1 once the first half's wgmmas are issued and the previous ones done; the run's last
  // stage is left to the caller (`release`), who stages the output in its slot.
  // The refills are the producer's. Before it, lane 0 of warp s % (the block's warps) issued a refill at stage s,
  // after the second half's wgmmas; a warpgroup's wgmma starts only when all four of its warps have issued it, so each
  // refill delayed its warpgroup's next step. Measured with the producer against that (interleaved A/Bs):
  // - 64 rows, on an H200 (bf16 and fp16, benchmarks/results/2026-12-03-wgmma-producer-warpgroup.md): M = 48 and 64
  //   15-18% less time on 70B-up and 7B-up (stream-K), 4-7% on 70B-qkv (also at M = 32) and 70B-down, 3-5% on
  //   7B-qkv (k splits); 7B-down, whose splits run 11 stages, 2% less at M = 64 and 3% more at 48;
  // - 160 and 256 rows, on an H100 (benchmarks/results/2026-12-06-wgmma-producer-all-rows.md): M = 160 5-18% less,
  //   M = 256..2048 up to 6% less (the down layers within 2%);
  // - 128 rows, which moved from four warpgroups of 256 columns to two of 128 beside the producer (same run): M = 96
  //   and 128 up to 23% less on the 7B layers, 70B-up 2% less, 70B-qkv 5.5% more at 96 and 7.5% less at 128, 70B-down
  //   level; M = 384 and 640 (three and five row tiles) from 12% less to 3% more.
  // A producer warp (a 17th warp, without setmaxnreg: 96 registers, spills) had gained 0-4% on stream-K and lost
  // 4-15% on the k splits (2026-12-02-wgmma-producer-warp.md).
  uint32_t ring = 0;  // stages this block has put through the ring
  auto accumulate = [&](int stages, bool onto_sums) {  // (onto_sums: acc + the products)
    int slot = ring % C::kStages;
    uint32_t phase = (ring / C::kStages) & 1;  // of the slot's "full" barrier
    Fragments a_low, a_high;  // the two halves' register sets
#pragma unroll 1
    for (int s = 0; s < stages; ++s) {
      const uint8_t* st = smem + slot * C::kStage;
      const uint32_t descriptor_low = swizzled_descriptor_low(smem_address(st));
      WordConstants<T> consts;
      wait_barrier(&full[slot], phase);
      dequantize(st, 0, a_low, consts);
      issue(descriptor_low, a_low, s == 0 && !onto_sums);
      wgmma_wait<1>();  // the previous stage's wgmmas are done: a_high and that stage are free
      if (s > 0) {
        // Order this thread's reads of the stage (generic proxy) before its refill (async proxy), as the PTX memory
        // model asks. Left out, the kernel was 1-2% faster (2026-12-02-wgmma-rotated-words.md): kept all the same.
        fence_proxy_async();
        arrive_barrier(&empty[slot == 0 ? C::kStages - 1 : slot - 1]);
      }
      dequantize(st, 1, a_high, consts);
      issue(descriptor_low + (C::kXHalf >> 4), a_high, false);
      wgmma_wait<1>();  // the first half's wgmmas are done: a_low is free
      if (++slot == C::kStages) slot = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    ring += stages;
#pragma unroll
    for (int j = 0; j < C::kAcc; ++j) fence_register(acc[j]);
    return slot == 0 ? C::kStages - 1 : slot - 1;  // the slot of the run's last stage
  };
  auto release = [&](int slot) {
    fence_proxy_async();
    arrive_barrier(&empty[slot]);
  };
  auto sync_consumers = [] { sync_threads(1, C::kThreads); };

  // Accumulator j: output feature 64 wg + 16 w + lane / 4 (+ 8 for j % 4 >= 2) of the block's columns,
  // row 8 (j / 4) + 2 (lane % 4) (+ 1 for odd j).
  const int row_in_8 = 2 * (lane % 4), feature = 64 * wg + 16 * w + lane / 4;
  // The output tile goes through shared memory, to be written in full 16-byte rows: through the slot of the run's
  // last stage, released after.
  auto store_output = [&](int m0, int t0, int last_slot) {
    sync_consumers();  // every thread is done with the ring's last stage
    T* staged = reinterpret_cast<T*>(smem + last_slot * C::kStage);
    const T* bias = static_cast<const T*>(args.bias);
    const bool has_bias = bias != nullptr && t0 + wg < tiles64;
    const float b_low = has_bias ? to_float(bias[t0 * 64 + feature]) : 0.f;
    const float b_high = has_bias ? to_float(bias[t0 * 64 + feature + 8]) : 0.f;
#pragma unroll
    for (int j = 0; j < C::kAcc; ++j) {
      const int high = j % 4 / 2;
      staged[(8 * (j / 4) + row_in_8 + j % 2) * C::kOutRow + feature + 8 * high] =
          from_float<T>(acc[j] + (high ? b_high : b_low));
    }
    sync_consumers();
    T* out = static_cast<T*>(args.out);
    constexpr int kPieces = kWgN / 8;  // pieces of 16 bytes per row
    for (int idx = tid; idx < BM * kPieces; idx += C::kThreads) {
      const int r = idx / kPieces, c = idx % kPieces;
      if (m0 + r < M && t0 + c / 8 < tiles64)
        *reinterpret_cast<uint4*>(out + (size_t)(m0 + r) * N + t0 * 64 + c * 8) =
            *reinterpret_cast<const uint4*>(staged + r * C::kOutRow + c * 8);
    }
    release(last_slot);
  };

  // Stream-K. A shared tile's sums go through per-block slots of `partial`: each thread's accumulators as float4s
  // at a stride of the block, read back by the finishing block's thread of the same index (coalesced both ways, no
  // layout to undo). This hand-over is dear: left out (timing only, wrong sums), calls of one or two rounds took
  // 6-17% less time (bf16, H100: 70B-qkv M = 256 15%, 512 8%, 7B-qkv 384 and 512 10-12%;
  // benchmarks/results/2026-12-06-wgmma-one-round.md). The finishing block takes the others' sums once all have
  // arrived (`take_sums`): after its own run of the tile, onto its sums; or, where the rest of the tile is handed over
  // well before that run starts (`take_early`), into its accumulators before it, for the wgmmas to add them, so that
  // the blocks do not all read at the end: 0-2% less time there (median 1.1% on 9 cells; 7B-qkv M = 512 2.1%).
  auto take_sums = [&](int tile, bool before_run) {
    int32_t* lock = args.locks + (tile - first_shared);
    const int last = ((tile - first_shared + 1) * work.k_stages - 1) / work.units_per_block;  // holds the tile's end
    if (tid == 0) {
      while (load_acquire(lock) < last - (int)blockIdx.x) __nanosleep(64);
      *lock = 0;  // every part has arrived: ready for the next call
    }
    sync_consumers();
    auto sums_of = [&](int b, int j) {  // block b's float4 j / 4 of this thread
      return __ldcg(args.partial + ((size_t)b * (C::kAcc / 4) + j / 4) * C::kThreads + tid);
    };
    if (before_run) {  // (the next block's sums only, see take_early)
      // No wgmma group is open here, but without this wait ptxas cannot tell, and accumulators written by other
      // instructions make it serialize every wgmma of the kernel (C7515): 10-34% more time.
      wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < C::kAcc; j += 4) {
        const float4 v = sums_of(blockIdx.x + 1, j);
        acc[j] = v.x, acc[j + 1] = v.y, acc[j + 2] = v.z, acc[j + 3] = v.w;
      }
      return;
    }
    for (int b = blockIdx.x + 1; b <= last; ++b) {
#pragma unroll
      for (int j = 0; j < C::kAcc; j += 4) {
        const float4 v = sums_of(b, j);
        acc[j] += v.x, acc[j + 1] += v.y, acc[j + 2] += v.z, acc[j + 3] += v.w;
      }
    }
  };
  // A run holding a shared tile's first stages is its block's last run. Where a block's run is longer than a tile,
  // only the next block holds the rest of the tile, as its first run, which ends units_per_block - k_stages stages
  // before this run starts: taken early where that is kTakeEarlySlack stages or more. Where two blocks hold the rest
  // (70B-qkv at M = 128..256, 7B-down at 480 and 576), taking the tile end's sums early too, with a lock that told
  // them apart, was 0-3% slower (H100, benchmarks/results/2026-12-06-wgmma-tile-end-early-ab.log): the finishing
  // block hardly waits for the other's sums after its run (0.5 us, 2026-12-06-wgmma-stream-k-timeline.md), so there
  // is no wait for the early load to hide in.
  constexpr int kTakeEarlySlack = 4;
  const bool take_early = !kSplits && work.units_per_block >= work.k_stages + kTakeEarlySlack;

  for_each_run([&](int tile, int k_first, int stages) {
    int m0, t0;
    tile_origin(tile, m0, t0);
    const bool finishes_shared_tile = !kSplits && k_first == 0 && stages < work.k_stages;
    if (finishes_shared_tile && take_early) take_sums(tile, true);
    const int last_slot = accumulate(stages, finishes_shared_tile && take_early);
    if (kSplits || k_first > 0) release(last_slot);  // (the others stage their output in it)

    if constexpr (kSplits) {  // one k split of one tile: partial sums [split][M][N] for the second kernel
      float* partial = reinterpret_cast<float*>(args.partial) + (size_t)(k_first / work.units_per_block) * M * N;
      if (t0 + wg >= tiles64) return;
#pragma unroll
      for (int j = 0; j < C::kAcc; ++j) {
        const int m = m0 + 8 * (j / 4) + row_in_8 + j % 2;
        if (m < M) partial[(size_t)m * N + t0 * 64 + feature + 8 * (j % 4 / 2)] = acc[j];
      }
      return;
    }

    if (k_first > 0) {  // the tile's first stages are another block's: hand the sums over to it
      float4* slot = args.partial + (size_t)blockIdx.x * (C::kAcc / 4) * C::kThreads;
#pragma unroll
      for (int j = 0; j < C::kAcc; j += 4)
        __stcg(slot + j / 4 * C::kThreads + tid, make_float4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]));
      // Released by one thread's add after the consumers' barrier, which orders every consumer's stores before it
      // (the release is cumulative: PTX ISA, memory consistency model), so that only warp 0 waits for the stores to
      // land. A fence by every consumer before the add took 0.5-1.4% more time where stream-K hands sums over
      // (H100, bf16 and fp16: 7B-qkv M = 384 and 512, 70B-qkv, 7B-up; benchmarks/results/
      // 2026-12-07-wgmma-handover-release-ab.log). Handing the release to an idle producer warp instead (sessions
      // 85-87) saved about as much there but was 2-6% slower at M = 640 in bf16, on every layer, whole tiles too:
      // any branch added to the producer's code made ptxas schedule the 32..192-row main loops with 6-8 more
      // instructions (scripts/marlin_wgmma_sass.py).
      sync_consumers();
      if (tid == 0) add_acq_rel(args.locks + (tile - first_shared), 1);
      return;
    }
    if (finishes_shared_tile && !take_early) take_sums(tile, false);
    store_output(m0, t0, last_slot);
  });
#else
  __trap();  // built without sm_90a: the host never launches it (wgmma_serves)
#endif
}

// out = sum of the k splits' partials (+ bias), 4 columns per thread.
template <typename T>
__global__ void marlin_sum_splits_kernel(const float4* partial, const T* bias, T* out, int64_t quads, int N,
                                        int splits) {
  using T2 = typename Dtype<T>::T2;
  wait_for_prior_kernel();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < quads; i += (int64_t)gridDim.x * blockDim.x) {
    float4 s = partial[i];
    for (int k = 1; k < splits; ++k) {
      const float4 v = partial[k * quads + i];
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    if (bias) {
      const int n = (int)(i * 4 % N);
      s.x += to_float(bias[n]), s.y += to_float(bias[n + 1]), s.z += to_float(bias[n + 2]), s.w += to_float(bias[n + 3]);
    }
    T2* o = reinterpret_cast<T2*>(out) + 2 * i;
    o[0] = Dtype<T>::pack(s.x, s.y);
    o[1] = Dtype<T>::pack(s.z, s.w);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------
struct WgmmaPlan {
  int bm;            // rows per block tile: 32, 64, 128, 160, 192 or 256
  int grid;          // blocks
  int shared_tiles;  // tiles cut between blocks without k splits (one lock each)
  WgWork work;
};

// Measured on an H200 (bf16, g128): k splits summed by a second kernel beat stream-K, which hands tiles between
// blocks, even when their runs are several stages longer than its shares (see plan_wgmma); where they fill 90% of
// the SMs or more, by 6-29% (7B-down M = 48..512, 70B-qkv 24..128, 70B-down 48..160; level on 70B-down at 256:
// benchmarks/results/2026-12-02-wgmma-splits-vs-stream-k-ab.log). Stream-K shares the last round of whole tiles
// plus the remainder, each block's run at least 512 k; but where one round of whole tiles is at least 90%
// full, the tiles run whole (at most a tenth of the SMs idle, against the sums that sharing hands between blocks;
// past one round, see plan_wgmma's cost model): on an H200, all plans timed in turn at one clock (bf16,
// benchmarks/results/2026-12-02-marlin-wgmma-plan.md), 7B-qkv M = 1024 (384 tiles) 171 -> 166 us, 7B-down
// M = 1024 (128 tiles) 155 -> 149, 70B-down M = 512 and 1024 2% less; with fewer than 90%, sharing stays
// ahead (70B-up M = 1024, 58% full: 1510 against 1545 whole, 7B-qkv M = 256, 73%: 49.8 against 53.5).
// Rows per block tile: 32 up to M = 32 (70B-qkv at M = 24/32: 28.0 against 30.5 us on 64-row tiles,
// 2026-12-01-wgmma-small-tiles.md), 64 up to 64, 128 up to 128; above, the one of 128, 160, 192 and 256 rows with the
// least cost, tiles x cost per tile, the larger on a tie; rows past M cost as much as real ones. The costs per tile,
// 50 : 56 : 66 : 90, are the medians over the six Llama layers of each tile's time a row tile, on an H100, every tile
// size forced in turn at M = 192..1152 and timed interleaved (benchmarks/results/2026-12-06-wgmma-192-rows.md): a
// row costs 14% more in a 128-row tile than in the larger ones, which cost about the same a row, so the rule mostly
// picks the tile that pads M least. M = 129..160 takes one 160-row tile, 161..192 one of 192, 193..256 one of 256,
// 257..320 two of 160, 321..384 two of 192, 385..480 three of 160, 481..512 two of 256, 513..576 three of 192, and so
// on; the 256-row tile's cost, at the low end of its measured 87-100, keeps it at M = 1024, 2048 and 4096.
int block_rows(int M) {
  if (M <= 128) return M <= 32 ? 32 : M <= 64 ? 64 : 128;
  constexpr int kRows[4] = {256, 192, 160, 128}, kCost[4] = {90, 66, 56, 50};
  int best = 0;
  for (int i = 1; i < 4; ++i) {
    if ((M + kRows[i] - 1) / kRows[i] * kCost[i] < (M + kRows[best] - 1) / kRows[best] * kCost[best]) best = i;
  }
  return kRows[best];
}

// The three ways to run a launch's tiles (see WgWork), set on a plan whose bm and k_stages are set.
WgmmaPlan whole_tiles(WgmmaPlan p, int tiles, int sms) {
  WgWork& w = p.work;
  w.splits = 1, w.whole_rounds = (tiles + sms - 1) / sms, w.shared_units = 0, w.units_per_block = 1;
  p.grid = std::min(tiles, sms), p.shared_tiles = 0;
  return p;
}

WgmmaPlan shared_tiles(WgmmaPlan p, int tiles, int sms) {  // stream-K: whole rounds but the last two, then shares
  WgWork& w = p.work;
  w.splits = 1, w.whole_rounds = std::max(tiles / sms - 1, 0);
  p.shared_tiles = tiles - w.whole_rounds * sms;
  w.shared_units = p.shared_tiles * w.k_stages;
  w.units_per_block = std::max((w.shared_units + sms - 1) / sms, std::min(w.k_stages, kMinRun));
  p.grid = w.whole_rounds > 0 ? sms : (w.shared_units + w.units_per_block - 1) / w.units_per_block;
  return p;
}

WgmmaPlan k_splits(WgmmaPlan p, int tiles, int splits) {
  WgWork& w = p.work;
  w.units_per_block = (w.k_stages + splits - 1) / splits;
  w.splits = (w.k_stages + w.units_per_block - 1) / w.units_per_block;
  w.whole_rounds = w.shared_units = 0;
  p.grid = tiles * w.splits, p.shared_tiles = 0;
  return p;
}

WgmmaPlan plan_wgmma(int M, int K, int N, const DeviceInfo& device) {
  const int sms = device.sms;
  WgmmaPlan p;
  p.bm = block_rows(M);
  const int columns = block_columns(p.bm);
  const int tiles = ((M + p.bm - 1) / p.bm) * ((N + columns - 1) / columns);
  WgWork& w = p.work;
  w.k_stages = (K + kWgK - 1) / kWgK;  // (K a multiple of 64: the last stage's second half may lie past it)
  const int splits = tiles >= sms ? 1 : std::max(1, std::min(sms / tiles, w.k_stages / kMinRun));
  // K is split where a split's run is at most kSplitSlack stages longer than a stream-K share would be: stream-K's
  // hand-overs cost about as much as several stages. On an H200, 7B-qkv at M = 33..128 (2 splits of 16 stages on
  // 96 SMs, against shares of 12 on 132) 1-6% faster split, 4096 x 6144 at M = 160 (16 against 12) 4%, 4096 x 4096
  // at M = 384 (16 against 12) 3%; 7B-down at M = 384 (43 against 32) 3% slower
  // (benchmarks/results/2026-12-02-wgmma-split-slack-ab.log, 2026-12-02-wgmma-split-fill70-ab.log). Until then K
  // was split only where the splits filled 90% of the SMs.
  constexpr int kSplitSlack = 8;
  const int split_run = (w.k_stages + splits - 1) / splits, shared_run = (tiles * w.k_stages + sms - 1) / sms;
  if (splits > 1 && split_run <= shared_run + kSplitSlack) return k_splits(p, tiles, splits);
  // Whole tiles in rounds where a tile group's activations (kGroupM row tiles of all of K) do not fit in L2: the
  // blocks of a round start their tiles together and walk K in step, so each activation row is read from memory
  // once a group; shared runs start at any k, out of step, and read the activations again (70B-down, K = 28672,
  // M = 2048: 256-row tiles, 8 x 14.7 MB of a group against a 60 MB L2; stream-K 1752 us against cuBLAS's 1439,
  // benchmarks/results/2026-12-02-dense-threshold-settled.log).
  constexpr int kActivationBytes = 2;  // fp16 / bf16
  const int64_t group_activation_bytes = (int64_t)std::min((M + p.bm - 1) / p.bm, kGroupM) * p.bm * K * kActivationBytes;
  if (group_activation_bytes > device.l2_bytes) return whole_tiles(p, tiles, sms);
  if (tiles < sms) {  // one round, part-empty: whole tiles only where it is at least 90% full
    return 10 * tiles >= 9 * sms ? whole_tiles(p, tiles, sms) : shared_tiles(p, tiles, sms);
  }
  // Past one round, the plan whose cost, in stage times of a block, is least (bf16, H100, every plan timed in turn
  // on 27 cells of the six Llama layers at M = 288..4096: benchmarks/results/2026-12-06-wgmma-plans.md).
  // - Whole rounds: the rounds x the stages of a tile.
  // - Stream-K: a block's share, plus what sharing costs. That varied from a tenth of a round (7B-down at M = 3072
  //   and 4096) to seven tenths (70B-qkv at M = 2048 and 4096, 256-row tiles), a quarter on most cells. It is taken
  //   as a third, where the measured choice turns: a last round a third empty or less runs whole (70B-qkv at
  //   M = 2048, 4.85 rounds: 478 us whole against 530 shared; 4096, 9.70: 980 against 1009), one 0.36 empty shares
  //   (7B-qkv at 3072 and 70B-qkv at 1152).
  // - K splits, in rounds of tiles x splits blocks (blocks past the SMs start as others end; the splits of a round
  //   walk K in step): the rounds x a split's stages, plus the fp32 partial sums that the splits write and the
  //   second kernel reads (8 bytes a split and output element at 3 TB/s, a stage taking 5.8 ns a row of the tile:
  //   within 1% of the measured times). Taken only where they beat stream-K at a sixth of a round, as sharing's
  //   cost is the one that varies: 70B-down at M = 576, 192 tiles of 224 stages: 2 splits in 3 rounds 398 us,
  //   shared 456, whole 494; 7B-down at 1152, 192 tiles of 86 stages: split 170-179, shared 155-163 (0.17 of a
  //   round).
  constexpr double kSharingRounds = 1.0 / 3, kLeastSharingRounds = 1.0 / 6;
  constexpr double kSumBytesPerNs = 3000, kStageNsPerRow = 5.8;
  const double rounds = (double)tiles / sms, whole_cost = (double)((tiles + sms - 1) / sms) * w.k_stages;
  const double stream_k_cost = (rounds + kSharingRounds) * w.k_stages;
  double best_split_cost = std::min(whole_cost, (rounds + kLeastSharingRounds) * w.k_stages);
  int best_splits = 1;
  for (int s = 2; s <= 4 && (w.k_stages + s - 1) / s >= kMinRun; ++s) {
    const double sum_stages = 8.0 * s * M * N / kSumBytesPerNs / (kStageNsPerRow * p.bm);
    const double cost = (double)((tiles * s + sms - 1) / sms) * ((w.k_stages + s - 1) / s) + sum_stages;
    if (cost < best_split_cost) best_split_cost = cost, best_splits = s;
  }
  if (best_splits > 1) return k_splits(p, tiles, best_splits);
  return whole_cost <= stream_k_cost ? whole_tiles(p, tiles, sms) : shared_tiles(p, tiles, sms);
}

// cuTensorMapEncodeTiled from the driver the runtime already loaded (the extension does not link libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 2-D map of `rows` rows of `columns` elements, `row_bytes` apart, read in boxes of
// `box_rows` x `box_columns`; what lies outside reads as zeros.
bool encode_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, uint64_t columns, uint64_t rows,
                uint64_t row_bytes, uint32_t box_columns, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {columns, rows}, strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_columns, box_rows}, element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The maps of a call. x: boxes of BM rows x 64 columns (128 bytes, a half stage), stored with the 128-byte
// swizzle. The marlin tensors are read as 8-byte words: the weight words of a k16 step form one row
// (N / 64 tiles of 512 bytes), a block's box is 8 rows x its 2 or 4 tiles (the stage's [k16][tile][lane]
// layout); scales (2 bytes a column) and zero points (1 byte a column: two nibbles of two subtiles) are rows
// per group, a box the stage's 1, 2 or 4 group rows x the block's columns.
template <typename T>
const char* encode_maps(WgMaps* maps, const GemmArgs& args, int bm) {
  if (tensor_map_encoder() == nullptr) return "marlin: the CUDA driver has no cuTensorMapEncodeTiled";
  const uint64_t K = args.K, N = args.N, groups = args.group_shift < 0 ? 1 : K >> args.group_shift;
  const uint32_t group_rows = stage_group_rows(args.group_shift), columns = block_columns(bm);
  const CUtensorMapDataType type =
      std::is_same<T, half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  constexpr CUtensorMapDataType kWord = CU_TENSOR_MAP_DATA_TYPE_UINT64;
  constexpr CUtensorMapSwizzle kPlain = CU_TENSOR_MAP_SWIZZLE_NONE;
  bool ok = encode_map(&maps->x, type, args.x, K, args.M, K * sizeof(T), kHalfK, bm, CU_TENSOR_MAP_SWIZZLE_128B) &&
            encode_map(&maps->weights, kWord, args.qweight, N, K / 16, N * 8, columns, kWgK / 16, kPlain) &&
            encode_map(&maps->scales, kWord, args.scales, N / 4, groups, N * 2, columns / 4, group_rows, kPlain);
  if (ok && args.zeros != nullptr)
    ok = encode_map(&maps->zeros, kWord, args.zeros, N / 8, groups, N, columns / 8, group_rows, kPlain);
  return ok ? nullptr : "marlin: cuTensorMapEncodeTiled refused a tensor of this call";
}

template <typename T, int BM, int kGroupRows, bool kHasZeros>
auto wgmma_kernel(bool splits) {
  return splits ? marlin_wgmma_kernel<T, BM, kGroupRows, kHasZeros, true>
                : marlin_wgmma_kernel<T, BM, kGroupRows, kHasZeros, false>;
}

template <typename T, int BM, bool kHasZeros>
const char* launch_wgmma(const GemmArgs& args, const WgmmaPlan& plan, const DeviceInfo& device, cudaStream_t stream) {
  const bool splits = plan.work.splits > 1;
  const int group_rows = stage_group_rows(args.group_shift);
  auto kernel = group_rows == 1   ? wgmma_kernel<T, BM, 1, kHasZeros>(splits)
                : group_rows == 2 ? wgmma_kernel<T, BM, 2, kHasZeros>(splits)
                                  : wgmma_kernel<T, BM, 4, kHasZeros>(splits);
  constexpr int kSmem = WgTile<BM>::kSmemBytes;
  WgMaps maps;
  if (const char* bad = encode_maps<T>(&maps, args, BM)) return bad;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  err = launch_dependent(kernel, dim3(plan.grid), dim3(WgTile<BM>::kBlockThreads), kSmem, stream,
                         device.dependent_launch, 1, args, maps, plan.work);
  if (err == cudaSuccess && splits) {
    const int64_t quads = (int64_t)args.M * args.N / 4;
    const int grid = (int)std::min<int64_t>((quads + 255) / 256, 8 * device.sms);
    err = launch_dependent(marlin_sum_splits_kernel<T>, dim3(grid), dim3(256), 0, stream, device.dependent_launch, 1,
                           args.partial, static_cast<const T*>(args.bias), static_cast<T*>(args.out), quads, args.N,
                           plan.work.splits);
  }
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// The kernel for BM rows, with or without zero points.
template <typename T, int BM>
const char* launch_wgmma_rows(const GemmArgs& args, const WgmmaPlan& plan, const DeviceInfo& device,
                              cudaStream_t stream) {
  return args.zeros != nullptr ? launch_wgmma<T, BM, true>(args, plan, device, stream)
                               : launch_wgmma<T, BM, false>(args, plan, device, stream);
}

template <typename T>
const char* dispatch_wgmma(const GemmArgs& args, const WgmmaPlan& plan, const DeviceInfo& device, cudaStream_t stream) {
  switch (plan.bm) {
    case 32: return launch_wgmma_rows<T, 32>(args, plan, device, stream);
    case 64: return launch_wgmma_rows<T, 64>(args, plan, device, stream);
    case 128: return launch_wgmma_rows<T, 128>(args, plan, device, stream);
    case 160: return launch_wgmma_rows<T, 160>(args, plan, device, stream);
    case 192: return launch_wgmma_rows<T, 192>(args, plan, device, stream);
    default: return launch_wgmma_rows<T, 256>(args, plan, device, stream);
  }
}

}  // namespace

// Measured on an H200 (benchmarks/results/2026-11-30-wgmma.md): wgmma is faster from 17 rows on, except
// on layers with many columns, where mma.sync keeps enough blocks busy up to 32 rows (M = 32: 70B-up
// 138 us against 183, 7B-up 38 us against ~50; but 7B-down 20 us against 50, 70B-down 83 against 90).
bool wgmma_serves(const DeviceInfo& device, int M, int N) {
  return device.major == 9 && device.minor == 0 && M > (N <= 16384 ? 16 : 32);
}

int64_t wgmma_partial_floats(const DeviceInfo& device, int M, int K, int N) {
  const WgmmaPlan plan = plan_wgmma(M, K, N, device);
  if (plan.work.splits > 1) return (int64_t)plan.work.splits * M * N;
  return plan.shared_tiles > 0 ? (int64_t)plan.grid * plan.bm * block_columns(plan.bm) : 0;  // a tile's sums per block
}

int64_t wgmma_lock_count(const DeviceInfo& device, int M, int K, int N) {
  return plan_wgmma(M, K, N, device).shared_tiles;
}

const char* wgmma_gemm(const GemmArgs& args, bool is_bf16, const DeviceInfo& device, cudaStream_t stream) {
  const WgmmaPlan plan = plan_wgmma(args.M, args.K, args.N, device);
  return is_bf16 ? dispatch_wgmma<__nv_bfloat16>(args, plan, device, stream)
                 : dispatch_wgmma<half>(args, plan, device, stream);
}

}  // namespace litquant_marlin
