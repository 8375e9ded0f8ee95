"""The `marlin` kernel: a Marlin-class fused 4-bit GEMM on the tensor cores (litquant/csrc/marlin/marlin.cu), and 8-bit
weights through the same kernels as two 4-bit planes (`nibble_planes`).

At load, the weight is repacked (vectorized torch, on the target device) into the kernel's layout:
16 x 64 weight tiles permuted so that each lane of a warp loads the B fragments of its mma.m16n8k16
instructions with one 16-byte load, with nibbles interleaved for the exponent-trick dequantization;
scales and zero points permuted to match. act_order is handled by sorting the rows by group once at
load and gathering the activation columns in the same order on each call.

Decode (M <= 16, and <= 32 on layers twice as wide as deep or as deep as wide; K a multiple of 128) streams
the weights straight into registers (litquant/csrc/marlin/decode.cu) and multiplies them on mma.sync with the tokens
as the 8-wide operand, the codes unscaled (biased up to 8 rows, centered on their zero point above), each group's
scale (and zero point) applied to the fp32 sums. Larger M takes mma.sync with a shared-memory pipeline
(litquant/csrc/marlin/marlin.cu, any GPU from sm_80) or, on Hopper, wgmma (litquant/csrc/marlin/wgmma.cu); the op
picks one per call. For many rows (M >= `dense_from_m`, by GPU) the weight is
dequantized once per call and multiplied by cuBLAS, when that is the faster way.
"""
from typing import ClassVar, Optional, Tuple

import torch
import torch.nn.functional as F

from litquant.formats import QuantizedWeight
from litquant.formats.common import default_g_idx, num_groups, to_int32
from litquant.kernels import build
from litquant.kernels.base import QuantLinear

# Nibble p of a weight word holds logical value NIBBLE_ORDER[p] of the lane's 8 values
# (b0 b1 b2 b3 of subtile 2j, then of subtile 2j + 1): masking nibbles {0, 4} gives the pair (0, 1),
# nibbles {1, 5} the pair (2, 3), and so on.
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TILE_K, TILE_N = 16, 64  # one warp tile
ROWS_PER_PASS = 32  # the mma.sync kernel's rows per pass over the weight past 48 rows (marlin.cu: row_blocks)


def tile_positions(device=None) -> torch.Tensor:
    """[32 lanes, 4 words, 8 nibbles] -> row * 64 + column, inside a 16 x 64 tile, of the value stored there.

    Lane l holds, for each n8 subtile s, the B fragment of mma.m16n8k16: column 8s + l/4 and rows
    2(l%4) + {0, 1} (register b0b1) and 2(l%4) + {8, 9} (register b2b3). Word j holds subtiles 2j, 2j+1.
    """
    lane = torch.arange(32, device=device).view(32, 1, 1)
    word = torch.arange(4, device=device).view(1, 4, 1)
    value = torch.tensor(NIBBLE_ORDER, device=device).view(1, 1, 8)
    subtile, register = 2 * word + value // 4, value % 4
    row = 2 * (lane % 4) + register % 2 + 8 * (register // 2)
    col = 8 * subtile + lane // 4
    return row * TILE_N + col


def repack_weight(codes: torch.Tensor, rows_per_slab: int = 4096) -> torch.Tensor:
    """4-bit codes uint8 [K, N] -> the marlin layout, int32 [K/16, 2N] (one uint4 per lane per 16 x 64 tile).

    Works through `rows_per_slab` rows of K at a time to bound the int64 temporaries.
    """
    k, n = codes.shape
    positions = tile_positions(codes.device).view(-1)
    shifts = 4 * torch.arange(8, device=codes.device)
    out = torch.empty(k // TILE_K, 2 * n, dtype=torch.int32, device=codes.device)
    for start in range(0, k, rows_per_slab):
        slab = codes[start:start + rows_per_slab]
        kt = slab.shape[0] // TILE_K
        tiles = slab.view(kt, TILE_K, n // TILE_N, TILE_N).permute(0, 2, 1, 3).reshape(kt, n // TILE_N, TILE_K * TILE_N)
        nibbles = tiles.index_select(2, positions).view(kt, n // TILE_N, 32, 4, 8).to(torch.int64)
        words = (nibbles << shifts).sum(-1)
        out[start // TILE_K:start // TILE_K + kt] = to_int32(words).view(kt, 2 * n)
    return out


def permute_scales(scales: torch.Tensor) -> torch.Tensor:
    """[G, N] -> [G, N] with column 8s + i of each 64-column tile at position 8i + s, so lane l finds
    the scales of its 8 subtiles (column l/4 of each) in 16 contiguous bytes."""
    g, n = scales.shape
    return scales.reshape(g, n // TILE_N, 8, 8).transpose(-1, -2).reshape(g, n).contiguous()


def pack_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """Zero points uint8 [G, N] -> int32 [G, N/4]: for each 64-column tile and lane group i = l/4, two
    words; word w holds the zero of subtile 4w + t (column 8(4w + t) + i) at nibbles t and t + 4, so that
    masking nibbles {t, t + 4} yields the zero of one subtile in both halves."""
    g, n = zeros.shape
    z = zeros.reshape(g, n // TILE_N, 2, 4, 8).to(torch.int64)  # [G, tile, w, t, i]
    low = (z << (4 * torch.arange(4, device=zeros.device)).view(1, 1, 1, 4, 1)).sum(3)  # [G, tile, w, i]
    words = low | (low << 16)
    return to_int32(words.permute(0, 1, 3, 2).reshape(g, n // 4)).contiguous()


def nibble_planes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """An 8-bit weight (codes uint8 [K, N], K a multiple of 128, rows in group order; scales [G, N]; zeros uint8
    [G, N]) as the same weight in 4 bits over 2K input rows, for the 4-bit kernels with the activations given
    twice ([x, x]). Returns (codes, fp32 scales, zeros, group size) of that 4-bit weight.

    With q = 16 q_hi + q_lo and z = 16 z_hi + z_lo, s (q - z) = 16 s (q_hi - z_hi) + s (q_lo - z_lo): rows
    0..K-1 hold the high nibbles with scale 16 s and zero point z_hi, rows K..2K-1 the low nibbles with scale s
    and zero point z_lo. Exact, and as many bytes as the 8-bit codes: the kernels stream 4 bytes per 8 weights
    either way, so decode (memory bound) runs at the 4-bit kernels' bandwidth; the tensor cores do twice the
    products, which large M pays for. Group size -1 becomes 128 (the one scale repeated), so that the low plane's
    groups start at group K / 128."""
    if group_size == -1:
        group_size = 128
        scales, zeros = scales.expand(codes.shape[0] // 128, -1), zeros.expand(codes.shape[0] // 128, -1)
    scales = scales.to(torch.float32)
    return (torch.cat([codes >> 4, codes & 15]), torch.cat([16 * scales, scales]), torch.cat([zeros >> 4, zeros & 15]),
            group_size)


def without_zero_scales(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same weight (codes uint8 [K, N], rows in group order; scales [G, N]; zeros uint8 [G, N]) with no
    scale that is 0 in `dtype`: such a group (all its weights 0) gets scale 1 and every code equal to its zero
    point. The decode kernel keeps its sums in units of the current group's scale (litquant/csrc/marlin/decode.cu) and
    divides by it. Scales below 2**-100 in magnitude count as 0 (their weights, under 2**-96, would overflow
    that division)."""
    dead = scales.to(dtype).float().abs() < 2.0**-100  # (in fp32: 2**-100 is 0 in fp16)
    if not bool(dead.any()):
        return codes, scales
    group_of_row = default_g_idx(codes.shape[0], group_size, codes.device).long()
    codes = torch.where(dead[group_of_row], zeros[group_of_row].to(codes.dtype), codes)
    return codes, scales.masked_fill(dead, 1)


def _register_fakes() -> None:
    """Shapes of the ops for torch.compile / meta tensors (the out= ops mutate in place and return nothing)."""

    @torch.library.register_fake("litquant_marlin::gemm")
    def _(x, qweight, scales, zeros, bias, locks, group_size, after_small_kernel=False):
        return x.new_empty(x.shape[0], scales.shape[1])

    @torch.library.register_fake("litquant_marlin::gemm_out")
    def _(x, qweight, scales, zeros, bias, locks, group_size, out, after_small_kernel=False):
        return None

    @torch.library.register_fake("litquant_marlin::dequant_out")
    def _(qweight, scales, zeros, group_size, out):
        return None


def load_ops(device: torch.device = None):
    """Build (first use) and load the CUDA ops; returns `torch.ops.litquant_marlin`."""
    first = not hasattr(torch.ops.litquant_marlin, "gemm")
    build.load("marlin", device)
    if first:
        _register_fakes()
    return torch.ops.litquant_marlin


class MarlinQuantLinear(QuantLinear):
    name = "marlin"
    description = ("fused 4-bit GEMM (Marlin-class, tensor cores), 8-bit as two 4-bit planes, fp16/bf16, sm_80+; "
                   "built on first use")
    bits = (4, 8)
    auto_bits = (4,)  # 8-bit decode (M = 1) is faster on triton: benchmarks/results/2026-12-01-kernels-8bit-v3.md
    group_sizes = (-1, 32, 64, 128)
    zero_point = True
    act_order = True
    dtypes = (torch.float16, torch.bfloat16)
    devices = ("cuda",)
    min_capability = (8, 0)
    # Warp tiles are 16 x 64, and block tiles need K or N to be a multiple of 128: K and N must be
    # multiples of 64, and when neither is a multiple of 128, K is padded with zero rows at load.
    k_multiple = 64
    n_multiple = 64
    # From this many rows on, dequantize once + cuBLAS beats the fused kernel. mma.sync: the Ampere build run on
    # an H200 (LITQUANT_CUDA_ARCH=8.0), all six Llama-2 7B/70B layers, bf16 g128: fused faster at M=128 on all six
    # (3-31%), dense faster at M=160 on all six (2-19%) (benchmarks/results/2026-12-02-mma-rows-and-slots.md).
    # Not measured on an A100, nor for 8-bit weights (two planes), which take the same threshold.
    mma_dense_from_m: ClassVar[int] = 160
    # wgmma (Hopper), bf16 g128, all six Llama-2 7B/70B layers (benchmarks/dense_threshold.py,
    # results/2026-12-01-dense-threshold.log): 4-bit fused 4-10% faster than dense at M=1024, at 1536 2-10%
    # faster on four layers and 1-16% slower on the two down projections, at 2048 dense 5-20% faster on all six.
    # Dequantizing in column chunks small enough to stay in L2 (one reused buffer, a GEMM per chunk) was 0.5-5%
    # faster at M=4096 and up to 20% slower at M=1024-2048 (results/2026-12-01-dense-chunks.log): not kept.
    # With 128-k stages (results/2026-12-02-dense-threshold-stage128.log) fused is 2-10% faster at M=1536 on all
    # six, at 2048 1-7% faster on five and 11% slower on 70B-down, at 3072 faster on three: dense from 2048.
    # Timed settled (each path after 0.5 s of its own calls, results/2026-12-02-dense-threshold-settled.log), and
    # with 70B-down's tiles whole past the L2 (wgmma.cu `plan_wgmma`), fused is faster than dense on all six at
    # M=2048 and 3072, on five of six at 6144 and 8192 and on four at 4096 (by 0-5%; 70B-qkv level there); only
    # 7B-down is 3-8% faster dense from 4096. Dense from 16384, where dense should be within ~1-2% of cuBLAS (2-4%
    # at 8192; extrapolated: M > 8192 not timed).
    wgmma_dense_from_m: ClassVar[int] = 16384
    # 8-bit: the fused kernels do twice the tensor-core work (two planes), the dense path one dequantization
    # (litquant_marlin_dequant adds the planes). Level at M=192..256 (each faster on three layers), dense
    # 30-50% faster from M=320 on.
    wgmma_dense_from_m_8bit: ClassVar[int] = 257
    # Every buffer is laid out by 64-column tile along its last dim (the locks are zeroed counters, enough
    # for the sum of the columns).
    concat_dims = {"qweight": 1, "scales": 1, "zeros": 1, "perm": None, "locks": 0}

    @classmethod
    def unavailable(cls):
        return build.unavailable_reason(cls.name)

    @classmethod
    def prepare(cls, device):
        try:
            load_ops(device)
        except (build.BuildError, RuntimeError, OSError) as e:  # torch's builder raises RuntimeError
            return f"the CUDA build failed: {e}"
        return None

    def load_quantized(self, qw: QuantizedWeight) -> None:
        if qw.bits not in self.bits:
            raise ValueError(f"marlin supports 4-bit and 8-bit weights, not {qw.bits}-bit")
        k, n = qw.in_features, qw.out_features
        if k % self.k_multiple or n % self.n_multiple:
            raise ValueError(f"marlin needs in_features a multiple of {self.k_multiple} and out_features a "
                             f"multiple of {self.n_multiple}, got {k}x{n}")
        if qw.group_size not in self.group_sizes:
            raise ValueError(f"marlin supports group_size {'/'.join(map(str, self.group_sizes))}, not {qw.group_size}")
        codes, perm = qw.codes, qw.rows_by_group("marlin")
        if perm is not None:  # the activations are gathered in the same order on every call
            codes = codes[perm]
        scales, zeros, group_size = qw.scales, qw.zeros, qw.group_size
        codes, scales = without_zero_scales(codes, scales, zeros, group_size, self.dtype)
        # Input rows per weight plane (the activations get zero columns to match: no effect on y). 8-bit weights
        # are two planes, each a multiple of 128 rows so that the second one starts at a group boundary.
        self.planes = 2 if qw.bits == 8 else 1
        pad = k % 128 != 0 and (n % 128 != 0 or self.planes == 2)
        self.padded_in_features = -(-k // 128) * 128 if pad else k
        if self.padded_in_features != k:
            groups = num_groups(self.padded_in_features, group_size)
            codes = torch.cat([codes, codes.new_zeros(self.padded_in_features - k, n)])
            scales = torch.cat([scales, scales.new_ones(groups - scales.shape[0], n)])  # (see without_zero_scales)
            zeros = torch.cat([zeros, zeros.new_full((groups - zeros.shape[0], n), 8)])
        if self.planes == 2:
            codes, scales, zeros, group_size = nibble_planes(codes, scales, zeros, group_size)
        scales = permute_scales(scales).to(self.dtype)
        if not torch.isfinite(scales).all():
            raise ValueError(f"marlin: a scale of this weight overflows {str(self.dtype).replace('torch.', '')}"
                             f"{' (8-bit weights need 16 x scale)' if self.planes == 2 else ''}; run it in bfloat16")
        self.group_size = group_size
        self.register_buffer("perm", perm)
        self.register_buffer("qweight", repack_weight(codes.contiguous()))
        self.register_buffer("scales", scales)
        # 8-bit symmetric weights (z = 128) still need zero points: z_lo = 0 in the low plane
        self.register_buffer("zeros", None if qw.sym and self.planes == 1 else pack_zeros(zeros))
        hopper = codes.is_cuda and build.built_capability(codes.device) == (9, 0)
        wgmma_dense_from_m = self.wgmma_dense_from_m_8bit if self.planes == 2 else self.wgmma_dense_from_m
        self.dense_from_m = wgmma_dense_from_m if hopper else self.mma_dense_from_m
        # Locks: the mma.sync path's (one per 64 columns and pass of rows) or the wgmma path's (one per
        # tile shared between blocks: fewer than two per SM).
        chunks = -(-(self.mma_dense_from_m - 1) // ROWS_PER_PASS)
        sms = torch.cuda.get_device_properties(codes.device).multi_processor_count if codes.is_cuda else 0
        self.register_buffer("locks", torch.zeros(max(chunks * (n // 64), 2 * sms), dtype=torch.int32,
                                                  device=codes.device))
        self.set_bias(qw.bias)
        if codes.is_cuda:
            load_ops(codes.device)
            # On Hopper the kernels start streaming the weight words before the kernel ahead of them in the
            # stream has ended (programmatic dependent launch, litquant/csrc/marlin/common.cuh): the repack must be
            # done.
            torch.cuda.synchronize(codes.device)

    def concat(self, other: QuantLinear) -> Optional[QuantLinear]:
        fused = super().concat(other)
        if fused is not None and fused.qweight.is_cuda:
            torch.cuda.synchronize(fused.qweight.device)  # as after a repack: dependent launches read weights early
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_shape = (*x.shape[:-1], self.out_features)
        x = x.reshape(-1, self.in_features).to(self.scales.dtype)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.padded_in_features != self.in_features:
            x = F.pad(x, (0, self.padded_in_features - self.in_features))
        ops = torch.ops.litquant_marlin
        if x.shape[0] >= self.dense_from_m:
            # (two planes: the kernel writes their sum)
            w = torch.empty(self.padded_in_features, self.out_features, dtype=x.dtype, device=x.device)
            ops.dequant_out(self.qweight, self.scales, self.zeros, self.group_size, w)
            y = torch.mm(x, w) if self.bias is None else torch.addmm(self.bias, x, w)
        else:
            y = ops.gemm(self.kernel_input(x), self.qweight, self.scales, self.zeros, self.bias, self.locks,
                         self.group_size, self.after_small_kernels)
        return y.view(out_shape)

    def locks_for(self, rows: int) -> torch.Tensor:
        """Zeroed locks for a fused call of `rows` rows on any path, past `dense_from_m` too (one per 16 rows and 64
        columns: more than any path takes); the module's own serve its calls below `dense_from_m`."""
        return torch.zeros(-(-rows // 16) * (self.out_features // 64), dtype=torch.int32, device=self.qweight.device)

    def kernel_input(self, x: torch.Tensor) -> torch.Tensor:
        """The fused kernel's activations for x (permuted and padded): x itself, or [x, x] for the two planes."""
        return torch.cat([x, x], 1) if self.planes == 2 else x
