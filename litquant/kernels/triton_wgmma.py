"""The triton kernel's Hopper path for many rows (sm_90, Gluon): each field's weights are dequantized while the
wgmmas of the fields before it run.

`triton_programs.mma_kernel` cannot do that in Triton's tile language: its dot takes one set of registers as the
weight operand, and the next chunk's dequantization must wait until every wgmma that reads them is done (its
`WAIT_FOR_WGMMAS`). A warpgroup then alternates between dequantizing (ALU) and waiting for the tensor cores, and at
one block an SM (M = 256 on most Llama-2 layers) the tensor cores idle a third of the time. Gluon gives the
layouts and the waits to the kernel, so here the dequantization of each field runs while the wgmmas of the
IN_FLIGHT (4) fields before it do:

    chunk c:  wait for stage c's TMA; for each field j: dequantize it, issue its wgmma (async), and after every
              4th, wait until only the last 4 are in flight (freeing the registers of the ones before);
              after the first such wait chunk c - 1 is done: refill its stage with chunk c - 1 + STAGES.

Against one wait a chunk (chunk c's wgmmas issued, then a wait for chunk c - 1's: two register sets), this frees
19 registers and was 1-3 % faster on an H200 at M = 256 and 1024, settled, in one process
(benchmarks/results/2026-12-02-triton-wgmma-in-flight.md).

The layouts (one warpgroup = 4 warps per 64 weight columns, n below):
- acc [BLOCK_N, BLOCK_M] fp32 in the wgmma accumulator layout (`NVMMADistributedLayout` v3): out^T, as in the mma
  path, so the dequantized weights are the register operand A and x the shared-memory operand B.
- the words [BLOCK_N, 16] of a chunk are loaded from shared memory straight into the layout of a [BLOCK_N, 16] A
  operand (`DotOperandLayout`, k_width 2): a thread holds the words at the k positions whose weights it feeds to
  the wgmma, for every field. Field j of those words is the A operand of the chunk's j-th K = 16 step (rows
  16 j + w of the chunk, `repack`'s order), so the dequantization needs no data movement at all.
- x [BLOCK_M, ROWS] of a chunk comes by TMA in 128-byte swizzled shared memory; B of step j is its K-slice
  [16 j, 16 j + 16) transposed (a K-major descriptor).
- the words [BLOCK_N, 16] int32 come by TMA from qweight viewed as [chunks * N, 16].

Scheduling. A program takes one tile, or (split-K and stream-K) the launch has one program a resident block, which
takes whole tiles in rounds (tile pid, pid + programs, ...) and then its share of the chunks of the last, partial
round's tiles, numbered tile after tile: each of those tiles in `split` equal runs of K (`tail_split`), or all of
their chunks in equal shares over every program (stream-K: 70B-qkv at M = 256 has 80 tiles of 256 x 128 for 132
SMs). A program's runs follow each other without a pause: the stages' barriers count on over them, and the next
run's first chunks are fetched before this one's tile is written. A tile that runs in parts is summed by the run
that finishes it last, in a fixed order (`_finish_shared_tile`). One launch either way. On an H200, bf16, at M =
256: stream-K took 70B-qkv from 83.0 us (the best config of the former kernel, which split the tail in a second
launch) to 76.6, all configs timed in turn at one clock; the split tail in the same launch took 70B-qkv in 256 x
128 tiles split 3 from 96.2 to 75.3 us (the tuner's timings in the two tables' runs;
benchmarks/results/2026-12-02-wgmma-stream-k.md).

The output tile goes out through a stage's x buffer that no copy or wgmma is using (`_store_tile`), transposed,
for 16-byte stores of whole rows. Registers (ptxas, triton 3.6, no spills): 98 / 138 / 202 at 64 / 128 / 256 x 128
with one tile a program, 117 / 168 / 255 with the runs and the split sums.

Scope: sm_90, bits 2 and 4 (fields a power of two, codes that fit bf16's mantissa), groups of whole chunks (or
none), no act_order gather (x is permuted before; the launch does it). Other cases take `triton_programs.mma_kernel`.
"""
from functools import lru_cache
from typing import Optional, Tuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from litquant.kernels.triton_kernel import WORDS_PER_CHUNK
from litquant.kernels.triton_programs import BF16_PAIR_ASM, FP16_PAIR_ASM, PAIR_CONSTRAINTS, grouped_tile

WORDS = gl.constexpr(WORDS_PER_CHUNK)  # int32 words a column a chunk
MIN_SHARE = 8  # chunks, the least a stream-K program takes of the last round's tiles
# (renamed after triton 3.6, the GPU machine's; CI compiles with a later one)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_block_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret


@gluon.jit
def _field(words, j: gl.constexpr, BITS: gl.constexpr, s, minus_b, DOT_DTYPE: gl.constexpr):
    """Field j of the words as s * (q - z) in DOT_DTYPE, by the magic-number trick of `triton_programs._field_pairs`
    (two weights a 32-bit register; s and minus_b = -(MAGIC + z) broadcast to the words' shape)."""
    OFFSET: gl.constexpr = BITS * j
    FIRST: gl.constexpr = min(OFFSET // 8, 2)
    SELECTOR: gl.constexpr = ((5 + FIRST) << 12) | ((4 + FIRST) << 8) | ((FIRST + 1) << 4) | FIRST
    layout: gl.constexpr = words.type.layout
    selector = gl.full(words.shape, SELECTOR, gl.int32, layout)
    shift = gl.full(words.shape, OFFSET - 8 * FIRST, gl.int32, layout)
    mask = gl.full(words.shape, ((1 << BITS) - 1) * 0x10001, gl.int32, layout)
    operands = [words, selector, shift, mask, s, minus_b]
    if DOT_DTYPE == gl.bfloat16:
        return gl.inline_asm_elementwise(BF16_PAIR_ASM, PAIR_CONSTRAINTS, operands, dtype=s.dtype,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(FP16_PAIR_ASM, PAIR_CONSTRAINTS, operands, dtype=s.dtype,
                                         is_pure=True, pack=2)


@gluon.jit
def _fetch(x_desc, words_desc, x_smem, words_smem, ready, seq, i, first, count, m0, n0, N, ROWS: gl.constexpr,
           STAGES: gl.constexpr):
    """Start the TMA copies of the run's i-th chunk (chunk first + i, if i < count), the program's seq-th, into
    its stage."""
    stage = seq % STAGES
    exists = i < count
    mbarrier.expect(ready.index(stage), x_desc.block_type.nbytes + words_desc.block_type.nbytes, pred=exists)
    _tma_load(x_desc, [m0, (first + i) * ROWS], ready.index(stage), x_smem.index(stage), pred=exists)
    _tma_load(words_desc, [(first + i) * N + n0, 0], ready.index(stage), words_smem.index(stage), pred=exists)


@gluon.jit
def _group_params(scale_zero_ptr, i, first, count, offs_n, n_mask, N, ROWS: gl.constexpr, GROUP_SIZE: gl.constexpr):
    """The packed scale and zero point (`repack`) of the i-th chunk's group for columns offs_n (zeros past them)."""
    return gl.load(scale_zero_ptr + ((first + i) * ROWS // GROUP_SIZE) * N + offs_n, mask=n_mask & (i < count),
                   other=0)


@gluon.jit
def _chunk(acc, params, seq, i, first, count, x_desc, words_desc, x_smem, words_smem, ready, scale_zero_ptr, m0, n0,
           offs_n, n_mask, N, BITS: gl.constexpr, GROUP_SIZE: gl.constexpr, DOT_DTYPE: gl.constexpr,
           STAGES: gl.constexpr):
    """acc += W_c x_c^T for the run's i-th chunk c (the program's seq-th), its last IN_FLIGHT wgmmas left in flight;
    returns acc and the group parameters of the run's (i + 2)-th."""
    VALUES: gl.constexpr = 32 // BITS
    ROWS: gl.constexpr = VALUES * WORDS
    MAGIC: gl.constexpr = 128 if DOT_DTYPE == gl.bfloat16 else 1024
    IN_FLIGHT: gl.constexpr = 4  # fields whose wgmmas run while the next are dequantized
    gl.static_assert(VALUES % IN_FLIGHT == 0, "a chunk's fields come in whole runs of IN_FLIGHT")
    stage = seq % STAGES
    ahead = _group_params(scale_zero_ptr, i + 2, first, count, offs_n, n_mask, N, ROWS, GROUP_SIZE)
    mbarrier.wait(ready.index(stage), (seq // STAGES) & 1)
    words = words_smem.index(stage).load(params.type.layout.parent)
    s = gl.broadcast((params.to(gl.int16).to(gl.float16, bitcast=True).to(DOT_DTYPE))[:, None], words)[0]
    minus_b = gl.broadcast((-MAGIC - (params >> 16)).to(DOT_DTYPE)[:, None], words)[0]
    x = x_smem.index(stage)
    for j in gl.static_range(VALUES):
        weights = _field(words, j, BITS, s, minus_b, DOT_DTYPE)
        acc = warpgroup_mma(weights, x.slice(j * WORDS, WORDS, dim=1).permute((1, 0)), acc, is_async=True)
        if j % IN_FLIGHT == IN_FLIGHT - 1:
            # Only the last IN_FLIGHT fields' wgmmas may still run: the registers of the ones before are free.
            acc = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=[acc])
            if j == IN_FLIGHT - 1:  # the previous chunk is done: both warpgroups past it, refill its stage
                _block_barrier()
                _fetch(x_desc, words_desc, x_smem, words_smem, ready, seq - 1 + STAGES, i - 1 + STAGES, first, count,
                       m0, n0, N, ROWS, STAGES)
    return acc, ahead


@gluon.jit
def _start_run(x_desc, words_desc, x_smem, words_smem, ready, seq, first, count, m0, n0, N, ROWS: gl.constexpr,
               STAGES: gl.constexpr):
    """Fetch the first STAGES - 1 chunks of a run (the run's first `_chunk` fetches the next, into the stage that the
    chunk before the run held)."""
    for i in gl.static_range(STAGES - 1):
        _fetch(x_desc, words_desc, x_smem, words_smem, ready, seq + i, i, first, count, m0, n0, N, ROWS, STAGES)


@gluon.jit
def _run(seq, first, count, x_desc, words_desc, x_smem, words_smem, ready, scale_zero_ptr, m0, n0, N,
         BITS: gl.constexpr, GROUP_SIZE: gl.constexpr, DOT_DTYPE: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """W x^T [BLOCK_N, BLOCK_M] of the tile at (m0, n0) over the run's `count` chunks from chunk `first`, the
    program's seq-th on (`_start_run` has fetched the first ones); every wgmma done on return."""
    ROWS: gl.constexpr = (32 // BITS) * WORDS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    columns: gl.constexpr = gl.SliceLayout(1, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    offs_n = n0 + gl.arange(0, BLOCK_N, columns)
    n_mask = offs_n < N
    params_even = _group_params(scale_zero_ptr, 0, first, count, offs_n, n_mask, N, ROWS, GROUP_SIZE)
    params_odd = _group_params(scale_zero_ptr, 1, first, count, offs_n, n_mask, N, ROWS, GROUP_SIZE)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    # Two chunks a trip: each loads the group parameters of the chunk two ahead into its own registers.
    for i in range(0, count - 1, 2):
        acc, params_even = _chunk(acc, params_even, seq + i, i, first, count, x_desc, words_desc, x_smem, words_smem,
                                  ready, scale_zero_ptr, m0, n0, offs_n, n_mask, N, BITS, GROUP_SIZE, DOT_DTYPE,
                                  STAGES)
        acc, params_odd = _chunk(acc, params_odd, seq + i + 1, i + 1, first, count, x_desc, words_desc, x_smem,
                                 words_smem, ready, scale_zero_ptr, m0, n0, offs_n, n_mask, N, BITS, GROUP_SIZE,
                                 DOT_DTYPE, STAGES)
    if count % 2:
        acc, params_even = _chunk(acc, params_even, seq + count - 1, count - 1, first, count, x_desc, words_desc,
                                  x_smem, words_smem, ready, scale_zero_ptr, m0, n0, offs_n, n_mask, N, BITS,
                                  GROUP_SIZE, DOT_DTYPE, STAGES)
    return warpgroup_mma_wait(num_outstanding=0, deps=[acc])


@gluon.jit
def _run_at(seq, rounds, start, total, chunks, programs):
    """The tile, first chunk and length of the program's run that begins at its seq-th chunk (length 0 past its
    last): whole tiles (rounds of `programs`), then its share of the last round's chunks from `start` on."""
    whole = rounds * chunks
    at = gl.where(seq < whole, (seq // chunks * programs + gl.program_id(0)) * chunks,
                  rounds * programs * chunks + start + seq - whole)
    first = at % chunks
    return at // chunks, first, gl.minimum(chunks - first, total - seq)


@gluon.jit
def _share_start(sharer, share, longer):
    """The first of the shared chunks that `sharer` takes: each takes `share`, the first `longer` one more (sums
    that cannot overflow, unlike sharer * chunks // sharers at 7,000 tiles of 64 chunks)."""
    return sharer * share + gl.minimum(sharer, longer)


@gluon.jit
def _sharer_of(chunk, share, longer):
    """The sharer that takes the given shared chunk."""
    longer_ones = longer * (share + 1)  # the chunks of the first `longer` sharers
    return gl.where(chunk < longer_ones, chunk // (share + 1), longer + (chunk - longer_ones) // share)


@gluon.jit
def _wgmma_kernel(x_desc, words_desc, scale_zero_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr, M, N, K,
                  stride_om, rounds, sharers, share, longer, GROUP_SIZE: gl.constexpr, BITS: gl.constexpr,
                  HAS_BIAS: gl.constexpr, DOT_DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, SHARED_OUT: gl.constexpr):
    """out[M, N] = x @ W^T (+ bias) in [BLOCK_M, BLOCK_N] tiles (see the module docstring): one tile a program, or
    with SHARED_OUT the whole tiles pid, pid + programs, ... of `rounds` rounds, then the program's share of the
    chunks of the tiles left, numbered tile after tile (`share` each, one more for the first `longer`; none past
    the first `sharers`). A tile that runs in parts is summed by `_finish_shared_tile`."""
    ROWS: gl.constexpr = (32 // BITS) * WORDS
    gl.static_assert(ROWS >= BLOCK_N, "a stage's x buffer holds the output tile (`_store_tile`)")
    chunks = gl.cdiv(K, ROWS)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, ROWS], x_desc.layout)
    words_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], words_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
    fence_async_shared()

    if SHARED_OUT:
        # The program's runs: seq counts its chunks, and the stages' barriers count on over the runs (its seq-th
        # chunk has stage seq % STAGES).
        programs = gl.num_programs(0)
        sharer = gl.minimum(gl.program_id(0), sharers)
        start = _share_start(sharer, share, longer)
        total = rounds * chunks + _share_start(gl.minimum(sharer + 1, sharers), share, longer) - start
        seq = gl.program_id(0) * 0
        tile, first, count = _run_at(seq, rounds, start, total, chunks, programs)
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _start_run(x_desc, words_desc, x_smem, words_smem, ready, seq, first, count, pid_m * BLOCK_M,
                   pid_n * BLOCK_N, N, ROWS, STAGES)
        while seq < total:
            acc = _run(seq, first, count, x_desc, words_desc, x_smem, words_smem, ready, scale_zero_ptr,
                       pid_m * BLOCK_M, pid_n * BLOCK_N, N, BITS, GROUP_SIZE, DOT_DTYPE, BLOCK_M, BLOCK_N, STAGES)
            _block_barrier()  # both warpgroups are done with the stages: the next run's first chunks go in now
            next_tile, next_first, next_count = _run_at(seq + count, rounds, start, total, chunks, programs)
            next_m, next_n = grouped_tile(next_tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _start_run(x_desc, words_desc, x_smem, words_smem, ready, seq + count, next_first, next_count,
                       next_m * BLOCK_M, next_n * BLOCK_N, N, ROWS, STAGES)
            # The run's last stage is the one that the next run's first fetches leave free.
            free = x_smem.index((seq + count - 1) % STAGES)
            if count == chunks:
                _store_tile(acc, free, bias_ptr, out_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_om,
                            HAS_BIAS)
            else:
                _finish_shared_tile(acc, free, tile - rounds * programs, first, seq > rounds * chunks, chunks, share,
                                    longer, partials_ptr, locks_ptr, bias_ptr, out_ptr, pid_m * BLOCK_M,
                                    pid_n * BLOCK_N, M, N, stride_om, HAS_BIAS)
            seq += count
            tile, first, count, pid_m, pid_n = next_tile, next_first, next_count, next_m, next_n
    else:
        pid_m, pid_n = grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _start_run(x_desc, words_desc, x_smem, words_smem, ready, 0, 0, chunks, pid_m * BLOCK_M, pid_n * BLOCK_N, N,
                   ROWS, STAGES)
        acc = _run(0, 0, chunks, x_desc, words_desc, x_smem, words_smem, ready, scale_zero_ptr, pid_m * BLOCK_M,
                   pid_n * BLOCK_N, N, BITS, GROUP_SIZE, DOT_DTYPE, BLOCK_M, BLOCK_N, STAGES)
        _block_barrier()  # both warpgroups are done with the stages
        _store_tile(acc, x_smem.index(0), bias_ptr, out_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_om,
                    HAS_BIAS)
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(stage))


@gluon.jit
def _finish_shared_tile(acc, stage_smem, shared_tile, first, second_run, chunks, share, longer, partials_ptr,
                        locks_ptr, bias_ptr, out_ptr, m0, n0, M, N, stride_om, HAS_BIAS: gl.constexpr):
    """Add this run's sums of a tile that runs in parts (the shared_tile-th of the last round) to the others', or
    leave them for the run that ends last.

    The tile's runs belong to sharers lo..hi: lo's last run holds the tile's first chunk, hi's first its last (a
    middle sharer's only run lies inside it). Each run but lo's stores its fp32 sums in its sharer's slot (two a
    sharer: its first run's and its last's), then counts itself on the tile's lock; lo runs the tile last of
    its run, so it usually finds the others done, adds their slots to its registers and writes the tile. Otherwise
    it stores and counts too, and whichever run counts last adds every slot. Either way the sum runs over the
    sharers in order, so the result does not depend on who came last; the lock is left zeroed. No run waits on
    another (the tile's runs need not be resident at once)."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    # Slots hold each thread's accumulators in place (an element's slot offset is its place in the [BLOCK_N, BLOCK_M]
    # tile): nothing to convert, and a warp's store covers 8 rows of 32 whole bytes.
    slot = (gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))[:, None] * BLOCK_M
            + gl.arange(0, BLOCK_M, gl.SliceLayout(0, layout))[None, :])
    TILE: gl.constexpr = BLOCK_N * BLOCK_M
    at = shared_tile * chunks  # the tile's first chunk among the shared ones
    lo = _sharer_of(at, share, longer)
    hi = _sharer_of(at + chunks - 1, share, longer)
    lock = locks_ptr + shared_tile
    if (first == 0) & (gl.atomic_add(lock, 0, sem="acquire", scope="gpu") == hi - lo):
        for sharer in range(lo + 1, hi + 1):
            acc += gl.load(partials_ptr + 2 * sharer * TILE + slot, cache_modifier=".cg")
        _store_tile(acc, stage_smem, bias_ptr, out_ptr, m0, n0, M, N, stride_om, HAS_BIAS)
        gl.atomic_xchg(lock, 0)
    else:
        gl.store(partials_ptr + (2 * gl.program_id(0) + second_run.to(gl.int32)) * TILE + slot, acc)
        _block_barrier()
        if gl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == hi - lo:
            lo_slot = 2 * lo + (_share_start(lo, share, longer) < at).to(gl.int32)  # lo's last run, or its only
            total = gl.load(partials_ptr + lo_slot * TILE + slot, cache_modifier=".cg")
            for sharer in range(lo + 1, hi + 1):
                total += gl.load(partials_ptr + 2 * sharer * TILE + slot, cache_modifier=".cg")
            _store_tile(total, stage_smem, bias_ptr, out_ptr, m0, n0, M, N, stride_om, HAS_BIAS)
            gl.atomic_xchg(lock, 0)


@gluon.jit
def _store_tile(acc, stage_smem, bias_ptr, out_ptr, m0, n0, M, N, stride_om, HAS_BIAS: gl.constexpr):
    """out[m0:, n0:] = acc^T (+ bias) in out's dtype (out is [M, N] row-major), through `stage_smem`, a stage's
    x buffer that no copy or wgmma uses now: acc goes in transposed (stmatrix), n contiguous in 128-byte swizzled
    rows, and comes out 8 columns a thread, a warp's load two whole rows, for 16-byte stores. (Triton's own
    conversion takes scratch memory beside the stages, 32 KB more than an SM has at 256 x 128 once a program's
    next run has started. A layout that keeps each warp's elements needs 4 KB, but a warp's store then covers 16
    rows of 32 bytes: 7B-qkv at M = 1024 in 128 x 128 tiles took 188 us against 180 with the block-wide
    conversion, and 193 against 190 this way.)"""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    if HAS_BIAS:
        rows = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc.type.layout))
        acc += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    tile = _reinterpret(stage_smem, dtype, [BLOCK_M, BLOCK_N],
                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    tile.permute((1, 0)).store(acc.to(dtype))
    _block_barrier()
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                            warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
    total = tile.load(layout)
    rows_m = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
    rows_n = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
    mask = (rows_m < M)[:, None] & (rows_n < N)[None, :]
    gl.store(out_ptr + rows_m[:, None] * stride_om + rows_n[None, :], total, mask=mask)
    fence_async_shared()  # (a TMA copy may refill the stage next)


def stages_and_blocks(bits: int, x_bytes: int, block_m: int, block_n: int, stages: int,
                      device: torch.device) -> Tuple[int, int]:
    """The pipeline stages that fit a block's shared memory, up to `stages` (2-bit chunks are 256 rows: 3 at
    128 x 128), and the blocks an SM then holds."""
    stage_bytes = block_m * (32 // bits) * WORDS_PER_CHUNK * x_bytes + block_n * WORDS_PER_CHUNK * 4
    per_block, per_sm = _shared_memory(torch.cuda.current_device() if device.index is None else device.index)
    stages = max(2, min(stages, (per_block - 1024) // stage_bytes))
    return stages, max(1, per_sm // (stages * stage_bytes + 1024))


@lru_cache(maxsize=None)
def _shared_memory(index: int) -> Tuple[int, int]:
    """The shared memory a block may take (opt-in) and an SM holds on GPU `index` (asked of the driver once: every
    launch needs it)."""
    per_block = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return per_block, torch.cuda.get_device_properties(index).shared_memory_per_multiprocessor


def tail_split(tiles: int, slots: int, sms: int) -> int:
    """How many runs of K (1-4) the tiles of the last, partial round of `tiles` over `slots` resident blocks are
    best split in: the fewest whole-tile times for that round, the smaller split on ties (at most `sms` tiles split,
    one split-K counter each). E.g. 70B-qkv at M = 256 in 128 x 128 tiles: 160 = 132 + 28 tiles, the 28 split 4
    ways run in a quarter of a round."""
    tail = tiles % slots
    if tail == 0 or tail > sms:
        return 1
    return min(range(1, 5), key=lambda s: (-(-tail * s // slots) / s, s))


def launch(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, bias: Optional[torch.Tensor],
           out: torch.Tensor, locks: torch.Tensor, split: int, stream_k: bool, bits: int, group_size: int,
           block_m: int, block_n: int, num_warps: int, stages: int) -> None:
    """Write x @ W^T (+ bias) into out [M, N] (contiguous); x [M, K] is in the weight's sorted row order, its rows
    16-byte aligned (see `triton_kernel._wgmma_supports`). One program a tile; or, with split > 1 or `stream_k`, one
    a resident block: whole tiles in rounds, then the last round's chunks shared out (zeroed `locks`, one a tile of
    that round), each of its tiles in `split` runs of K, or all of its chunks over all programs (stream-K)."""
    m, k = x.shape
    chunks, n, _ = qweight.shape
    rows = (32 // bits) * WORDS_PER_CHUNK
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, rows], dtype)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, rows], x_layout)
    words_layout = gl.NVMMASharedLayout.get_default_for([block_n, WORDS_PER_CHUNK], gl.int32)
    words_desc = TensorDescriptor.from_tensor(qweight.view(chunks * n, WORDS_PER_CHUNK), [block_n, WORDS_PER_CHUNK],
                                              words_layout)
    stages, blocks = stages_and_blocks(bits, x.element_size(), block_m, block_n, stages, x.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    shared_out = stream_k or split > 1
    programs, rounds, sharers, share, longer, partials = tiles, 0, 0, 0, 0, out  # (partials: read if shared out)
    if shared_out:  # (programs past the sharers of a small product have nothing to do and end at once)
        programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count * blocks, locks.numel())
        rounds = triton.cdiv(tiles, programs) - 1
        tail = tiles - rounds * programs
        # Stream-K: shares of at least MIN_SHARE chunks (a tile's parts cost a store and a load of its sums each).
        sharers = min(programs, max(1, tail * chunks // MIN_SHARE) if stream_k else tail * split)
        share, longer = divmod(tail * chunks, sharers)
        partials = torch.empty(2 * sharers * block_m * block_n, dtype=torch.float32, device=x.device)
    _wgmma_kernel[(programs,)](
        x_desc, words_desc, scale_zero, bias, out, partials, locks, m, n, k, out.stride(0), rounds, sharers, share,
        longer, GROUP_SIZE=1 << 30 if group_size == -1 else group_size, BITS=bits, HAS_BIAS=bias is not None,
        DOT_DTYPE=dtype, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8, STAGES=stages, SHARED_OUT=shared_out,
        num_warps=num_warps)
