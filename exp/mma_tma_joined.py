import triton
import triton.language as tl

from litquant.kernels.triton_kernel import _fields_side_by_side, _group_params, _split_chunks, _write_result


@triton.jit
def _mma_tma_kernel(x_desc, qweight_ptr, scale_zero_ptr, perm_ptr, bias_ptr, out_ptr, partials_ptr, locks_ptr,
                    M, N, K, stride_xm, stride_om, stride_split,
                    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, GROUP_PER_CHUNK: tl.constexpr,
                    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIRS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WORDS: tl.constexpr,
                    FIELDS_PER_DOT: tl.constexpr, EVEN: tl.constexpr):
    VALUES: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = VALUES * WORDS
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    first, last = _split_chunks(tl.cdiv(K, ROWS), pid_k)
    tl.assume(first < last)
    tile = qweight_ptr + offs_n[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for c in range(first, last):
        words = tl.load(tile + c * N * WORDS)
        params = _group_params(scale_zero_ptr, c * ROWS, GROUP_SIZE, offs_n, n_mask, N, K)
        w = _fields_side_by_side(words, params, scale_zero_ptr, c * ROWS, 0, VALUES, offs_n, n_mask, N, K,
                                 GROUP_SIZE, GROUP_PER_CHUNK, BITS, DOT_DTYPE, PAIRS)
        xt = x_desc.load([pid_m * BLOCK_M, c * ROWS]).T
        acc = tl.dot(w, xt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    _write_result(acc, bias_ptr, out_ptr, partials_ptr, locks_ptr, pid, offs_m[None, :] * stride_om + offs_n[:, None],
                  offs_n[:, None], n_mask[:, None] & m_mask[None, :], stride_split, HAS_BIAS, FINAL)
