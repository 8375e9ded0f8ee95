"""The `triton` kernel: a fused dequantize-matmul for 2/3/4/8-bit GPTQ (with or without act_order) and AWQ weights.

Layout (built once at load by `repack`, with vectorized torch on the target device)
    K is cut into chunks of ROWS = 16 * V input rows, V = 32 // bits codes per int32 word (ROWS = 128 at 4 bits;
    at 3 bits ten codes fill 30 bits of a word, so a weight takes 3.2 bits here against 3 on disk, where AutoGPTQ
    packs 32 codes into 3 words and two of them straddle word boundaries, out of reach of one shift and mask).
    `qweight[c, n, w]` (int32 [C, N, 16]) is word w of chunk c of output column n; its field j (bits
    [bits*j, bits*(j+1))) is the code of input row k = c*ROWS + 16*j + w. Hence:
    - one chunk of a [BLOCK_N] column block is one contiguous block of BLOCK_N * 64 bytes (coalesced loads);
    - field j of a [BLOCK_N, 16] word tile is the weight of 16 *consecutive* input rows: it multiplies 16
      consecutive activations, by broadcast FMAs or by a tl.dot with K = 16, with no shuffle of unpacked values;
    - a 16-row run lies inside one quantization group when 16 divides the group size, and when ROWS divides it
      too, so does the whole chunk (`GROUP_PER_CHUNK`: scales are then loaded once per chunk).
    act_order (GPTQ desc_act): rows are sorted by group (`perm`), which makes the groups contiguous again; the
    kernels read activation column perm[k] for sorted row k (for large M, x is permuted once instead).
    `scale_zero` (int32 [G, N]) holds each group's fp16 scale in its low 16 bits and its zero point z (an integer;
    2**(bits-1) for symmetric weights) in the high 16: one 4-byte load, which Triton's pipeliner copies ahead with
    cp.async (a 2-byte one it loads in the loop, and the mma path waited on it every chunk).

Dequantization without int-to-float conversions
    A field q shifted under the exponent of 1.0 (one shift, one AND/OR) is the fp32 value f = 1 + q / 2**bits,
    exactly: the "magic number" conversion that FasterTransformer and Marlin use in fp16, here in fp32 so every
    bit width fits. Then f + zeros = (q - z) / 2**bits exactly, with zeros = -(1 + z / 2**bits), and the weight is
    2**bits * s * (f + zeros). The mma path dequantizes in 16 bits instead (`_field_pairs`).

Paths, picked per (device, dtype, N, K, M bucket) by timing the candidates once (`choose_config`)
    gemv     BLOCK_M activation rows per program, [BLOCK_N, 16] word tiles, fp32 FMAs on the CUDA cores, split-K over
             chunks for occupancy, chunks streamed through a cp.async pipeline: decode (M = 1..4), memory bound.
             Fields are read as denormal floats (`_field_product`): one AND and one FMA per weight.
    mma      tensor cores: out^T = W @ x^T for a [BLOCK_N, BLOCK_M] tile, the weights being the register operand,
             dequantized in 16 bits where they lie (`_field_pairs`): from sm_90 one dot a chunk, its fields set
             side by side in registers (`_fields_side_by_side`), on sm_80 one K = 16 dot a field; split-K when
             the tiles alone do not fill the GPU, grouped tile order for L2 reuse at large M.
    wgmma    sm_90, M > 64, 2/4-bit codes in groups of whole chunks: the same product in Gluon
             (`triton_wgmma`), which dequantizes each field while the wgmmas of the 4 before it run (the tile
             language waits for a dot's wgmmas before the next dequantization; see there); the tiles of a last,
             partial round of the SMs split over K or shared out stream-K, in the same launch.
    dequant  `_dequant_kernel` writes the whole weight in the activation dtype (one [BLOCK_N, ROWS] tile per
             chunk), then cuBLAS: for large, compute-bound M.
    Split-K partial sums go to an fp32 buffer [SPLIT_K, M, N]; the last program of each output tile to finish
    adds them up in split order (deterministic), adds the bias and casts (`_write_result`): one launch per matmul.
    Measured slower on an H200 and not kept (benchmarks/results/2026-11-30-triton-*.log): in gemv, prefetching
    the next chunk into registers with a shift-free decode (AND/OR, then FADD), and (before the denormal decode)
    fields masked into two mantissa windows under the exponent of 1.0; in mma, one K = ROWS dot per chunk
    on a [BLOCK_N, VALUES, 16] -> [BLOCK_N, ROWS] reshaped tile, also with x pre-permuted to the unpacked order
    (0.23-0.40x cuBLAS at M = 64..4096, either operand order), and again with the fields interleaved
    (tl.interleave) against x permuted to match: x then streams through cp.async and the wgmmas overlap, but
    the tile's layout goes through shared memory each chunk, and it was slower than this path at every M
    (2026-12-01-triton-mma-one-dot.log); and with the words read as bytes, one K = 64 dot per nibble plane against
    x permuted to match (the bytes load from shared memory straight into the dot operand's layout), the best
    config was 0.33-0.55x cuBLAS at M = 256 and 0.56-0.69x at M = 4096 (2026-12-01-triton-byte-planes.log). The
    dequant path is already at ~87% of its bandwidth bound (it must write 2 bytes per weight), so dequant +
    cuBLAS cannot pass ~0.5x of cuBLAS at M = 256: large M needs the fused path, one dot a chunk
    (`_mma_kernel`).
"""
import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from litquant.formats import QuantizedWeight
from litquant.formats.common import default_g_idx
from litquant.kernels.base import QuantLinear, dependent_launches_allowed
from litquant.kernels.ops import quant_linear_op

# Triton decides at import (when `triton.jit` runs) whether kernels are compiled or interpreted on the CPU.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
log = logging.getLogger("litquant.kernels.triton")
SUPPORTED_BITS = (2, 3, 4, 8)
WORDS_PER_CHUNK = 16
NO_GROUP = 1 << 30  # the group size the kernels see for group_size -1: every row is in group 0
PERMUTE_X_ABOVE_M = 64  # act_order: above this many rows, permute x once rather than gather it in every tile


def chunk_rows(bits: int) -> int:
    """Input rows per chunk of the packed layout (128 at 4 bits, 160 at 3)."""
    return WORDS_PER_CHUNK * (32 // bits)


@dataclass
class PackedWeight:
    """A `QuantizedWeight` in this kernel's layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 [C, N, 16]
    scale_zero: torch.Tensor  # int32 [G, N]: fp16 scale bits | zero point << 16
    perm: Optional[torch.Tensor]  # int32 [K]: sorted row k is input channel perm[k]; None without act_order
    locks: torch.Tensor  # int32 split-K arrival counters (`new_locks`): zero between calls
    bits: int
    group_size: int


def repack(qw: QuantizedWeight) -> PackedWeight:
    """Repack `qw` (on any device) into the layout of the kernels, with vectorized torch on that device."""
    bits, group_size = qw.bits, qw.group_size
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the triton kernel supports {'/'.join(map(str, SUPPORTED_BITS))}-bit weights, not {bits}-bit")
    if group_size != -1 and (group_size <= 0 or group_size % WORDS_PER_CHUNK):
        raise ValueError(f"the triton kernel needs group_size -1 or a multiple of {WORDS_PER_CHUNK}, got {group_size}")
    k, n = qw.in_features, qw.out_features
    codes, perm = qw.codes, None
    if qw.act_order:
        perm = torch.argsort(qw.g_idx, stable=True)
        if not torch.equal(qw.g_idx[perm], default_g_idx(k, group_size, qw.g_idx.device)):
            raise ValueError("g_idx is not a GPTQ act_order assignment (after sorting the rows by group, group i must "
                             f"hold exactly rows [i*{group_size}, (i+1)*{group_size})); the triton kernel cannot "
                             "serve it, the torch kernel can")
        codes = codes[perm]
        perm = perm.to(torch.int32)
    values, rows = 32 // bits, chunk_rows(bits)
    chunks = -(-k // rows)
    padded = torch.zeros(chunks * rows, n, dtype=torch.uint8, device=codes.device)
    padded[:k] = codes
    fields = padded.view(chunks, values, WORDS_PER_CHUNK, n)  # [c, j, w, n] holds row c*rows + 16*j + w
    words = torch.zeros(chunks, WORDS_PER_CHUNK, n, dtype=torch.int64, device=codes.device)
    for j in range(values):  # one vectorized pass per field
        words |= fields[:, j].to(torch.int64) << (bits * j)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # reinterpret as signed int32
    scale_bits = qw.scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    scale_zero = (scale_bits | qw.zeros.to(torch.int32) << 16).contiguous()
    return PackedWeight(words.transpose(1, 2).contiguous(), scale_zero, perm, new_locks(n, codes.device), bits,
                        group_size)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _group_params(scale_zero_ptr, first_row, group_size: tl.constexpr, offs_n, n_mask, N, K):
    """The packed scale and zero point (int32, see `repack`) of the group of sorted input row(s) `first_row`, for
    columns `offs_n` (broadcast together: [BLOCK_N] for one row, [BLOCK_N, G] for rows [1, G] and columns
    [BLOCK_N, 1]). Padding rows past K (whose activations are 0) take the last group, as theirs may not exist."""
    group = tl.minimum(first_row, K - 1) // group_size
    return tl.load(scale_zero_ptr + group * N + offs_n, mask=n_mask, other=0)


@triton.jit
def _scale(params):
    """The fp16 scale of packed group parameters."""
    return params.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _scale_and_zeros(params, BITS: tl.constexpr):
    """The fp32 scale s and zeros = -(1 + z / 2**BITS) (exact) of packed group parameters."""
    return _scale(params).to(tl.float32), -1.0 - (params >> 16).to(tl.float32) * (1.0 / (1 << BITS))


@triton.jit
def _weight_scale_and_offset(params, BITS: tl.constexpr):
    """2**BITS * s and its product with zeros: the fp32 weight is f * scale + offset for f = 1 + q / 2**BITS."""
    s, z = _scale_and_zeros(params, BITS)
    s = s * (1 << BITS)
    return s, s * z


@triton.jit
def _activation_columns(perm_ptr, rows, K, HAS_PERM: tl.constexpr, EVEN: tl.constexpr = False):
    """Columns of x for sorted input rows `rows`, and the mask of rows that exist (< K; all of them when EVEN)."""
    mask = rows < K
    if HAS_PERM:
        if EVEN:
            rows = tl.load(perm_ptr + rows)
        else:
            rows = tl.load(perm_ptr + rows, mask=mask, other=0)
    return rows, mask


@triton.jit
def _chunk_scales(scale_zero_ptr, c, group_size: tl.constexpr, offs_n, n_mask, N, K, BITS: tl.constexpr,
                  GROUP_PER_CHUNK: tl.constexpr, WORDS: tl.constexpr, FIELDS: tl.constexpr):
    """2**BITS * scale, and its product with `zeros`, as [BLOCK_N, G, 1] for the G groups of chunk c: one group
    when the chunk lies in one, else one per field (16-row run; FIELDS of them, the power of two >= 32 // BITS,
    the runs past the chunk taking valid but unused groups)."""
    VALUES: tl.constexpr = 32 // BITS
    if GROUP_PER_CHUNK:
        params = _group_params(scale_zero_ptr, c * VALUES * WORDS, group_size, offs_n, n_mask, N, K)[:, None]
    else:
        runs = c * VALUES * WORDS + tl.arange(0, FIELDS) * WORDS
        params = _group_params(scale_zero_ptr, runs[None, :], group_size, offs_n[:, None], n_mask[:, None], N, K)
    s, sz = _weight_scale_and_offset(params, BITS)
    return s[:, :, None], sz[:, :, None]


@triton.jit
def _chunk_weights(words, s, sz, BITS: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                   FIELDS: tl.constexpr):
    """The fp32 weights s * (q - z) [BLOCK_N, FIELDS * WORDS] of one chunk: column 16*j + w from field j of word w
    (columns from ROWS on, fields past the 32 // BITS of a word, are copies of the last field's).

    Each field is shifted under the exponent of 1.0, f = 1 + q / 2**BITS exactly, and s * f + sz is the weight
    (s and sz from `_chunk_scales`). The fields are unpacked as [BLOCK_N, FIELDS, WORDS], whose row-major
    reshape is the chunk's row order."""
    VALUES: tl.constexpr = 32 // BITS
    shifts = tl.minimum(tl.arange(0, FIELDS), VALUES - 1) * BITS
    mantissa = ((words[:, None, :] >> shifts[None, :, None]) << (23 - BITS)) & (((1 << BITS) - 1) << (23 - BITS))
    f = (mantissa | 0x3F800000).to(tl.float32, bitcast=True)
    return tl.reshape(f * s + sz, (BLOCK_N, FIELDS * WORDS))


@triton.jit
def _field_as_float(words, j: tl.constexpr, BITS: tl.constexpr):
    """Field j of each int32 word as the fp32 value 1 + q / 2**BITS (shift it under the exponent of 1.0)."""
    if 23 - BITS - BITS * j >= 0:
        moved = words << (23 - BITS - BITS * j)
    else:
        moved = words >> (BITS * j + BITS - 23)
    mantissa = moved & (((1 << BITS) - 1) << (23 - BITS))
    return (mantissa | 0x3F800000).to(tl.float32, bitcast=True)


# x enters the gemv as x * 2**(X_EXPONENT - b) against a field decoded as q * 2**(b - 149) (`_field_product`):
# every product is x * q * 2**(X_EXPONENT - 149), a normal fp32 for |x * q| >= 2**-77, and x * 2**X_EXPONENT
# stays finite for |x| < 2**27.
X_EXPONENT = 100


@triton.jit
def _field_product(words, x, j: tl.constexpr, BITS: tl.constexpr, X_EXPONENT: tl.constexpr):
    """x [BLOCK_M, 1, WORDS] times field j of the int32 words [1, BLOCK_N, WORDS], as x * q * 2**(X_EXPONENT - 149)
    [BLOCK_M, BLOCK_N, WORDS].

    The field is masked where it lies, b bits up, and read as the bits of a denormal fp32: q * 2**(b - 149).
    Fields that reach bit 23 (the exponent) are read after one shift of the word, shared by all of them (12
    bits, 16 for 8-bit codes). So a field costs one AND: no OR with an exponent, no subtraction of it. x comes
    in scaled by 2**(X_EXPONENT - b), which makes every product the same normal fp32 multiple of x * q; the FMAs
    take denormal inputs at full rate and exactly (Triton does not flush fp32 denormals)."""
    SHIFT: tl.constexpr = 0 if BITS * j + BITS <= 23 else (16 if BITS == 8 else 12)
    b: tl.constexpr = BITS * j - SHIFT
    if SHIFT > 0:
        words = words >> SHIFT
    field = (words & (((1 << BITS) - 1) << b)).to(tl.float32, bitcast=True)
    return (x * 2.0 ** (X_EXPONENT - b)) * field


@triton.jit
def _zero_point_term(s, zeros, BITS: tl.constexpr, UNIT: tl.constexpr):
    """-s * z per column as [1, BLOCK_N, 1], in the gemv's accumulator units (UNIT): zeros (`_scale_and_zeros`) is
    -(1 + z / 2**BITS), so (zeros + 1) * 2**BITS = -z."""
    return (s * (zeros + 1.0) * ((1 << BITS) * UNIT))[None, :, None]


@triton.jit
def _store_result(total, bias_ptr, out_ptr, offsets, bias_offsets, mask, HAS_BIAS: tl.constexpr):
    """out[offsets] = total (+ bias[bias_offsets]), cast to out's dtype."""
    if HAS_BIAS:
        total += tl.load(bias_ptr + bias_offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_chunks(num_chunks, split):
    """Chunks [first, last) of K split `split` of tl.num_programs(1): near-equal runs, so that any number of splits
    keeps every program busy."""
    splits = tl.num_programs(1)
    return split * num_chunks // splits, (split + 1) * num_chunks // splits


@triton.jit
def _write_result(total, bias_ptr, out_ptr, partials_ptr, locks_ptr, lock, offsets, bias_offsets, mask, stride_split,
                  HAS_BIAS: tl.constexpr, FINAL: tl.constexpr):
    """Write the fp32 tile `total` of out[offsets]: directly when FINAL, else as this program's partial sum of a
    K loop split over tl.num_programs(1) programs, the last of which to finish adds them all up and writes out.

    The split-K reduction thus needs no second kernel (70B-qkv at M = 1: 22.8 -> 21.8 us on an H200). Arrival
    is counted on locks[lock], one int32 per output tile that is zero between calls (the last program resets it):
    a barrier, so every thread of this program has stored its partials, then one thread's acq_rel atomic; the
    last program reads the partials through L2 (.cg), as its L1 may hold stale lines from an earlier call. The
    sum runs over the splits in order, so the result does not depend on which program came last. (Loading
    several splits per load, one L2 round trip for each, not one per split, gained nothing at M = 1 and made
    the mma path at M = 16 up to 25% slower on an H200: benchmarks/results/2026-11-30-triton-split-reduce.log.)"""
    if FINAL:
        _store_result(total, bias_ptr, out_ptr, offsets, bias_offsets, mask, HAS_BIAS)
    else:
        split_k = tl.num_programs(1)
        tl.store(partials_ptr + tl.program_id(1) * stride_split + offsets, total, mask=mask)
        tl.debug_barrier()
        if tl.atomic_add(locks_ptr + lock, 1, sem="acq_rel", scope="gpu") == split_k - 1:
            total = tl.load(partials_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            for split in range(1, split_k):
                total += tl.load(partials_ptr + split * stride_split + offsets, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _store_result(total, bias_ptr, out_ptr, offsets, bias_offsets, mask, HAS_BIAS)
            tl.atomic_xchg(locks_ptr + lock, 0)


@triton.jit
def _prefetch_chunks(qweight_ptr, first, last, pid_n, N, COUNT: tl.constexpr, BLOCK_N: tl.constexpr,
                     WORDS: tl.constexpr):
    """Ask L2 for the first COUNT of chunks [first, last) of column block pid_n (one contiguous BLOCK_N * WORDS
    words each), one 128-byte line a thread per request."""
    LINE: tl.constexpr = 32  # int32 words
    lines = tl.arange(0, BLOCK_N * WORDS // LINE) * LINE
    for i in tl.static_range(COUNT):
        c = tl.minimum(first + i, last - 1)
        address = (qweight_ptr + (c * N + pid_n * BLOCK_N) * WORDS + lines).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [address], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(x_ptr, qweight_ptr, scale_zero_ptr, perm_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr,
                 M, N, K, stride_xm, stride_om, stride_split,
                 GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, GROUP_PER_CHUNK: tl.constexpr,
                 HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL: tl.constexpr, X_EXPONENT: tl.constexpr,
                 NUM_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                 EVEN: tl.constexpr, DEPENDENT: tl.constexpr):
    """out[rows, n] (or split partial) for BLOCK_M activation rows, BLOCK_N columns and one split of the chunks.

    Per weight: one AND (`_field_product`) and one FMA with the pre-scaled activation. The zero point is
    applied per word slot and chunk, sum(x * s * (q - z)) = s * sum(x * q) - s * z * sum(x), with the sums over
    the chunk (or field, when the group is shorter than a chunk); the accumulator stays [BLOCK_M, BLOCK_N, WORDS]
    and is reduced once at the end, so the loop has no cross-thread reduction. Each thread holds several columns,
    so the activations it loads, converts and scales serve all of them; with BLOCK_M > 1 the weight words it loads
    serve all rows (a program per row read each weight once per row: M = 2 on 70B-up 151 -> 131 us, 70B-down
    81 -> 63 us on an H200; at M = 4 the mma path stays faster). The chunks stream through a NUM_STAGES-deep
    cp.async pipeline (`tl.range`): with 3 stages, 70B-up at M = 1 went from 113 to 82 us on an H200.
    EVEN (M, N and K multiples of BLOCK_M, BLOCK_N and the chunk) drops the masks of the loop's loads, and with
    them the predicates of its cp.async copies: the loop shrinks from 942 to 851 instructions a thread per chunk
    (sm_90 SASS, bf16 zero points g128, BLOCK_N 256 on 4 warps), the group size being a constexpr too. On an H200
    (interleaved A/B, bf16 g128, benchmarks/results/2026-12-01-triton-gemv-even.log) M = 1 took 11-16% less
    time (70B-qkv 20.7 -> 18.5 us, 70B-up 80.8 -> 68.1, 70B-down 43.1 -> 38.1), M = 2 11-26% less.
    DEPENDENT (sm_90 on; the launch sets launch_pdl): the kernel is a programmatic dependent of the one ahead in
    the stream, so its programs may start while that one still runs. Before waiting for it (gdc_wait) a program
    only asks L2 for its first NUM_STAGES chunks of weight words (prefetch, no load: L2 is where the kernel
    ahead's writes land, so nothing stale can reach a register); x, the scales, partials and counters are read
    after the wait. It lets the next call in too (gdc_launch_dependents) as soon as every program has started.
    On an H200 (interleaved A/B, bf16 g128, benchmarks/results/2026-12-02-triton-gemv-pdl-ab.log): M = 2 3-7%
    less time on 70B-qkv, 7B-qkv, 70B-down and 7B-up; M = 1 -2% to +5%, so the tuner times both ways.
    """
    VALUES: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = VALUES * WORDS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    first, last = _split_chunks(tl.cdiv(K, ROWS), pid_k)
    # Every tensor of the loop is 3-D, [rows, columns, words], from its load on, so that none changes layout in
    # it: with 2-D words and activations broadcast to 3-D, Triton picked another layout (shuffles, ldmatrix) and
    # M = 1 ran 5-18% slower (benchmarks/results/2026-11-30-triton-gemv-rows.log).
    x_rows = x_ptr + rows[:, None, None] * stride_xm
    tile = qweight_ptr + offs_n[None, :, None] * WORDS + offs_w[None, None, :]
    if DEPENDENT:
        _prefetch_chunks(qweight_ptr, first, last, pid_n, N, NUM_STAGES, BLOCK_N, WORDS)
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N, WORDS], tl.float32)
    ZERO_UNIT: tl.constexpr = 2.0 ** (X_EXPONENT - 149)  # acc holds x * q in units of 2**(X_EXPONENT - 149)
    for c in tl.range(first, last, num_stages=NUM_STAGES):
        if EVEN:
            words = tl.load(tile + c * N * WORDS)
        else:
            words = tl.load(tile + c * N * WORDS, mask=n_mask[None, :, None], other=0)
        for j in tl.static_range(VALUES):
            cols, k_mask = _activation_columns(perm_ptr, c * ROWS + j * WORDS + offs_w, K, HAS_PERM, EVEN)
            if EVEN:
                xj = tl.load(x_rows + cols[None, None, :]).to(tl.float32)
            else:
                xj = tl.load(x_rows + cols[None, None, :], mask=row_mask[:, None, None] & k_mask[None, None, :],
                             other=0.0).to(tl.float32)
            product = _field_product(words, xj, j, BITS, X_EXPONENT)
            if GROUP_PER_CHUNK:  # sum the chunk's fields, scale them once below
                if j == 0:
                    partial, x_sum = product, xj
                else:
                    partial += product
                    x_sum += xj
            else:
                s, z = _scale_and_zeros(_group_params(scale_zero_ptr, c * ROWS + j * WORDS, GROUP_SIZE, offs_n,
                                                      n_mask, N, K), BITS)
                acc += s[None, :, None] * product
                acc += _zero_point_term(s, z, BITS, ZERO_UNIT) * xj
        if GROUP_PER_CHUNK:
            s, z = _scale_and_zeros(_group_params(scale_zero_ptr, c * ROWS, GROUP_SIZE, offs_n, n_mask, N, K), BITS)
            acc += s[None, :, None] * partial
            acc += _zero_point_term(s, z, BITS, ZERO_UNIT) * x_sum
    _write_result(tl.sum(acc, 2) / ZERO_UNIT, bias_ptr, out_ptr, partials_ptr, locks_ptr,
                  tl.program_id(2) * tl.num_programs(0) + pid_n, rows[:, None] * stride_om + offs_n[None, :],
                  offs_n[None, :], row_mask[:, None] & n_mask[None, :], stride_split, HAS_BIAS, FINAL)


# The mma path's 16-bit dequantization of a k-pair, for `tl.inline_asm_elementwise` with pack = 2: the dot operand
# layout holds rows k, k + 1 (k even) of a column in consecutive registers, and in this kernel's layout they are
# field j of two consecutive words. $1, $2: the two words. prmt ($3: selector) gathers the bytes that hold field j
# of each, the first word's in the low half, the second's in the high half; a shift ($5) brings the field to bit
# 0 of each half and lop3 ($7: mask) keeps it under the exponent of the magic number: 128 + q in bf16 (0x4300),
# 1024 + q in fp16 (0x6400), exactly. One packed FMA adds -b = -(magic + z) ($10, twice), exactly, and one
# multiplies by the scale ($9, (s, s)): the weights s * (q - z), rounded once (the public Marlin and
# FasterTransformer kernels use the same magic numbers in fp16). Packed FMAs because sm_80 has no bf16x2 sub or
# mul. The selector, shift and mask are constants that ptxas folds into the instructions: ~4.5 instructions a
# pair, against ~4 a weight for the fp32 decode.
_PAIR_ASM = ("{ .reg .b32 v, one, negzero; mov.b32 one, ONE; mov.b32 negzero, 0x80008000; "
             "prmt.b32 v, $1, $2, $3; shr.b32 v, v, $5; lop3.b32 v, v, $7, MAGIC, 0xEA; "
             "fma.rn.TYPE v, v, one, $10; fma.rn.TYPE $0, v, $9, negzero; }")
_BF16_PAIR_ASM = tl.constexpr(_PAIR_ASM.replace("ONE", "0x3F803F80").replace("MAGIC", "0x43004300")
                              .replace("TYPE", "bf16x2"))
_FP16_PAIR_ASM = tl.constexpr(_PAIR_ASM.replace("ONE", "0x3C003C00").replace("MAGIC", "0x64006400")
                              .replace("TYPE", "f16x2"))
_PAIR_CONSTRAINTS = tl.constexpr("=r" + ",r" * 10)  # 2 input registers an operand, 1 for the 16-bit s and -b


@triton.jit
def _field_pairs(words, j: tl.constexpr, BITS: tl.constexpr, params, DOT_DTYPE: tl.constexpr):
    """Field j of the [BLOCK_N, WORDS] words as the weights s * (q - z) in DOT_DTYPE (bf16 or fp16; in bf16 the
    codes must fit its 7 mantissa bits), `params` [BLOCK_N] being the columns' packed group parameters."""
    MAGIC: tl.constexpr = 128 if DOT_DTYPE == tl.bfloat16 else 1024
    OFFSET: tl.constexpr = BITS * j  # of the field in its word; bytes FIRST and FIRST + 1 hold it
    FIRST: tl.constexpr = min(OFFSET // 8, 2)
    SELECTOR: tl.constexpr = ((5 + FIRST) << 12) | ((4 + FIRST) << 8) | ((FIRST + 1) << 4) | FIRST
    selector = tl.full(words.shape, SELECTOR, tl.int32)
    shift = tl.full(words.shape, OFFSET - 8 * FIRST, tl.int32)
    mask = tl.full(words.shape, ((1 << BITS) - 1) * 0x10001, tl.int32)
    s = tl.broadcast_to(_scale(params).to(DOT_DTYPE)[:, None], words.shape)
    minus_b = tl.broadcast_to((-MAGIC - (params >> 16)).to(DOT_DTYPE)[:, None], words.shape)
    operands = [words, selector, shift, mask, s, minus_b]
    if DOT_DTYPE == tl.bfloat16:
        w = tl.inline_asm_elementwise(_BF16_PAIR_ASM, _PAIR_CONSTRAINTS, operands, dtype=s.dtype, is_pure=True, pack=2)
    else:
        w = tl.inline_asm_elementwise(_FP16_PAIR_ASM, _PAIR_CONSTRAINTS, operands, dtype=s.dtype, is_pure=True, pack=2)
    return w


@triton.jit
def _fields_side_by_side(words, params, scale_zero_ptr, row, first: tl.constexpr, count: tl.constexpr, offs_n, n_mask,
                         N, K, GROUP_SIZE: tl.constexpr, GROUP_PER_CHUNK: tl.constexpr, BITS: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, PAIRS: tl.constexpr):
    """Fields first .. first + count - 1 (count a power of two) of the [BLOCK_N, 16] words of the chunk at sorted row
    `row`, dequantized side by side: [BLOCK_N, 16 * count], column 16 * i + w from field first + i of word w, i.e.
    sorted rows row + 16 * first + [0, 16 * count) in order. `params` are the group parameters of the chunk's first
    row; with groups smaller than a chunk each field loads its own.

    Built by tl.join of halves: the field index becomes register dimensions of the dot operand's layout, which
    Triton carries through join, permute and reshape without moving data (no shared memory, no shuffle)."""
    if count == 1:
        if not GROUP_PER_CHUNK and first > 0:
            params = _group_params(scale_zero_ptr, row + 16 * first, GROUP_SIZE, offs_n, n_mask, N, K)
        if PAIRS:
            return _field_pairs(words, first, BITS, params, DOT_DTYPE)
        else:
            s, sz = _weight_scale_and_offset(params, BITS)
            return (_field_as_float(words, first, BITS) * s[:, None] + sz[:, None]).to(DOT_DTYPE)
    else:
        low = _fields_side_by_side(words, params, scale_zero_ptr, row, first, count // 2, offs_n, n_mask, N, K,
                                   GROUP_SIZE, GROUP_PER_CHUNK, BITS, DOT_DTYPE, PAIRS)
        high = _fields_side_by_side(words, params, scale_zero_ptr, row, first + count // 2, count // 2, offs_n,
                                    n_mask, N, K, GROUP_SIZE, GROUP_PER_CHUNK, BITS, DOT_DTYPE, PAIRS)
        both = tl.permute(tl.join(low, high), (0, 2, 1))  # [BLOCK_N, 2, 16 * count / 2]
        return tl.reshape(both, (both.shape[0], 16 * count))


@triton.jit
def _activations(x_rows, perm_ptr, first_row, rows: tl.constexpr, K, m_mask, HAS_PERM: tl.constexpr,
                 EVEN: tl.constexpr):
    """x^T [rows, BLOCK_M] for sorted input rows first_row + [0, rows) (zeros past K and past M)."""
    cols, k_mask = _activation_columns(perm_ptr, first_row + tl.arange(0, rows), K, HAS_PERM, EVEN)
    if EVEN:
        return tl.load(x_rows + cols[:, None])
    else:
        return tl.load(x_rows + cols[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row block, column block) of tile `pid` in grouped order: GROUP_M row blocks sweep the column blocks
    together, so the weight tiles they share are read from DRAM about once per group (the swizzle of the Triton
    matmul tutorial). Scalar arithmetic only, so the Gluon kernel (`triton_wgmma`) calls it too."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _mma_kernel(x_ptr, qweight_ptr, scale_zero_ptr, perm_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr,
                M, N, K, stride_xm, stride_om, stride_split,
                GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, GROUP_PER_CHUNK: tl.constexpr,
                HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL: tl.constexpr,
                DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIRS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WORDS: tl.constexpr,
                FIELDS_PER_DOT: tl.constexpr, X_DESCRIPTOR: tl.constexpr, WAIT_FOR_WGMMAS: tl.constexpr,
                EVEN: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] output tile (or split partial) on tensor cores, computed transposed as
    acc[BLOCK_N, BLOCK_M] += W_j[BLOCK_N, 16 F] @ x_j^T[16 F, BLOCK_M], one dot for each F = FIELDS_PER_DOT fields j
    of a chunk (for F > 1 at 3 bits, the last dot takes 10 % F fields).

    The weights are the register operand of the dot (wgmma on Hopper), in the layout that Triton gives that
    operand: the dequantization runs there, with no shuffle, each field where it lies (`_fields_side_by_side`).
    PAIRS dequantizes in 16 bits (`_field_pairs`), else (fp32 activations, the interpreter, 8-bit codes in bf16)
    as fp32 FMAs.

    F and the assumption of a non-empty run of chunks (the launch gives each split at least one), compiled for
    sm_90 with triton 3.6 (the device's; `default_fields_per_dot`):
    - one dot a field (F = 1) waits for each wgmma before the next field's dequantization (wgmma.wait_group 0);
    - one dot a chunk lets Triton keep all of the chunk's wgmmas in flight (wait_group 7 after each);
    - ptxas still serialized them (its advisory C7515: "non wgmma instructions defining accumulator registers of a
      wgmma between start and end of the pipeline stage"), for the zero-trip path that moves the initial zeros into
      the accumulators. Without that path consecutive HGMMAs take distinct A registers and each waits only for the
      one issued 8 before it;
    - but up to 7 are then still in flight when the next chunk's dequantization rewrites their A registers: on an
      H200 some configs summed wrongly (bf16 relative error up to 2.5e-2, NaN with x through TMA). So
      WAIT_FOR_WGMMAS waits for all of them at the end of each chunk. The 8 still run back to back, and the
      other warpgroups and blocks fill the wait (70B-up at M = 256: F = 1 561 us, F = 8 477 us, F = 8 with x
      through TMA on 256-row tiles 431 us; benchmarks/results/2026-12-01-triton-one-dot-a-chunk.md).
    On sm_80, Triton spreads one dot a chunk over 2 x 4 warps, and each dequantizes the weights of 4 (948
    instructions a thread a chunk against 409 for one dot a field, whose chain of dots keeps all warps on
    BLOCK_N).

    X_DESCRIPTOR: x_ptr is a TMA tensor descriptor of x with [BLOCK_M, 16 F] blocks (one dot a chunk, no
    act_order gather): the copy engine fills the stages, zeros past M and K, and the threads keep no x
    addresses (126 registers against 166 at 128 x 128 on 8 warps, sm_90a)."""
    VALUES: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = VALUES * WORDS
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    first, last = _split_chunks(tl.cdiv(K, ROWS), pid_k)
    tl.assume(first < last)
    tile = qweight_ptr + offs_n[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    if not X_DESCRIPTOR:
        x_rows = x_ptr + offs_m[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for c in range(first, last):
        if EVEN:
            words = tl.load(tile + c * N * WORDS)
        else:
            words = tl.load(tile + c * N * WORDS, mask=n_mask[:, None], other=0)
        params = _group_params(scale_zero_ptr, c * ROWS, GROUP_SIZE, offs_n, n_mask, N, K)
        for j in tl.static_range(0, VALUES, FIELDS_PER_DOT):  # fields j .. j + min(F, VALUES - j) - 1
            w = _fields_side_by_side(words, params, scale_zero_ptr, c * ROWS, j, min(FIELDS_PER_DOT, VALUES - j),
                                     offs_n, n_mask, N, K, GROUP_SIZE, GROUP_PER_CHUNK, BITS, DOT_DTYPE, PAIRS)
            if X_DESCRIPTOR:
                xt = x_ptr.load([pid_m * BLOCK_M, c * ROWS + j * WORDS]).T
            else:
                xt = _activations(x_rows, perm_ptr, c * ROWS + j * WORDS, min(FIELDS_PER_DOT, VALUES - j) * WORDS,
                                  K, m_mask, HAS_PERM, EVEN)
            acc = tl.dot(w, xt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        if WAIT_FOR_WGMMAS:
            # Triton 3.6 waits for all but the last 7 wgmmas of a chunk, and the next chunk's dequantization
            # then overwrites A registers that those still read (wrong sums on an H200 for some configs): wait
            # for all of them before the loop goes round.
            tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
    _write_result(acc, bias_ptr, out_ptr, partials_ptr, locks_ptr, pid, offs_m[None, :] * stride_om + offs_n[:, None],
                  offs_n[:, None], n_mask[:, None] & m_mask[None, :], stride_split, HAS_BIAS, FINAL)


@triton.jit
def _dequant_kernel(qweight_ptr, scale_zero_ptr, w_ptr, N, K,
                    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, GROUP_PER_CHUNK: tl.constexpr,
                    BLOCK_N: tl.constexpr, WORDS: tl.constexpr, FIELDS: tl.constexpr):
    """Write W[n, k] = s * (q - z) in w_ptr's dtype (sorted row order) for BLOCK_N columns of one chunk; FIELDS is
    the power of two >= 32 // BITS (tl.arange needs one)."""
    ROWS: tl.constexpr = (32 // BITS) * WORDS
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    words = tl.load(qweight_ptr + c * N * WORDS + offs_n[:, None] * WORDS + tl.arange(0, WORDS)[None, :],
                    mask=n_mask[:, None], other=0)
    s, sz = _chunk_scales(scale_zero_ptr, c, GROUP_SIZE, offs_n, n_mask, N, K, BITS, GROUP_PER_CHUNK, WORDS, FIELDS)
    w = _chunk_weights(words, s, sz, BITS, BLOCK_N, WORDS, FIELDS)
    r = tl.arange(0, FIELDS * WORDS)
    k = c * ROWS + r
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * K + k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_mask[:, None] & ((r < ROWS) & (k < K))[None, :])


# ---------------------------------------------------------------------------------------------------------------
# Launch, configs and tuning
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    """One way to run the matmul: the path and its tile sizes."""

    path: str  # "gemv", "mma", "wgmma" (Hopper, `triton_wgmma`) or "dequant"
    block_n: int = 128
    block_m: int = 16
    split_k: int = 1  # runs of K's chunks a tile (wgmma: a tile of the last, partial round), summed by the last
    num_warps: int = 4
    num_stages: int = 2
    fields_per_dot: Optional[int] = None  # mma: F of `_mma_kernel`; None: `default_fields_per_dot`
    x_descriptor: bool = False  # mma: x through a TMA descriptor where `_x_descriptor` can make one
    dependent: bool = False  # gemv, sm_90 on: launched as a programmatic dependent (see `_gemv_kernel`)
    stream_k: bool = False  # wgmma: the last round's chunks shared out over all SMs (`triton_wgmma.launch`)


GEMV_MAX_M = 4
TUNING_ROUNDS = 2
TUNING_CALLS = 8  # calls per timed graph replay, at least
TUNING_MAX_COPIES = 64  # of the weight while tuning (a layer that small is latency bound anyway)
TUNING_SETTLE_S = 0.5  # of replays before timing the candidates for M >= DEQUANT_MIN_M (see `choose_config`)
DEQUANT_MIN_M = 256
WGMMA_BITS = (2, 4)  # the wgmma path's: fields a power of two, codes that fit bf16's mantissa
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_TUNED: Dict[tuple, KernelConfig] = {}


def _before_hopper(device: torch.device) -> bool:
    """A CUDA GPU older than sm_90 (the CPU, under the interpreter, takes Hopper's paths)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9


def _hopper(device: torch.device) -> bool:
    """An sm_90 GPU, the one the wgmma path (Gluon, `triton_wgmma`) is written for."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def default_fields_per_dot(bits: int, device: torch.device) -> int:
    """The mma path's fields a dot unless a config says: the whole chunk (its largest power of two at 3 bits) from
    sm_90 on, and under the interpreter; one below sm_90 (see `_mma_kernel`)."""
    if _before_hopper(device):
        return 1
    return 1 << ((32 // bits).bit_length() - 1)


def _x_descriptor(x: torch.Tensor, rows: int, block_m: int, fields: int, bits: int) -> Optional[TensorDescriptor]:
    """A TMA descriptor of x [M, K] with [block_m, rows] blocks, where the mma kernel can take one: not before
    sm_90, at one dot a chunk, with x 16-byte aligned; else None (the kernel then loads x itself)."""
    if _before_hopper(x.device) or fields != 32 // bits or not _tma_aligned(x):
        return None
    return TensorDescriptor.from_tensor(x, [block_m, rows])


def _tma_aligned(x: torch.Tensor) -> bool:
    """Whether x's start and rows are 16-byte aligned, as a TMA descriptor of it needs."""
    return x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0


def _wgmma_supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the wgmma path can take this call: sm_90, 16-bit x with K a multiple of 8 (its rows 16-byte aligned
    for the TMA descriptor; the launch copies a misaligned x), WGMMA_BITS, groups of whole chunks or none."""
    return (_hopper(x.device) and x.dtype in (torch.float16, torch.bfloat16) and x.shape[1] % 8 == 0
            and bits in WGMMA_BITS and (group_size == -1 or group_size % chunk_rows(bits) == 0))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def lock_count(n: int, device: torch.device) -> int:
    """Split-K arrival counters that any config may need for N output columns: one per output tile that is split,
    i.e. gemv's rows (<= GEMV_MAX_M) x column tiles (>= 64 wide), mma's tiles (one row tile up to M = 64, and fewer
    tiles than SMs above it, where it splits)."""
    return max(GEMV_MAX_M * -(-n // 64), _sm_count(device))


def new_locks(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed split-K arrival counters for N output columns (the kernels leave them zeroed after each call)."""
    return torch.zeros(lock_count(n, device), dtype=torch.int32, device=device)


def m_bucket(m: int) -> int:
    """The power of two >= m: configs are tuned per bucket, so decode never re-tunes for a new M."""
    return 1 << max(0, (m - 1).bit_length())


def candidate_configs(m: int, n: int, k: int, bits: int, device: torch.device) -> List[KernelConfig]:
    """The configs worth timing for an [m, k] x [k, n] product, the untuned default first."""
    sms, chunks = _sm_count(device), -(-k // chunk_rows(bits))

    def splits(tiles: int, finer: bool = False) -> Tuple[int, ...]:
        """Split-K factors that bring tiles * split to about 2 and 4 programs per SM (powers of two), and when
        `finer` half the first and the factors in between too (3/4 and 3/2 of it: on an H200 at M = 1, 70B-qkv
        20.5 us at 6 splits against 21.6 at 8, 70B-down 43.5 at 12 against 44.4 at 8;
        benchmarks/results/2026-12-01-triton-gemv-splits.log)."""
        want = -(-2 * sms // tiles)
        split = min(1 << (want - 1).bit_length(), chunks)
        factors = {split, min(2 * split, chunks)}
        if finer:
            factors |= {max(1, split // 2), max(1, 3 * split // 4), min(3 * split // 2, chunks)}
        return tuple(sorted(factors))

    configs = []
    if m <= GEMV_MAX_M:
        # Measured on an H200 (benchmarks/results/2026-11-30-triton-gemv.md): 256 columns on 4 warps (8 columns a
        # thread) with a 3-stage cp.async pipeline wins on every Llama-2 layer; the others serve small N. Above one
        # row, a program takes all rows (one read of each weight) or one (fewer registers).
        # From sm_90 the 3-stage ones also run as programmatic dependents (`_gemv_kernel`'s DEPENDENT), unless
        # LITQUANT_PDL=0 (`dependent_launches_allowed`).
        pdl = device.type == "cuda" and not _before_hopper(device) and dependent_launches_allowed()
        dependent = (False, True) if pdl else (False,)
        for rows in sorted({m_bucket(m), 1}):
            for block_n, warps, stages in ((256, 4, 3), (256, 4, 2), (128, 4, 3), (64, 4, 2)):
                configs += [KernelConfig("gemv", block_n=block_n, block_m=rows, split_k=s, num_warps=warps,
                                         num_stages=stages, dependent=d)
                            for s in splits(-(-n // block_n) * -(-m // rows), finer=True)
                            for d in dependent if stages == 3 or not d]
    block_m = min(max(16, m_bucket(m)), 128)
    if m <= 64:
        # 3-4 stages: 70B-up at M = 64, 241 us at 4 against 268 at 3 (benchmarks/results/2026-12-01-triton-mma16.md)
        for block_n, stages in ((128, 3), (128, 4), (64, 3)):
            configs += [KernelConfig("mma", block_n=block_n, block_m=block_m, split_k=s, num_stages=stages)
                        for s in splits(-(-n // block_n) * -(-m // block_m))]
    else:
        # With x through TMA (sm_90+), 256-row tiles on 8 warps won on the 70B layers at M = 256 and 1024, and 2
        # stages let two 128 x 128 blocks share an SM (benchmarks/results/2026-12-01-triton-one-dot-a-chunk.md)
        shapes = [(block_m, 128, 4, 3, False), (128, 128, 8, 3, False), (64, 128, 4, 3, False),
                  (128, 256, 8, 3, False)]
        if not _before_hopper(device):
            shapes += [(128, 128, 4, 3, True), (128, 128, 8, 2, True)] + ([(256, 128, 8, 3, True)] if m >= 256 else [])
        if _hopper(device) and bits in WGMMA_BITS:
            # Each also with the tiles of its last, partial round split over K where that fills it better (7B-down
            # at M = 256: 32 tiles of 256 x 128 in 4 runs; 70B-qkv: 132 + 28 tiles of 128 x 128, the 28 in 4), and
            # stream-K (70B-qkv at M = 256: 80 tiles of 256 x 128 over 132 SMs, 7.7% faster than the best of the
            # others; benchmarks/results/2026-12-02-wgmma-stream-k.md).
            from litquant.kernels import triton_wgmma  # Gluon: imported where it runs
            for block_m, stages in ((128, 4), (64, 4)) + (((256, 3),) if m >= 256 and bits == 4 else ()):
                tiles = -(-m // block_m) * -(-n // 128)
                slots = sms * triton_wgmma.stages_and_blocks(bits, 2, block_m, 128, stages, device)[1]
                wgmma = dict(block_n=128, block_m=block_m, num_warps=8, num_stages=stages)
                configs += [KernelConfig("wgmma", split_k=s, **wgmma)
                            for s in sorted({1, triton_wgmma.tail_split(tiles, slots, sms)})]
                if tiles % slots:
                    configs.append(KernelConfig("wgmma", stream_k=True, **wgmma))
        for block_m, block_n, warps, stages, descriptor in shapes:
            tiles = -(-n // block_n) * -(-m // block_m)
            split = 1 if tiles >= sms else splits(tiles)[0]
            configs.append(KernelConfig("mma", block_n=block_n, block_m=block_m, split_k=split, num_warps=warps,
                                        num_stages=stages, x_descriptor=descriptor))
    if m >= DEQUANT_MIN_M:
        configs.append(KernelConfig("dequant"))
    return list(dict.fromkeys(configs))


def _replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """Median seconds of one replay of `graph` (after a warm-up replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def tuned_configs() -> Dict[tuple, KernelConfig]:
    """The configs chosen so far, keyed by (device, dtype, M bucket, N, K, bits, group_size, act_order?)."""
    return dict(_TUNED)


def choose_config(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, perm: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], locks: torch.Tensor, bits: int, group_size: int,
                  out: torch.Tensor) -> KernelConfig:
    """The fastest config for this call's (N, K, M bucket), timed once per process on the real tensors.

    Without timing (the interpreter, inside a CUDA-graph capture) the default candidate runs, and is not cached.
    """
    m, k = x.shape
    n = qweight.shape[1]
    key = (x.device, x.dtype, m_bucket(m), n, k, bits, group_size, perm is not None)
    if key in _TUNED:
        return _TUNED[key]
    candidates = [c for c in candidate_configs(m, n, k, bits, x.device)
                  if c.path != "wgmma" or _wgmma_supports(x, bits, group_size)]
    if INTERPRET or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing() or len(candidates) == 1:
        return candidates[0]
    runs = []
    for config in candidates:  # compile them all first (and drop those that do not fit this GPU)
        try:
            launch(config, x, qweight, scale_zero, perm, bias, locks, bits, group_size, out)
            runs.append(config)
        except (OutOfResources, triton.CompilationError) as e:
            warnings.warn(f"triton kernel: skipping {config} for M={m} N={n} K={k}: {type(e).__name__}: {e}")
    if not runs:
        raise RuntimeError(f"triton kernel: no candidate config runs for M={m} N={n} K={k} on {x.device}")
    # Timed as decode runs them: from a CUDA graph (the GPU's time only: timed eagerly, the ~20 us of Python per
    # launch leaked into the 15-25 us of a decode matmul and reordered close configs), calls back to back over
    # copies of the weight that together exceed twice the L2 size (each call streams its weight from DRAM, as
    # in a model; do_bench's flush, a memset, left L2 dirty and favoured other configs than the benchmark's).
    # TUNING_ROUNDS interleaved rounds, each config's best kept (benchmarks/results/2026-11-30-triton-tuning.log,
    # 2026-11-30-triton-split-reduce.log).
    l2_bytes = torch.cuda.get_device_properties(x.device).L2_cache_size
    copies = min(-(-2 * l2_bytes // qweight.nbytes), TUNING_MAX_COPIES)
    weights = [qweight] + [qweight.clone() for _ in range(copies - 1)]
    weights *= -(-TUNING_CALLS // len(weights))
    graphs = {}
    for config in runs:
        graphs[config] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[config]):
            for weight in weights:
                launch(config, x, weight, scale_zero, perm, bias, locks, bits, group_size, out)
    if m >= DEQUANT_MIN_M:
        # Products this large run an H200 at its power cap within a second of a long prefill (its SM clock from
        # 1.98 GHz down to 1.3-1.8), and the ranking of close configs can change there (70B-qkv at M = 256: 128 x
        # 128 tiles split 4 ways beat 256 x 128 unsplit in bursts from idle, 80.5 against 81.1 us, and lost with
        # each config settled on its own, 84.9 against 82.3; benchmarks/results/2026-12-02-wgmma-stream-k.md). So
        # they are timed near the cap, reached by replaying all of them in turn first. (Not measured apart from
        # the stream-K change it came with.)
        until = time.perf_counter() + TUNING_SETTLE_S
        while time.perf_counter() < until:
            for graph in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
    times = {}
    for _ in range(TUNING_ROUNDS):
        for config, graph in graphs.items():
            t = _replay_seconds(graph) / len(weights)
            times[config] = min(t, times.get(config, t))
    _TUNED[key] = min(times, key=times.get)
    log.debug("tuned M<=%d N=%d K=%d %s: %s", m_bucket(m), n, k, x.dtype, "; ".join(
        f"{c.path} bn={c.block_n} bm={c.block_m} split={c.split_k} w={c.num_warps} st={c.num_stages}"
        f"{' tma' if c.x_descriptor else ''}{' pdl' if c.dependent else ''}{' stream-k' if c.stream_k else ''} "
        f"{t * 1e6:.1f} us" for c, t in sorted(times.items(), key=lambda item: item[1])))
    return _TUNED[key]


def launch(config: KernelConfig, x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor,
           perm: Optional[torch.Tensor], bias: Optional[torch.Tensor], locks: torch.Tensor, bits: int, group_size: int,
           out: torch.Tensor) -> None:
    """Write x @ W^T (+ bias) into `out` [M, N] with `config`. x is [M, K] with unit stride along K; `locks` are
    zeroed int32 split-K counters (`new_locks`), left zeroed."""
    m, k = x.shape
    n = qweight.shape[1]
    group = NO_GROUP if group_size == -1 else group_size
    group_per_chunk = group_size == -1 or group % chunk_rows(bits) == 0  # at 3 bits (160-row chunks) only for -1
    flags = dict(GROUP_SIZE=group, BITS=bits, GROUP_PER_CHUNK=group_per_chunk, WORDS=WORDS_PER_CHUNK)
    if config.path == "dequant":
        weight = torch.empty(n, k, dtype=x.dtype, device=x.device)
        _dequant_kernel[(triton.cdiv(n, 64), triton.cdiv(k, chunk_rows(bits)))](
            qweight, scale_zero, weight, n, k, BLOCK_N=64, FIELDS=triton.next_power_of_2(32 // bits),
            **flags)
        if perm is not None:
            x = x.index_select(1, perm)
        torch.mm(x, weight.t(), out=out)
        if bias is not None:
            out += bias
        return
    if config.path == "wgmma" and not _wgmma_supports(x, bits, group_size):
        raise ValueError(f"the wgmma path takes sm_90, {' or '.join(map(str, WGMMA_BITS))}-bit codes, groups of "
                         f"whole chunks and K a multiple of 8; got {bits} bits, group {group_size}, K={k} on "
                         f"{x.device}")
    if perm is not None and (m > PERMUTE_X_ABOVE_M or config.x_descriptor or config.path == "wgmma"):
        x, perm = x.index_select(1, perm), None
    # The mma kernel's loop assumes a non-empty run of chunks (see its docstring): at most one split a chunk (nor
    # are more worth running on the wgmma path, which splits in its own launch).
    runs = min(config.split_k, -(-k // chunk_rows(bits)))
    split = {"gemv": config.split_k, "mma": runs}.get(config.path, 1)
    final = split == 1
    partials = out if final else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    args = (x, qweight, scale_zero, perm, bias, out, partials, locks)
    flags.update(HAS_PERM=perm is not None, HAS_BIAS=bias is not None, FINAL=final, BLOCK_N=config.block_n,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    if config.path == "gemv":
        grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))
    else:
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    if not final and grid[0] * (grid[2] if config.path == "gemv" else 1) > locks.numel():
        raise ValueError(f"{config} for M={m} N={n} splits more output tiles than the {locks.numel()} split-K "
                         f"counters given (see lock_count)")
    even = m % config.block_m == 0 and n % config.block_n == 0 and k % chunk_rows(bits) == 0
    if config.path == "gemv":
        _gemv_kernel[grid](*args, m, n, k, x.stride(0), n, m * n, X_EXPONENT=X_EXPONENT,
                           NUM_STAGES=config.num_stages, BLOCK_M=config.block_m, EVEN=even,
                           DEPENDENT=config.dependent, launch_pdl=config.dependent, **flags)
    elif config.path == "wgmma":
        from litquant.kernels import triton_wgmma  # Gluon: imported where it runs
        if not _tma_aligned(x):
            x = x.clone(memory_format=torch.contiguous_format)
        triton_wgmma.launch(x, qweight, scale_zero, bias, out, locks, runs, config.stream_k, bits, group_size,
                            config.block_m, config.block_n, config.num_warps, config.num_stages)
    else:
        fields = config.fields_per_dot or default_fields_per_dot(bits, x.device)
        if fields & (fields - 1) or not 1 <= fields <= 32 // bits:
            raise ValueError(f"fields_per_dot must be a power of two from 1 to {32 // bits} at {bits} bits, "
                             f"got {fields}")
        # The interpreter computes bf16 tl.dot wrongly (triton 3.9), and cannot run inline PTX: it gets the same
        # values widened to fp32.
        dot_dtype = tl.float32 if INTERPRET else _TL_DTYPES[x.dtype]
        pairs = dot_dtype == tl.float16 or (dot_dtype == tl.bfloat16 and bits < 8)  # codes must fit the mantissa
        descriptor = config.x_descriptor and _x_descriptor(x, chunk_rows(bits), config.block_m, fields, bits)
        if descriptor:
            args = (descriptor,) + args[1:]
        hopper = x.device.type == "cuda" and not _before_hopper(x.device)  # (the interpreter runs no wgmma)
        _mma_kernel[grid](*args, m, n, k, x.stride(0), n, m * n, DOT_DTYPE=dot_dtype, X_DESCRIPTOR=bool(descriptor),
                          WAIT_FOR_WGMMAS=hopper and fields > 1,
                          DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", PAIRS=pairs,
                          BLOCK_M=config.block_m, GROUP_M=8, EVEN=even, FIELDS_PER_DOT=fields, **flags)


def quant_matmul(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, written into `out` if given, with `config` or the tuned one."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.qweight.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape [{m}, {n}], got {out.dtype} "
                         f"{list(out.shape)}")
    if m == 0:
        return out
    tensors = (x, weight.qweight, weight.scale_zero, weight.perm, bias, weight.locks)
    if config is None:
        config = choose_config(*tensors, weight.bits, weight.group_size, out)
    launch(config, *tensors, weight.bits, weight.group_size, out)
    return out


@quant_linear_op("litquant::triton_quant_linear")
def triton_quant_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, perm: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], locks: torch.Tensor, bits: int, group_size: int,
                        out_features: int) -> torch.Tensor:
    """The custom op behind `TritonQuantLinear.forward`: x [..., K] -> [..., out_features]. `locks` are counted
    on and reset within the call (as marlin's), so the op declares no mutation."""
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    weight = PackedWeight(qweight, scale_zero, perm, locks, bits, group_size)
    quant_matmul(x.reshape(-1, x.shape[-1]), weight, bias, out.view(-1, out_features))
    return out


class TritonQuantLinear(QuantLinear):
    name = "triton"
    bits = SUPPORTED_BITS
    group_sizes = (32, 64, 128, 256, -1)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    devices = ("cuda", "cpu") if INTERPRET else ("cuda",)
    auto_devices = ("cuda",)  # the interpreter is for tests, never a choice for `auto`
    min_capability = (8, 0)
    description = "fused dequant-matmul in Triton: gemv / split-K / tensor cores / dequant+cuBLAS, autotuned per M"
    # qweight [C, N, 16], scale_zero [G, N]; the locks are zeroed counters, enough for the sum of the columns
    concat_dims = {"qweight": 1, "scale_zero": 1, "perm": None, "locks": 0}

    @classmethod
    def unavailable(cls) -> Optional[str]:
        if INTERPRET or torch.cuda.is_available():
            return None
        return "needs a CUDA GPU (or TRITON_INTERPRET=1 set before import, to run it slowly on the CPU)"

    def load_quantized(self, qw: QuantizedWeight) -> None:
        if (qw.bits, qw.group_size, qw.in_features, qw.out_features) != (
                self.spec.bits, self.spec.group_size, self.in_features, self.out_features):
            raise ValueError(f"weight is {qw.bits}-bit g{qw.group_size} {qw.in_features}x{qw.out_features}, the "
                             f"layer expects {self.spec.bits}-bit g{self.spec.group_size} "
                             f"{self.in_features}x{self.out_features}")
        packed = repack(qw)
        for name in ("qweight", "scale_zero", "perm"):
            self.register_buffer(name, getattr(packed, name))
        self.register_buffer("locks", packed.locks, persistent=False)
        self.set_bias(qw.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_quant_linear(x, self.qweight, self.scale_zero, self.perm, self.bias, self.locks,
                                   self.spec.bits, self.spec.group_size, self.out_features)
