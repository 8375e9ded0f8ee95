"""The Triton programs of the `triton` kernel (`triton_kernel` packs the weights, picks and launches them).

    gemv_kernel     decode: fp32 FMAs on the CUDA cores, split-K, a cp.async pipeline over the chunks
    mma_kernel      tensor cores, the weights dequantized in 16 bits in the dot operand's registers
    dequant_kernel  the whole weight in the activation dtype, for cuBLAS at large M
Each reads the layout that `triton_kernel.repack` writes (see that module's docstring). The Gluon wgmma kernel
(`triton_wgmma`) shares the 16-bit dequantization (`BF16_PAIR_ASM`, `FP16_PAIR_ASM`) and the tile order (`grouped_tile`).

Dequantization without int-to-float conversions
    A field q shifted under the exponent of 1.0 (one shift, one AND/OR) is the fp32 value f = 1 + q / 2**bits,
    exactly: the "magic number" conversion that FasterTransformer and Marlin use in fp16, here in fp32 so every
    bit width fits. Then f + zeros = (q - z) / 2**bits exactly, with zeros = -(1 + z / 2**bits), and the weight is
    2**bits * s * (f + zeros). The mma path dequantizes in 16 bits instead (`_field_pairs`).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _group_params(scale_zero_ptr, first_row, group_size: tl.constexpr, offs_n, n_mask, N, K):
    """The packed scale and zero point (int32, see `triton_kernel.repack`) of the group of sorted input row(s)
    `first_row`, for columns `offs_n` (broadcast together: [BLOCK_N] for one row, [BLOCK_N, G] for rows [1, G] and
    columns [BLOCK_N, 1]). Padding rows past K (whose activations are 0) take the last group, as theirs may not
    exist."""
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
def gemv_kernel(x_ptr, qweight_ptr, scale_zero_ptr, perm_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr,
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
BF16_PAIR_ASM = tl.constexpr(_PAIR_ASM.replace("ONE", "0x3F803F80").replace("MAGIC", "0x43004300")
                              .replace("TYPE", "bf16x2"))
FP16_PAIR_ASM = tl.constexpr(_PAIR_ASM.replace("ONE", "0x3C003C00").replace("MAGIC", "0x64006400")
                              .replace("TYPE", "f16x2"))
PAIR_CONSTRAINTS = tl.constexpr("=r" + ",r" * 10)  # 2 input registers an operand, 1 for the 16-bit s and -b


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
        w = tl.inline_asm_elementwise(BF16_PAIR_ASM, PAIR_CONSTRAINTS, operands, dtype=s.dtype, is_pure=True, pack=2)
    else:
        w = tl.inline_asm_elementwise(FP16_PAIR_ASM, PAIR_CONSTRAINTS, operands, dtype=s.dtype, is_pure=True, pack=2)
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
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
def mma_kernel(x_ptr, qweight_ptr, scale_zero_ptr, perm_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr,
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
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

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
def dequant_kernel(qweight_ptr, scale_zero_ptr, w_ptr, N, K,
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


