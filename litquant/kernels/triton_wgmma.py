"""The triton kernel's Hopper path for many rows (sm_90, Gluon): each field's weights are dequantized while the
wgmmas of the fields before it run.

`triton_kernel._mma_kernel` cannot do that in Triton's tile language: its dot takes one set of registers as the
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

Scope: sm_90, bits 2 and 4 (fields a power of two, codes that fit bf16's mantissa), groups of whole chunks (or
none), no act_order gather (x is permuted before; the launch does it). Other cases take `_mma_kernel`. Split-K
(only the tiles of the last, partial wave, in a second launch: `tail_split`) sums as `_mma_kernel` does. The output
tile goes through a layout with n contiguous per thread for coalesced stores. Registers (ptxas, triton 3.6, 128 x
128): 140 for the final tile, 170 where the split epilogue holds the fp32 tile, a loaded partial and their addresses
at once (256 x 128: 201, and 255 with 16 bytes of spills there).
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

from litquant.kernels.triton_kernel import (WORDS_PER_CHUNK, _BF16_PAIR_ASM, _FP16_PAIR_ASM, _PAIR_CONSTRAINTS,
                                           _grouped_tile)

WORDS = gl.constexpr(WORDS_PER_CHUNK)  # int32 words a column a chunk
# (renamed after triton 3.6, the GPU machine's; CI compiles with a later one)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_block_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _field(words, j: gl.constexpr, BITS: gl.constexpr, s, minus_b, DOT_DTYPE: gl.constexpr):
    """Field j of the words as s * (q - z) in DOT_DTYPE, by the magic-number trick of `triton_kernel._field_pairs`
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
        return gl.inline_asm_elementwise(_BF16_PAIR_ASM, _PAIR_CONSTRAINTS, operands, dtype=s.dtype,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(_FP16_PAIR_ASM, _PAIR_CONSTRAINTS, operands, dtype=s.dtype,
                                         is_pure=True, pack=2)


@gluon.jit
def _fetch(x_desc, words_desc, x_smem, words_smem, ready, i, first, count, m0, n0, N, ROWS: gl.constexpr,
           STAGES: gl.constexpr):
    """Start the TMA copies of this program's i-th chunk (chunk first + i, if i < count) into its stage."""
    stage = i % STAGES
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
def _chunk(acc, params, i, first, count, x_desc, words_desc, x_smem, words_smem, ready, scale_zero_ptr, m0, n0,
           offs_n, n_mask, N, BITS: gl.constexpr, GROUP_SIZE: gl.constexpr, DOT_DTYPE: gl.constexpr,
           STAGES: gl.constexpr):
    """acc += W_c x_c^T for the program's i-th chunk c, its last IN_FLIGHT wgmmas left in flight; returns acc and
    the group parameters of its (i + 2)-th."""
    VALUES: gl.constexpr = 32 // BITS
    ROWS: gl.constexpr = VALUES * WORDS
    MAGIC: gl.constexpr = 128 if DOT_DTYPE == gl.bfloat16 else 1024
    IN_FLIGHT: gl.constexpr = 4  # fields whose wgmmas run while the next are dequantized
    gl.static_assert(VALUES % IN_FLIGHT == 0, "a chunk's fields come in whole runs of IN_FLIGHT")
    stage = i % STAGES
    ahead = _group_params(scale_zero_ptr, i + 2, first, count, offs_n, n_mask, N, ROWS, GROUP_SIZE)
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
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
                _fetch(x_desc, words_desc, x_smem, words_smem, ready, i - 1 + STAGES, first, count, m0, n0, N, ROWS,
                       STAGES)
    return acc, ahead


@gluon.jit
def _wgmma_kernel(x_desc, words_desc, scale_zero_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr, M, N, K,
                  stride_om, stride_split, first_tile, GROUP_SIZE: gl.constexpr, BITS: gl.constexpr,
                  HAS_BIAS: gl.constexpr, FINAL: gl.constexpr, DOT_DTYPE: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """out[M, N] = x @ W^T (+ bias) for the [BLOCK_M, BLOCK_N] tile first_tile + program_id(0) and the
    program_id(1)-th of num_programs(1) runs of K's chunks (see the module docstring; split-K as in
    `triton_kernel._write_result`, with a counter for each of this launch's tiles)."""
    ROWS: gl.constexpr = (32 // BITS) * WORDS
    WARPS: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    columns: gl.constexpr = gl.SliceLayout(1, operand)

    pid = first_tile + gl.program_id(0)
    pid_m, pid_n = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, ROWS], x_desc.layout)
    words_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], words_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
    fence_async_shared()
    chunks = gl.cdiv(K, ROWS)
    first = gl.program_id(1) * chunks // gl.num_programs(1)
    count = (gl.program_id(1) + 1) * chunks // gl.num_programs(1) - first
    for i in gl.static_range(STAGES - 1):  # chunk STAGES - 1 comes in chunk 0's `_chunk`, into the free stage
        _fetch(x_desc, words_desc, x_smem, words_smem, ready, i, first, count, m0, n0, N, ROWS, STAGES)

    offs_n = n0 + gl.arange(0, BLOCK_N, columns)
    n_mask = offs_n < N
    params_even = _group_params(scale_zero_ptr, 0, first, count, offs_n, n_mask, N, ROWS, GROUP_SIZE)
    params_odd = _group_params(scale_zero_ptr, 1, first, count, offs_n, n_mask, N, ROWS, GROUP_SIZE)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    # Two chunks a trip: each loads the group parameters of the chunk two ahead into its own registers.
    for i in range(0, count - 1, 2):
        acc, params_even = _chunk(acc, params_even, i, first, count, x_desc, words_desc, x_smem, words_smem,
                                  ready, scale_zero_ptr, m0, n0, offs_n, n_mask, N, BITS, GROUP_SIZE, DOT_DTYPE,
                                  STAGES)
        acc, params_odd = _chunk(acc, params_odd, i + 1, first, count, x_desc, words_desc, x_smem, words_smem,
                                 ready, scale_zero_ptr, m0, n0, offs_n, n_mask, N, BITS, GROUP_SIZE, DOT_DTYPE,
                                 STAGES)
    if count % 2:
        acc, params_even = _chunk(acc, params_even, count - 1, first, count, x_desc, words_desc, x_smem, words_smem,
                                  ready, scale_zero_ptr, m0, n0, offs_n, n_mask, N, BITS, GROUP_SIZE, DOT_DTYPE,
                                  STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(stage))

    # n contiguous in each thread: out is [M, N] row-major.
    store_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2],
                                                  warps_per_cta=[1, WARPS], order=[0, 1])
    total = gl.convert_layout(acc, store_layout)
    rows_n = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, store_layout))
    rows_m = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(0, store_layout))
    mask = (rows_n < N)[:, None] & (rows_m < M)[None, :]
    offsets = rows_m[None, :] * stride_om + rows_n[:, None]
    if FINAL:
        _store_tile(total, bias_ptr, out_ptr, offsets, rows_n, N, mask, HAS_BIAS)
    else:  # this split's partial sum; the last split of the tile to arrive adds them up in order
        gl.store(partials_ptr + gl.program_id(1) * stride_split + offsets, total, mask=mask)
        _block_barrier()
        lock = locks_ptr + gl.program_id(0)
        if gl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == gl.num_programs(1) - 1:
            total = gl.load(partials_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            for split in range(1, gl.num_programs(1)):
                total += gl.load(partials_ptr + split * stride_split + offsets, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _store_tile(total, bias_ptr, out_ptr, offsets, rows_n, N, mask, HAS_BIAS)
            gl.atomic_xchg(lock, 0)


@gluon.jit
def _store_tile(total, bias_ptr, out_ptr, offsets, rows_n, N, mask, HAS_BIAS: gl.constexpr):
    """out[offsets] = total (+ bias[rows_n]) in out's dtype."""
    if HAS_BIAS:
        total += gl.load(bias_ptr + rows_n, mask=rows_n < N, other=0.0).to(gl.float32)[:, None]
    gl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


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
    """How many runs of K (1-4) the tiles of the last, partial wave of `tiles` over `slots` resident blocks are best
    split in: the fewest whole-tile times for that wave, the smaller split on ties (at most `sms` tiles split, one
    split-K counter each). E.g. 70B-qkv at M = 256 in 128 x 128 tiles: 160 = 132 + 28 tiles, the 28 split 4 ways
    run in a quarter of a wave."""
    tail = tiles % slots
    if tail == 0 or tail > sms:
        return 1
    return min(range(1, 5), key=lambda s: (-(-tail * s // slots) / s, s))


def launch(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, bias: Optional[torch.Tensor],
           out: torch.Tensor, partials: torch.Tensor, locks: torch.Tensor, split: int, bits: int, group_size: int,
           block_m: int, block_n: int, num_warps: int, stages: int) -> None:
    """Write x @ W^T (+ bias) into out [M, N] (contiguous); x [M, K] is in the weight's sorted row order, its rows
    16-byte aligned (see `triton_kernel._wgmma_supports`). The tiles of whole waves run unsplit, those of the last,
    partial wave in `split` runs of K's chunks (fp32 `partials` [split, M, N] and zeroed `locks`, one a tile of that
    wave, when split > 1): two launches."""
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
    slots = torch.cuda.get_device_properties(x.device).multi_processor_count * blocks
    whole = tiles - tiles % slots if split > 1 else tiles  # tiles that run unsplit, in whole waves
    if tiles - whole > locks.numel():
        raise ValueError(f"the wgmma path split {tiles - whole} tiles over K with only {locks.numel()} split-K "
                         f"counters (see triton_kernel.lock_count)")
    for first_tile, count, runs in ((0, whole, 1), (whole, tiles - whole, split)):
        if count:
            _wgmma_kernel[(count, runs)](
                x_desc, words_desc, scale_zero, bias, out, partials, locks, m, n, k, out.stride(0), m * n, first_tile,
                GROUP_SIZE=1 << 30 if group_size == -1 else group_size, BITS=bits, HAS_BIAS=bias is not None,
                FINAL=runs == 1, DOT_DTYPE=dtype, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8, STAGES=stages,
                num_warps=num_warps)
