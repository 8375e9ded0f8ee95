// The marlin kernel's decode path: M = 1..32 activation rows (token-by-token decode, small batches,
// speculative drafts), on the same 4-bit marlin layout as marlin.cu. At these sizes a layer is a
// stream of weight bytes: what counts is the bytes in flight and the instructions per weight, so the
// weights go from global memory straight into registers (no shared-memory staging, no block barriers
// in the loop), at 16 warps per SM (20 with kShallowRing; two token blocks: 12, or 16 with it; four: 8, or 12).
//
// The multiplication (TokensOnTensorCores) runs on mma.sync with the tokens as the B operand, 8 tokens an
// instruction, one, two or four blocks of 8: the codes go into the mma unscaled (a lop3 a pair, most after a
// shift), and each quantization group's scale and zero point are applied to its fp32 sums.
// Work split: a block of kWarps warps (8 where `plan_decode` widens it) takes one 64-column tile and one of
//   `splits` k ranges; its warps take consecutive 128-row chunks of that range. A warp streams its chunks
//   through a ring of 8 registers (uint4), each refilled with the next chunk's tile as soon as it is read:
//   4 KB a warp in flight, 64 KB an SM at 4 blocks (on some grids a ring of 4: kShallowRing, see plan_decode; a
//   deeper ring, 8-16 tiles in shared memory filled by cp.async, was slower on nearly every layer, by up to 22%:
//   benchmarks/results/2026-12-01-decode-streaming.md).
//   Warps add up through shared memory; with several splits, each block writes fp32 partial sums and
//   the last block of a column tile to finish (counted on its lock, which it then resets to zero) adds
//   them up and writes the output; on Hopper, 2 splits are a cluster of 2 blocks, the second of which writes
//   its sums straight into the first's shared memory (distributed shared memory), with no global round trips. A grid
//   that fills the GPU is launched as a dependent of the kernel ahead (common.cuh): each warp's first
//   chunk of weights is on its way before it waits for that kernel.
#include <type_traits>

#include "common.cuh"

namespace litquant_marlin {
namespace {

constexpr int kWarps = 4;       // a block's warps, but for the wide blocks of `plan_decode`
constexpr int kChunkTiles = 8;  // k16 tiles per chunk: 128 rows, 8 uint4 per lane
constexpr int kMaxRows = 32;    // four blocks of 8 tokens

// Blocks resident per SM for M rows (the multiplier's __launch_bounds__, and what the split plan counts):
// 4 for one token block (128 registers a thread; measured on an H200, 70B-up at M = 1 on the former fp32
// path: 67.8 us at 4 blocks against 76-79 us at 3), 3 for two (168 registers; at 4 blocks they spill, and 4 of
// the 6 Llama-2 layers ran 1-6% slower at M = 12 and 16, 70B-down 6-8% faster), 2 for four (255 registers; at 3
// they spill, and 70B-up ran 13-15% slower at M = 24 and 32, 7B-qkv 8% faster;
// benchmarks/results/2026-12-01-decode-32-rows.md). With the codes centered (fewer registers: 4 blocks of two
// token blocks spill up to 48 bytes, 3 of four up to 28, none at g128 without zero points), one block more was
// again no better: M = 12/16 1-10% more time on five of the six layers, M = 24/32 up to 4% less on 7B-qkv and
// 7B-up, 6-7% more on the down layers (2026-12-01-decode-centered-run3.log).
// A ring of 4 weight tiles a warp (kShallowRing) in place of 8 frees the registers for one block more, with no
// spills: two token blocks 120-128 a thread, 4 blocks; four 157-168, 3 blocks. plan_decode takes it where the grid
// fills 90% of that wave (two token blocks) or two waves (four). Measured on an H200 (interleaved, g128):
// - two token blocks (2026-12-03-decode-two-blocks-ring4.md, -dispatch.md): 70B-up M = 16 bf16 3-4% less time,
//   fp16 6-7%; 70B-down, 7B-down and the 70B attention output 0-4%; on grids under 3/4 of a wave 7B-qkv 3-8%
//   more, 70B-qkv 0-3%, so those keep the deep ring;
// - four (2026-12-03-decode-four-blocks-ring4.md): 70B-up (896 blocks, 2.3 waves) M = 24 / 32 bf16 4% / 3% less,
//   fp16 7% / 5%; 28672 columns (448 blocks, 1.1 waves) bf16 3% more, fp16 level, so that one keeps the deep ring;
// - one (2026-12-04-decode-timeline.md): 96 registers a thread for a fifth block an SM (no spills at g128; bf16 with
//   zero points spills 8-12 bytes at g32 / g64). plan_decode takes it only where that turns the grid's second, part
//   wave into one wave: 70B-qkv (640 blocks) at M = 1 15.97 -> 14.61 us; on grids planned for it otherwise, 70B-up
//   was 4% slower, 7B-up and 7B-down 6-10% (their splits changed too).
constexpr int kShallowRing = 4;
constexpr int blocks_per_sm(int rows, int ring_tiles = kChunkTiles) {
  const bool shallow = ring_tiles < kChunkTiles;
  return rows <= 8 ? 4 + shallow : rows <= 16 ? 3 + shallow : 2 + shallow;
}

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

// 1 / v to within an ulp (one MUFU instruction, denormals flushed).
__device__ __forceinline__ float reciprocal(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(v));
  return r;
}

// A lane's scales (its 8 columns, in pairs) and zero points (nibbles) of the quantization group of `tile`,
// read at (group, 64-column tile, lane/4) of the permuted scales and the packed zero points.
struct GroupParams {
  uint4 scales;
  uint2 zeros;
};

// (A tile past K, the one after a warp's last group, reads the last group's.)
template <bool kHasZeros>
__device__ __forceinline__ GroupParams load_group_params(const GemmArgs& args, int tile, int column_tile, int lane) {
  const int group = args.group_shift < 0 ? 0 : (min(tile, args.K / 16 - 1) * 16) >> args.group_shift;
  const size_t at = (size_t)group * (args.N / 8) + column_tile * 8 + lane / 4;
  GroupParams p{__ldg(args.scales + at), make_uint2(kSymmetricZeros, kSymmetricZeros)};
  if constexpr (kHasZeros) p.zeros = __ldg(args.zeros + at);
  return p;
}

// The multiplication. The tokens are mma's B operand (16 k x 8 tokens) and the weight its
// A operand (16 output features x 16 k), as in wgmma.cu: word j of a lane's uint4 holds the B fragments of
// subtiles 2j and 2j + 1 (marlin.cu), which are together the A fragment of features 16j..16j+15, in the
// register order {b0b1 of 2j, b0b1 of 2j+1, b2b3 of 2j, b2b3 of 2j+1}. So one mma.m16n8k16 covers 16
// features x 8 tokens, and a 16 x 64 tile takes 4 mma a block of 8 tokens. (With the tokens as A, 16 rows
// an mma, a tile took 8 mma whatever M: 17-30% more time at M = 2..8 with the same dequantization, run 1 of
// benchmarks/results/2026-12-01-decode-tokens-as-b.md.)
// Each warp copies the activations of its next chunk (the M real rows of 128 k values) into its own
// shared-memory double buffer with cp.async, through L1: the blocks on an SM stream the same k ranges
// (their warp w takes the same chunks) at about the same time. ldmatrix reads the B fragments. (A
// fragments read straight from global memory cost 8 cache lines a load, as the rows are K apart:
// 25-40% slower at M = 16, benchmarks/results/2026-11-30-marlin-decode-tc.md.)
//
// The codes go into the mma unscaled. OR-ing a nibble q into mantissa bits p..p+3 of a power of two 2^m
// (m = 10 fp16, 7 bf16; kMagic) gives the exact value 2^m + 2^p q: one lop3 a pair, after a shift unless the
// nibble already lies there. With one token block they go in biased (fp16 at p = m - 4, the top 4 bits:
// 2^p (16 + q); bf16 at p = 0: 128 + q), and one more mma a tile, against ones, gives each token's activation sum
// S: the group's products D are then s 2^-p (D - (2^m + 2^p z) S), for scale s and zero point z. With two or four
// token blocks (kCentered) the pairs are centered instead, exactly (q - z, WordCenters in common.cuh, which the
// other kernels' dequantization shares), and the mma of the sums goes: on an H200 (interleaved A/Bs, bf16 and fp16
// g128, benchmarks/results/2026-12-01-decode-centered.md) M = 12/16 2-5% less time on all six Llama-2 layers, M = 24/32
// 7-10% on the wide ones, where with one token block it cost 0-4% more (the kernel is memory bound there, and its
// ALU work grows). bf16 biased at p = 0 with two or four token blocks, 8% and 3% fewer instructions than centered,
// was 1-3% slower at M = 16 and 3-11% at M = 32: the mma of the sums cost more than the adds they replace
// (2026-12-02-decode-one-block-sums.md); again 1.5-6% slower with the 4-tile ring at 4 blocks an SM, and so with one
// mma a tile for both token blocks' sums (their B fragments are the tokens' A fragment), although the centering alone
// costs 7-10% of M = 16's time (2026-12-04-decode-clusters-prefetch.md). Products of fp16/bf16 values are exact in
// fp32; the bias costs a few of the 24 bits of the sums, below the output's rounding: 16 units of q for fp16, 128 for
// bf16, whose output is 8 times coarser (a bias of 1024 units, fp16 at p = 0, made fp16 errors 1.6-3.4x the torch
// reference's on activations of mean 3).
// The sums stay in the units of the group being multiplied: while group g runs, acc holds (the sums of the
// groups before) / s_g, and its mma add D_g straight into acc; at its end
//     acc <- (s_g / s_g+1) (acc - (2^m + 2^p z_g) S)        (centered: acc <- (s_g / s_g+1) acc)
// which is (the sums up to g) / s_g+1, and the warp's last group ends with the scale of the group after it
// (`next`, read a group ahead; past K, the last one), which `store` multiplies back. So one set of fp32 sums
// a lane, not two (the running sums and the group's D): 64 registers less with four token blocks. Scales
// must not be 0 (MarlinQuantLinear makes such groups' codes equal their zero point and their scale 1).
// Measured on an H200 (g128, benchmarks/results/2026-12-01-decode-tokens-as-b.md):
// M = 2..8 21-32% less time than dequantizing each pair with its scale first (then 8 mma a tile, tokens as A);
// M = 1 2-13% less than the fp32 FMA path on the CUDA cores that it replaces (one AND and one FFMA a
// weight; ncu, 7B-qkv: 3.4M instructions against 5.4M), except at g32 (3-5% slower).
//
// stream_chunks drives it through begin (before the warp's run of chunks), start_chunk, start_group /
// end_group (at the first and the last tile of each quantization group), multiply_tile (one 16 x 64 weight
// tile, one uint4 a lane; given its place in the chunk) and store (the warp's sums, as plain values, into a
// [kRows][64] tile); a warp's shared memory is its Staging.
template <typename T, bool kHasZeros, int kTokenBlocks, int kRing = kChunkTiles>
struct TokensOnTensorCores {
  using Element = T;
  static constexpr bool kIsHalf = std::is_same<T, half>::value;
  static constexpr bool kCentered = kTokenBlocks >= 2;  // codes minus their zero point before the mma
  static constexpr int kRows = 8 * kTokenBlocks;
  static constexpr int kRingTiles = kRing;  // weight tiles in flight a warp
  static constexpr int kBlocksPerSm = blocks_per_sm(kRows, kRing);
  // p: where q sits in the mantissa (see below). Centered pairs (WordCenters) lie at p = 0, where nibbles 0 and 4
  // need no shift (fp16 also takes nibbles 1 and 5, and 3 and 7 after one shift by 8, where they lie, 4 bits up,
  // and centers them by one fma2 by 1/16: one shift a word; bf16 three). The loop of a chunk at two token blocks
  // (sm_90a): 694 -> 658 instructions (bf16), 694 -> 605 (fp16). On an H200 (interleaved A/Bs, g128 zero points,
  // benchmarks/results/2026-12-02-decode-fewer-shifts.md), M = 12/16, bf16: p = 0 took 4-5% less time on 70B-up,
  // 70B-down, 7B-down and the 70B attention output, 1-2.5% on the other layers (M = 32 0-1%); fp16's high nibbles
  // 4.5-6% less than p = 0 alone on the 70B layers and 7B-up, 1-4% on the others (M = 24/32 level).
  // One token block (biased): fp16 at p = 6, bf16 at p = 0 (three shifts a word instead of four).
  static constexpr int kCodeBit = kIsHalf && !kCentered ? 6 : 0;
  static constexpr float kUnit = 1 << kCodeBit;  // 2^p
  static constexpr float kMagicValue = kIsHalf ? 1024.f : 128.f;  // 2^m
  // Per warp, two chunks of activations: kRows rows x 16 uint4 (128 k values), rows padded to 17 uint4 so
  // that the 8 rows an ldmatrix matrix reads fall in 8 different bank groups.
  static constexpr int kRowStride = 17;
  struct Staging {
    uint4 x[2][kRows * kRowStride];
  };
  static constexpr uint32_t kBufferBytes = sizeof(Staging) / 2;
  const GemmArgs& args;
  const int lane, column_tile;
  const uint32_t copy_to;    // shared address of the lane's first copy (row lane/8, k/8 = lane % 8), buffer 0
  const uint32_t read_from;  // shared address of the lane's ldmatrix row for tile 0, buffer 0
  int first = 0;
  uint32_t x_chunk = 0;  // read_from in the current chunk's buffer
  // word j, token block b: features 16j + lane/4 + {0, 8} x tokens 8b + 2(lane % 4) + {0, 1}
  float acc[4][kTokenBlocks][4] = {};
  // (not centered) the group's activation sums S so far of tokens 8b + 2(lane % 4) + {0, 1}, as the mma of ones
  // and the tokens leaves them: [b][2] and [b][3] repeat [b][0] and [b][1]. (Zeroing those two before every mma,
  // to keep two registers, cost fp16 M = 1..8 2-3.5% more time: 2026-12-02-decode-one-block-sums.md.)
  float token_sums[kTokenBlocks][4] = {};
  WordCenters<T> centers[kCentered ? 4 : 1];  // (centered) the zero points of word j
  GroupParams params, next;                // scales and zero points of the current group and the next

  __device__ TokensOnTensorCores(const GemmArgs& a, int col, Staging& st)
      : args(a),
        lane(threadIdx.x % 32),
        column_tile(col),
        copy_to(smem_address(&st.x[0][(lane / 8) * kRowStride + lane % 8])),
        // ldmatrix: lane l gives row l % 8 of matrix l / 8: tokens 0-7 x k 0-7 / 8-15, then tokens 8-15
        // (an x2 load reads the addresses of lanes 0-15 only)
        read_from(smem_address(&st.x[0][(8 * (lane / 16) + lane % 8) % kRows * kRowStride + (lane / 8) % 2])) {}

  // Chunk c's activations into buffer b: the lane copies k values 8(lane % 8).. and 64 + 8(lane % 8).. of rows
  // lane/8 + 4i (two copies a row, 128 bytes apart, on one address and one predicate). Rows past M are left as
  // they are: an output column depends on its own token only, and those outputs are never written.
  __device__ __forceinline__ void copy_chunk(int c, int b) {
    const int rows_left = args.M - lane / 8;  // rows 4i + lane/8 < M
    const uint4* x = args.x + (size_t)(lane / 8) * (args.K / 8) + c * 16 + lane % 8;
    const uint32_t to = copy_to + b * kBufferBytes;
#pragma unroll
    for (int i = 0; i < kRows / 4; ++i, x += args.K / 2) {
      if (4 * i < rows_left) {
        cp_async16_via_l1(to + 4 * i * kRowStride * 16, x);
        cp_async16_via_l1(to + 4 * i * kRowStride * 16 + 128, x + 8);
      }
    }
    cp_async_commit();
  }

  __device__ __forceinline__ void begin(int first_chunk, int last_chunk) {
    first = first_chunk;
    next = load_group_params<kHasZeros>(args, first * kChunkTiles, column_tile, lane);
    if (first < last_chunk) copy_chunk(first, 0);
  }

  // Before chunk c: everyone is done with chunk c - 1's buffer, which now receives chunk c + 1;
  // chunk c's copy has landed (for every lane, after the __syncwarp).
  __device__ __forceinline__ void start_chunk(int c, int last_chunk) {
    __syncwarp();
    if (c + 1 < last_chunk) copy_chunk(c + 1, (c + 1 - first) & 1);
    else cp_async_commit();  // an empty group keeps the count of the wait below
    cp_async_wait<1>();
    __syncwarp();
    x_chunk = read_from + ((c - first) & 1) * kBufferBytes;
  }

  // The B fragments of tile t of the current chunk, {x[b][0], x[b][1]} for token block b.
  __device__ __forceinline__ void load_tokens(int t, uint32_t (&x)[kTokenBlocks][2]) const {
    if constexpr (kTokenBlocks == 1) {
      ldmatrix_x2(x[0], x_chunk + 32 * t);
    } else {
      constexpr uint32_t kSixteenRowBytes = 16 * kRowStride * 16;  // from one ldmatrix_x4 to the next
#pragma unroll
      for (int h = 0; h < kTokenBlocks / 2; ++h) {  // tokens 16h..16h+15
        uint32_t r[4];
        ldmatrix_x4(r, x_chunk + 32 * t + h * kSixteenRowBytes);
        x[2 * h][0] = r[0], x[2 * h][1] = r[1], x[2 * h + 1][0] = r[2], x[2 * h + 1][1] = r[3];
      }
    }
  }

  // The scale of feature 16j + lane/4 + 8h in `p`, as fp32.
  static __device__ __forceinline__ float scale_of(const GroupParams& p, int j, int h) {
    const uint32_t pair = j == 0 ? p.scales.x : j == 1 ? p.scales.y : j == 2 ? p.scales.z : p.scales.w;
    return h ? Dtype<T>::high(pair) : Dtype<T>::low(pair);
  }

  __device__ __forceinline__ void store(float (&sums)[kRows][64]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int b = 0; b < kTokenBlocks; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          sums[8 * b + 2 * (lane % 4) + i % 2][16 * j + lane / 4 + 8 * (i / 2)] =
              acc[j][b][i] * (scale_of(next, j, i / 2) / kUnit);
  }

  // Nibbles i and i + 4 of `word` as the pair 2^m + 2^p q (bits 4i.., 4i + 16.. moved to bits p.., p + 16..).
  static __device__ __forceinline__ uint32_t biased_pair(uint32_t word, int i) {
    constexpr uint32_t kMask = 0x000f000fu << kCodeBit;
    const uint32_t moved = 4 * i >= kCodeBit ? word >> (4 * i - kCodeBit) : word << (kCodeBit - 4 * i);
    return mask_or(moved, kMask, Dtype<T>::kMagic);
  }

  // `next_group` is the first tile of the group after this one.
  __device__ __forceinline__ void start_group(int next_group) {
    params = next;
    next = load_group_params<kHasZeros>(args, next_group, column_tile, lane);
    if constexpr (kCentered) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) centers[j].load(word_zero_bits(params.zeros, j), i);
    }
  }

  __device__ __forceinline__ void multiply_tile(const uint4& w, int t) {
    uint32_t x[kTokenBlocks][2];
    load_tokens(t, x);
    if constexpr (!kCentered) {
      const uint32_t ones[4] = {Dtype<T>::kOnes, Dtype<T>::kOnes, Dtype<T>::kOnes, Dtype<T>::kOnes};
#pragma unroll
      for (int nb = 0; nb < kTokenBlocks; ++nb) Dtype<T>::mma(token_sums[nb], ones, x[nb][0], x[nb][1]);
    }
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // the pairs b0b1 of subtile 2j, b2b3 of 2j, b0b1 of 2j + 1, b2b3 of 2j + 1 (biased: nibbles {i, i + 4}, bits
      // 4i.. and 4i + 16.., moved to bits p.., p + 16..)
      uint32_t b[4];
      if constexpr (kCentered) {
        centers[j].center(words[j], b);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = biased_pair(words[j], i);
      }
      const uint32_t a[4] = {b[0], b[2], b[1], b[3]};
#pragma unroll
      for (int nb = 0; nb < kTokenBlocks; ++nb) Dtype<T>::mma(acc[j][nb], a, x[nb][0], x[nb][1]);
    }
  }

  __device__ __forceinline__ void end_group() {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t zero_bits = word_zero_bits(params.zeros, j);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // features 16j + lane/4 + 8h: subtile 2j + h
        const float ratio = scale_of(params, j, h) * reciprocal(scale_of(next, j, h));
        const float offset = -(kMagicValue + kUnit * (float)((zero_bits >> (4 * h)) & 0xf));
#pragma unroll
        for (int nb = 0; nb < kTokenBlocks; ++nb)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& a = acc[j][nb][2 * h + c];
            a = kCentered ? ratio * a : ratio * fmaf(offset, token_sums[nb][c], a);
          }
      }
    }
#pragma unroll
    for (int nb = 0; nb < kTokenBlocks; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) token_sums[nb][i] = 0.f;
  }
};

// Chunks [first, last) of one 64-column tile, with a ring of kRingTiles loads in flight (8, or kShallowRing): the
// register of tile t is refilled with the tile kRingTiles after it (of this chunk or the next) as soon as it has
// been read, so a warp always has kRingTiles uint4 (4 KB or 2 KB) on the way. No branches: the loads past `last`
// are predicated off.
template <int kGroupTiles, typename Multiplier>
__device__ __forceinline__ void stream_chunks(Multiplier& math, const GemmArgs& args, int column_tile, int first,
                                              int last) {
  const uint4* column = args.qweight + column_tile * 32 + threadIdx.x % 32;
  const uint32_t stride = args.N / 64 * 32;  // uint4 from a tile to the next k16 tile
  uint32_t next = (uint32_t)first * kChunkTiles * stride;  // the next tile to load
  constexpr int kRing = Multiplier::kRingTiles;
  uint4 ring[kRing];
#pragma unroll
  for (int t = 0; t < kRing; ++t, next += stride) ring[t] = load_streaming(offset_by(column, next), first < last);
  wait_for_prior_kernel();  // the first chunk's weights are on their way while the prior kernel ends
  math.begin(first, last);
  for (int c = first; c < last; ++c) {
    math.start_chunk(c, last);
#pragma unroll
    for (int t = 0; t < kChunkTiles; ++t, next += stride) {
      const uint4 w = ring[t % kRing];
      ring[t % kRing] = load_streaming(offset_by(column, next), t + kRing < kChunkTiles || c + 1 < last);
      if (t % kGroupTiles == 0) math.start_group(c * kChunkTiles + t + kGroupTiles);
      math.multiply_tile(w, t);
      if ((t + 1) % kGroupTiles == 0) math.end_group();
    }
  }
}

// Distributed shared memory (sm_90 on): the blocks of a cluster write into each other's shared memory, and count
// those writes on an mbarrier of the receiving block.
__device__ __forceinline__ void cluster_arrive_relaxed() {  // every thread of every block of the cluster, once
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {  // until every thread of the cluster has arrived
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ uint32_t address_in_block(const void* local, int rank) {  // `local`'s place in block `rank`
  uint32_t remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_address(local)), "r"(rank));
#endif
  return remote;
}
__device__ __forceinline__ void store_to_block(uint32_t remote, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(remote), "f"(v.x), "f"(v.y) : "memory");
#endif
}
__device__ __forceinline__ void arrive_in_block(uint32_t remote_bar) {  // releases this thread's writes before it
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
#endif
}
__device__ __forceinline__ void wait_counter(uint64_t* bar) {  // its first phase, acquiring the arrivals' writes
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_address(bar)) : "memory");
  } while (!done);
#endif
}

// A block's shared memory: the warps' staging while they stream, then their sums (dynamic: 68 KB with four
// token blocks). A clustered launch adds kRows x 64 floats past it, where the other block of the cluster puts its sums.
template <typename Multiplier, int kBlockWarps>
union DecodeShared {
  typename Multiplier::Staging staging[kBlockWarps];
  float sums[kBlockWarps][Multiplier::kRows][64];
};

// (kBlockWarps blocks resident per SM hold as many warps as kBlocksPerSm blocks of kWarps.)
template <typename Multiplier, int kGroupTiles, int kBlockWarps>
__global__ void __launch_bounds__(kBlockWarps * 32, Multiplier::kBlocksPerSm * kWarps / kBlockWarps)
    marlin_decode_kernel(const GemmArgs args, int splits, bool clustered) {
  using T = typename Multiplier::Element;
  extern __shared__ uint4 dynamic_shared[];
  using Shared = DecodeShared<Multiplier, kBlockWarps>;
  Shared& shared = *reinterpret_cast<Shared*>(dynamic_shared);
  float(&pushed)[Multiplier::kRows][64] = *reinterpret_cast<float(*)[Multiplier::kRows][64]>(&shared + 1);
  __shared__ bool last_block;
  __shared__ uint64_t pushed_count;  // (clustered) block 0 of the cluster: block 1's threads, once they have pushed
  allow_dependent_launch();
  const int column_tile = blockIdx.x, split = blockIdx.y, warp = threadIdx.x / 32, t = threadIdx.x;
  if (clustered) {  // block 1 may push only once block 0's counter is set up: cluster_wait below
    if (split == 0 && t == 0) init_barrier(&pushed_count, kBlockWarps * 32), fence_barrier_init();
    cluster_arrive_relaxed();
  }
  const int chunks = args.K / (kChunkTiles * 16);
  // warp w of split y takes the (y * kBlockWarps + w)-th of splits * kBlockWarps near-equal runs of chunks
  const int runs = splits * kBlockWarps, run = split * kBlockWarps + warp;
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
    for (int w = 0; w < kBlockWarps; ++w) {
      const float* sums = &shared.sums[w][i / 32][2 * (i % 32)];
      total.x += sums[0], total.y += sums[1];
    }
    return total;
  };
  if (splits == 1) {
    for (int i = t; i < pairs; i += kBlockWarps * 32) write(i, warp_sum(i));
    return;
  }
  if (clustered) {  // the two splits of this column tile are one cluster, block `split` its rank
    // Block 1 writes its sums straight into block 0's shared memory (`pushed`, outside the staging that block 0 may
    // still stream through), each thread releasing its writes on block 0's counter, and ends; block 0 adds them to
    // its own and writes the output. (Before: both blocks met at a cluster barrier, each read its share of the
    // other's sums, and met again so that neither ended while read: 2026-12-04-decode-timeline.md.)
    cluster_wait();
    if (split == 1) {
      for (int i = t; i < pairs; i += kBlockWarps * 32)
        store_to_block(address_in_block(&pushed[i / 32][2 * (i % 32)], 0), warp_sum(i));
      arrive_in_block(address_in_block(&pushed_count, 0));
      return;
    }
    wait_counter(&pushed_count);
    for (int i = t; i < pairs; i += kBlockWarps * 32) {
      float2 total = warp_sum(i);
      total.x += pushed[i / 32][2 * (i % 32)], total.y += pushed[i / 32][2 * (i % 32) + 1];
      write(i, total);
    }
    return;
  }
  float2* partial = reinterpret_cast<float2*>(args.partial);
  const size_t split_pairs = (size_t)args.M * row_pairs;
  for (int i = t; i < pairs; i += kBlockWarps * 32) partial[split * split_pairs + at(i)] = warp_sum(i);
  // One add with release and acquire semantics by one thread, after the block barrier (in place of a fence by
  // every thread before a relaxed add, and another after it): 1-3% faster on the layers of 4 and 8 splits
  // (7B-down M = 1 11.2 -> 10.8 us, 70B-qkv 18.5 -> 18.2).
  __syncthreads();
  if (t == 0) last_block = add_acq_rel(&args.locks[column_tile], 1) == splits - 1;
  __syncthreads();
  if (!last_block) return;
  for (int i = t; i < pairs; i += kBlockWarps * 32) {
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
// chunks a warp per token block, while each warp keeps 2 chunks or more; then, with one token block, twice as
// many if that spreads the blocks over the SMs better by a tenth or more. Measured on an H200 (bf16, g128,
// M = 1), the best or within 5% of the best split on each Llama-2 7B/70B layer
// (benchmarks/results/2026-11-30-marlin-gemv.md); the last step takes 70B-qkv from 2 splits (320 blocks: 2 or
// 3 an SM, 81%) to 4 (640: 4 or 5, 97%), 19.4 -> 18.5 us, where 7B-qkv (384 -> 768 blocks) and 7B-up
// (344 -> 688) spread no better and were 10-12% slower (benchmarks/results/2026-11-30-dependent-launch.md).
// More token blocks make a chunk more work and a split's partial sums bigger: fewer splits did better there
// (M = 16: 70B-down 2 splits 46.7 us against 49.5 at 4, 70B-qkv 21.8 against 22.2; M = 32: 7B-qkv 1 split
// 21.3 against 23.1 at 2; benchmarks/results/2026-12-01-decode-32-rows.md).
int decode_splits(const DeviceInfo& device, int M, int K, int N, int per_sm) {  // per_sm: blocks resident an SM
  const int column_tiles = N / 64, chunks = K / (kChunkTiles * 16), wave = per_sm * device.sms;
  const int token_blocks = M <= 8 ? 1 : M <= 16 ? 2 : 4;  // as dispatch_rows picks them
  int splits = 1;
  while ((10 * column_tiles * splits < 6 * wave || chunks > 16 * token_blocks * kWarps * splits) &&
         chunks >= 4 * kWarps * splits)
    splits *= 2;
  if (token_blocks == 1 && chunks >= 4 * kWarps * splits &&
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
bool decode_launch_dependent(const DeviceInfo& device, int per_sm, int blocks) {
  return device.dependent_launch && 10 * blocks >= 9 * per_sm * device.sms;
}

// Whether the k splits add up in a block cluster (sm_90 on) rather than through global memory and a lock: for
// 2 splits. Measured on an H200 (g128, interleaved; benchmarks/results/2026-12-01-decode-reduction.md): the
// lock path's last-block sum costs 1.0-3.2 us (13-19% on the 7B layers of 2 and 8 splits); clusters of 2 take
// 7B-qkv (2 splits) 6-15% faster (M = 1 11.8 -> 10.9 us, M = 16 17.2 -> 14.6); clusters of 4 and 8 were up to
// 27% slower where the grid is about one wave (70B-down M = 1 38.2 -> 45.5 us, 7B-down 11.1 -> 13.2), level on
// 70B-qkv (1.2 waves), presumably as fewer blocks fit at once when the blocks of a cluster must be placed together.
// Timed per block (%globaltimer, 2026-12-04-decode-timeline.md), the sum of a column tile's splits ended 1.5-1.6 us
// after its slower split had streamed its weights, on clusters (two cluster barriers, a read of the other block's
// sums between them) and on the lock path alike; the second block now pushes its sums into the first's shared
// memory and ends (one counter, no second barrier): M = 1 7B-qkv 10.1 -> 9.85 us, 4096 x 4096 6.18 -> 5.85.
// The same push for 4 and 8 splits was 16-30% slower where the driver cannot run all the grid's clusters at once
// (70B-qkv: 154 of 160 clusters of 4) and within +-5% elsewhere (2026-12-04-decode-clusters-prefetch.md).
bool decode_clustered(const DeviceInfo& device, int splits) {
  return device.major >= 9 && splits == 2;
}

// How a layer runs on this GPU: its k splits, whether the grid is a programmatic dependent of the kernel ahead,
// whether the splits add up in a cluster, and whether the warps stream through kShallowRing.
struct DecodePlan {
  int splits;
  bool dependent, clustered;
  int warps;  // a block's: kWarps, or 8
  bool shallow_ring;
};

// Wide blocks: with one token block on Hopper, a layer of 4 splits of 4-warp blocks that fit in one wave runs as
// 2 splits of 8-warp blocks, which add up in a cluster of 2 (the same warps on the same chunks, no lock path),
// when that puts no more warps on the busiest SM. Measured on an H200 (interleaved, M = 1..8, bf16 and fp16;
// benchmarks/results/2026-12-01-decode-wide-blocks.md): 70B-down and the 70B attention output (512 blocks -> 256,
// 16 warps on an SM either way) 3-5% and 0-4% less time, the 7B attention output (256 -> 128, 8 warps) 0-6%; Llama-3-8B
// qkv (384 blocks, at most 12 warps an SM -> 192 blocks, 16) 6-13% more, 70B-qkv (640 blocks, 1.2 waves) 11-15%
// more; 7B-down's 8 splits as 4 of 8 warps or 2 of 16 warps -6..+5%, so those keep 4-warp blocks.
DecodePlan plan_decode(const DeviceInfo& device, int M, int K, int N) {
  int per_sm = blocks_per_sm(M), splits = decode_splits(device, M, K, N, per_sm), warps = kWarps;
  bool shallow_ring = false;
  if (M <= 8) {  // one token block: the shallow ring where its fifth block an SM makes a grid of 1-1.25 waves one wave
    const int blocks = N / 64 * splits, shallow_per_sm = blocks_per_sm(M, kShallowRing);
    if (blocks > per_sm * device.sms && blocks <= shallow_per_sm * device.sms)
      per_sm = shallow_per_sm, shallow_ring = true;
  } else {  // two or four token blocks: the shallow ring where its grid fills 90% of a wave, or two waves
    const int shallow_per_sm = blocks_per_sm(M, kShallowRing);
    const int shallow_splits = decode_splits(device, M, K, N, shallow_per_sm);
    const int tenths_of_a_wave = M <= 16 ? 9 : 20;
    if (10 * (N / 64) * shallow_splits >= tenths_of_a_wave * shallow_per_sm * device.sms)
      per_sm = shallow_per_sm, splits = shallow_splits, shallow_ring = true;
  }
  const int blocks = N / 64 * splits, most_on_an_sm = (blocks + device.sms - 1) / device.sms;
  if (device.major >= 9 && M <= 8 && !shallow_ring && splits == 4 && blocks <= per_sm * device.sms &&
      2 * ((blocks / 2 + device.sms - 1) / device.sms) <= most_on_an_sm)
    splits = 2, warps = 8;  // (the same warps: `blocks` still counts them in blocks of kWarps)
  return {splits, decode_launch_dependent(device, per_sm, blocks), decode_clustered(device, splits), warps,
          shallow_ring};
}

template <typename Multiplier, int kGroupTiles, int kBlockWarps>
const char* launch_blocks(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  const auto kernel = marlin_decode_kernel<Multiplier, kGroupTiles, kBlockWarps>;
  constexpr int kSmem = sizeof(DecodeShared<Multiplier, kBlockWarps>);
  constexpr int kPushed = Multiplier::kRows * 64 * sizeof(float);  // (clustered) the other block's sums
  const int smem = kSmem + (plan.clustered ? kPushed : 0);
  cudaError_t err = cudaSuccess;
  if constexpr (kSmem + kPushed > 48 * 1024)  // past the default limit of dynamic shared memory: four token blocks
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem + kPushed);
  if (err == cudaSuccess)
    err = launch_dependent(kernel, dim3(args.N / 64, plan.splits), dim3(kBlockWarps * 32), smem, stream,
                           plan.dependent, plan.clustered ? plan.splits : 1, args, plan.splits, plan.clustered);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename Multiplier, int kGroupTiles>
const char* launch(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  // (wide blocks: one token block, deep ring)
  if constexpr (Multiplier::kRows == 8 && Multiplier::kRingTiles == kChunkTiles)
    if (plan.warps == 8) return launch_blocks<Multiplier, kGroupTiles, 8>(args, plan, stream);
  return launch_blocks<Multiplier, kGroupTiles, kWarps>(args, plan, stream);
}

template <typename T, int kTokenBlocks, int kRing, bool kHasZeros>
const char* dispatch_group(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  using Multiplier = TokensOnTensorCores<T, kHasZeros, kTokenBlocks, kRing>;
  switch (args.group_shift) {  // a group every 2, 4 or 8 tiles (one group over K: every chunk)
    case 5: return launch<Multiplier, 2>(args, plan, stream);
    case 6: return launch<Multiplier, 4>(args, plan, stream);
    default: return launch<Multiplier, 8>(args, plan, stream);
  }
}

template <typename T, int kTokenBlocks, int kRing = kChunkTiles>
const char* dispatch_zeros(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  return args.zeros ? dispatch_group<T, kTokenBlocks, kRing, true>(args, plan, stream)
                    : dispatch_group<T, kTokenBlocks, kRing, false>(args, plan, stream);
}

template <typename T, int kTokenBlocks>
const char* dispatch_ring(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  return plan.shallow_ring ? dispatch_zeros<T, kTokenBlocks, kShallowRing>(args, plan, stream)
                           : dispatch_zeros<T, kTokenBlocks>(args, plan, stream);
}

template <typename T>
const char* dispatch_rows(const GemmArgs& args, const DecodePlan& plan, cudaStream_t stream) {
  if (args.M <= 8) return dispatch_ring<T, 1>(args, plan, stream);
  return args.M <= 16 ? dispatch_ring<T, 2>(args, plan, stream) : dispatch_ring<T, 4>(args, plan, stream);
}

}  // namespace

// Up to 16 rows, and up to 32 on layers at least twice as wide as deep or as deep as wide: there four token
// blocks beat the tensor-core kernels. Measured on an H200 against wgmma (interleaved A/Bs): 7B-qkv and 7B-up at
// M = 24 and 32 12-19% less time, 70B-up 6-8% (benchmarks/results/2026-12-01-decode-32-rows.md); with the codes
// centered, 70B-down at M = 17..32 11-15% less, 7B-down 2-10% less, but 70B-qkv (N = 1.25 K) 9-14% more
// (2026-12-01-decode-centered.md). Near-square layers keep wgmma.
bool decode_serves(int M, int K, int N) {
  return K % (kChunkTiles * 16) == 0 && (M <= 16 || (M <= kMaxRows && (N >= 2 * K || K >= 2 * N)));
}

int64_t decode_partial_floats(const DeviceInfo& device, int M, int K, int N) {
  const DecodePlan plan = plan_decode(device, M, K, N);
  return plan.splits > 1 && !plan.clustered ? (int64_t)plan.splits * M * N : 0;
}

// `after_small_kernel`: the caller says that the kernel ahead leaves most of the GPU's block slots free (one of
// Inductor's small kernels or attention, in litquant's compiled decode), so the blocks of a grid of any size, let in
// early, spread as in a plain launch: every grid is then a dependent, not only those of `decode_launch_dependent`.
// Measured on an H200 (Llama-2-7B shapes, compiled, three balanced pairs of processes): 542.4 -> 550.6 tokens/s; the
// same layer called back to back, as in the kernel table, is 12-20% slower that way at M = 1 on 7B-qkv and 7B-up
// (benchmarks/results/2026-12-04-decode-dependent-all.md).
const char* decode_gemm(const GemmArgs& args, bool is_bf16, const DeviceInfo& device, bool after_small_kernel,
                        cudaStream_t stream) {
  DecodePlan plan = plan_decode(device, args.M, args.K, args.N);
  plan.dependent = plan.dependent || (after_small_kernel && device.dependent_launch);
  return is_bf16 ? dispatch_rows<__nv_bfloat16>(args, plan, stream) : dispatch_rows<half>(args, plan, stream);
}

}  // namespace litquant_marlin
