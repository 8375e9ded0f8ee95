"""The marlin kernel: its weight layout, checked on the CPU by emulating what the GPU lanes decode,
and (on a GPU) its outputs against the torch reference kernel."""
import zlib

import pytest
import torch

from litquant.formats import QuantizedWeight
from litquant.formats.common import default_g_idx, num_groups
from litquant.kernels import select_kernel
from litquant.kernels.base import LayerSpec
from litquant.kernels.marlin import MarlinQuantLinear, pack_zeros, permute_scales, repack_weight
from litquant.kernels.torch_dequant import TorchQuantLinear


@pytest.fixture(autouse=True)
def seeded(request):
    """Fresh random inputs in every test, the same each run of it (seeded from its id), so a failure replays."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def random_quantized_weight(k: int, n: int, group_size: int, sym: bool, act_order: bool, device="cpu",
                            bias: bool = False, bits: int = 4) -> QuantizedWeight:
    """Random codes, scales, zero points and (for act_order) a GPTQ-style shuffled g_idx."""
    groups = num_groups(k, group_size)
    codes = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, device=device)
    scales = (torch.rand(groups, n, device=device) * 0.02 + 0.002).half()
    zeros = (torch.full((groups, n), 2 ** (bits - 1), dtype=torch.uint8, device=device) if sym
             else torch.randint(0, 2**bits, (groups, n), dtype=torch.uint8, device=device))
    if act_order:  # rows quantized in a random order, group i = the i-th run of group_size rows of that order
        order = torch.randperm(k, device=device)
        g_idx = torch.empty(k, dtype=torch.int32, device=device)
        g_idx[order] = (torch.arange(k, device=device) // group_size).to(torch.int32)
    else:
        g_idx = default_g_idx(k, group_size, device)
    b = torch.randn(n, device=device).half() if bias else None
    return QuantizedWeight(codes, scales, zeros, g_idx, bits, group_size, b)


def marlin_module(qw: QuantizedWeight, dtype: torch.dtype) -> MarlinQuantLinear:
    spec = LayerSpec(qw.in_features, qw.out_features, qw.bits, qw.group_size, qw.sym, qw.act_order)
    module = MarlinQuantLinear(qw.in_features, qw.out_features, qw.bias is not None, spec, dtype)
    module.load_quantized(qw)
    return module


# ------------------------------------------------------------------------------------------------
# CPU emulation of the device side: what each lane decodes from the repacked tensors
# ------------------------------------------------------------------------------------------------
MAGIC = {torch.float16: 0x6400, torch.bfloat16: 0x4300}  # 1024.0 and 128.0


def _halves(word: torch.Tensor, dtype: torch.dtype):
    """The two 16-bit halves of int64-held 32-bit words, reinterpreted as `dtype`."""
    as_float = lambda h: h.to(torch.int16).view(dtype)  # noqa: E731
    low, high = word & 0xFFFF, word >> 16
    return as_float(torch.where(low >= 2**15, low - 2**16, low)), as_float(torch.where(high >= 2**15, high - 2**16, high))


def emulate_lane_pairs(word: torch.Tensor, dtype: torch.dtype):
    """The kernel's extraction of one weight word into its 4 pairs, as (low, high) halves in `dtype`.

    fp16: masks 0x000f000f / 0x00f000f0 OR 0x6400, before and after >> 8; the high-mask pairs hold
    1024 + 16q. bf16: mask 0x000f000f OR 0x4300 after >> 0, 4, 8, 12; every pair holds 128 + q.
    """
    magic = MAGIC[dtype] | MAGIC[dtype] << 16
    if dtype == torch.float16:
        raw = [(word & 0x000F000F) | magic, (word & 0x00F000F0) | magic,
               ((word >> 8) & 0x000F000F) | magic, ((word >> 8) & 0x00F000F0) | magic]
    else:
        raw = [((word >> (4 * i)) & 0x000F000F) | magic for i in range(4)]
    return [_halves(r, dtype) for r in raw]


def emulate_dequant(module: MarlinQuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight [K, N] (rows in the kernel's order; both planes of an 8-bit weight) as the GPU
    lanes compute it. Loops over (lane, word) only; each step is vectorized over all 16 x 64 tiles. Every
    product of two fp16/bf16 numbers is exact in fp32, so `(a.float() * b.float()).to(dtype)` is the device's
    hmul2."""
    k, n = module.planes * module.padded_in_features, module.out_features
    words = module.qweight.view(k // 16, n // 64, 32, 4).to(torch.int64) & 0xFFFFFFFF
    scales = module.scales.view(-1, n // 64, 64)
    zeros = (module.zeros.view(-1, n // 64, 8, 2).to(torch.int64) & 0xFFFFFFFF if module.zeros is not None
             else torch.full((scales.shape[0], n // 64, 8, 2), 0x88888888, dtype=torch.int64))
    g_of_tile = default_g_idx(k, module.group_size)[::16].long()  # group of each k16 tile
    w = torch.empty(k // 16, 16, n // 64, 64, dtype=dtype)
    for lane in range(32):
        for j in range(4):
            for i, (lo, hi) in enumerate(emulate_lane_pairs(words[:, :, lane, j], dtype)):
                s = 2 * j + i // 2  # subtile
                scale = scales[g_of_tile, :, (lane // 4) * 8 + s].float()  # [K/16, N/64]
                zw = zeros[g_of_tile, :, lane // 4, s // 4] >> (4 * (s % 4))
                zero_lo, zero_hi = _halves((zw & 0x000F000F) | (MAGIC[dtype] | MAGIC[dtype] << 16), dtype)
                assert torch.equal(zero_lo, zero_hi), "the zero point must come out in both halves"
                row, col = 2 * (lane % 4) + 8 * (i % 2), 8 * s + lane // 4
                for r, v in ((row, lo), (row + 1, hi)):
                    if dtype == torch.float16 and i % 2:  # fma(x, 1/16, 960 - (1024 + z)): exact
                        q_minus_z = (v.float() / 16 + (960 - zero_lo.float())).to(dtype)
                    else:  # x - (magic + z): exact
                        q_minus_z = (v.float() - zero_lo.float()).to(dtype)
                    w[:, r, :, col] = (q_minus_z.float() * scale).to(dtype)
    return w.reshape(k, n)


def expected_weight(qw: QuantizedWeight, dtype: torch.dtype, perm=None) -> torch.Tensor:
    """(q - z) * s with the scale in `dtype` and one rounding, as the torch kernel computes on a GPU; [K, N]."""
    g = qw.g_idx.long()
    w = (qw.codes.float() - qw.zeros[g].float()) * qw.scales.to(dtype)[g].float()
    w = w.to(dtype)
    return w if perm is None else w[perm]


def test_repack_places_every_code_where_the_lanes_read_it():
    k, n = 64, 192
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    words = repack_weight(codes).view(k // 16, n // 64, 32, 4).to(torch.int64) & 0xFFFFFFFF
    decoded = torch.empty(k // 16, 16, n // 64, 64, dtype=torch.uint8)
    for lane in range(32):
        for j in range(4):
            w = words[:, :, lane, j]
            # the fp16 extraction: pairs (0,1), (2,3) from nibbles {0,4}, {1,5}; then the same after >> 8
            pairs = [w & 0x000F000F, (w & 0x00F000F0) >> 4, (w >> 8) & 0x000F000F, ((w >> 8) & 0x00F000F0) >> 4]
            for i, p in enumerate(pairs):
                s = 2 * j + i // 2
                row, col = 2 * (lane % 4) + 8 * (i % 2), 8 * s + lane // 4  # mma.m16n8k16 B fragment
                decoded[:, row, :, col] = (p & 0xFFFF).to(torch.uint8)
                decoded[:, row + 1, :, col] = (p >> 16).to(torch.uint8)
    assert torch.equal(decoded.reshape(k, n), codes)


def test_repack_slabs_agree_with_one_pass():
    codes = torch.randint(0, 16, (256, 128), dtype=torch.uint8)
    assert torch.equal(repack_weight(codes, rows_per_slab=64), repack_weight(codes))


def test_scale_permutation_puts_a_lanes_scales_together():
    scales = torch.arange(2 * 128, dtype=torch.float32).view(2, 128)
    permuted = permute_scales(scales).view(2, 2, 64)
    for lane in range(32):
        for s in range(8):  # the lane's 8 scales are at 8 * (lane // 4) + s: column 8s + lane // 4
            assert torch.equal(permuted[:, :, 8 * (lane // 4) + s], scales.view(2, 2, 64)[:, :, 8 * s + lane // 4])


def test_zero_packing_decodes_to_each_subtiles_zero():
    zeros = torch.randint(0, 16, (3, 128), dtype=torch.uint8)
    words = pack_zeros(zeros).view(3, 2, 8, 2).to(torch.int64) & 0xFFFFFFFF
    for lane in range(32):
        for s in range(8):
            w = (words[:, :, lane // 4, s // 4] >> (4 * (s % 4))) & 0x000F000F
            assert torch.equal(w & 0xF, zeros.view(3, 2, 64)[:, :, 8 * s + lane // 4].long())
            assert torch.equal(w >> 16, w & 0xF)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, sym, act_order", [(-1, True, False), (32, False, False), (128, True, True),
                                                        (64, False, True)])
def test_emulated_dequant_is_bit_exact(dtype, group_size, sym, act_order):
    qw = random_quantized_weight(256, 128, group_size, sym, act_order)
    module = marlin_module(qw, dtype)
    perm = None if module.perm is None else module.perm.long()
    assert torch.equal(emulate_dequant(module, dtype), expected_weight(qw, dtype, perm))


def test_k_is_padded_when_neither_dimension_is_a_multiple_of_128():
    qw = random_quantized_weight(192, 320, 32, sym=False, act_order=True)
    module = marlin_module(qw, torch.float16)
    assert module.padded_in_features == 256 and module.qweight.shape == (256 // 16, 2 * 320)
    w = emulate_dequant(module, torch.float16)
    assert torch.equal(w[:192], expected_weight(qw, torch.float16, module.perm.long()))
    assert torch.isfinite(w[192:]).all()
    assert marlin_module(random_quantized_weight(192, 256, 64, True, False), torch.float16).padded_in_features == 192


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero_scales_become_scale_one_with_the_codes_at_the_zero_point(dtype):
    """The decode kernel divides by the scales: a group of scale 0 must reach it as scale 1 with q = z, the same
    (zero) weights."""
    qw = random_quantized_weight(256, 128, 64, sym=False, act_order=True)
    qw.scales[1, 5] = 0
    qw.scales[3, :70] = 0
    module = marlin_module(qw, dtype)
    assert (module.scales != 0).all()
    assert torch.equal(emulate_dequant(module, dtype), expected_weight(qw, dtype, module.perm.long()))


def test_act_order_permutes_rows_and_columns_consistently():
    qw = random_quantized_weight(256, 64, 64, sym=False, act_order=True)
    module = marlin_module(qw, torch.bfloat16)
    x = torch.randn(3, 256)
    w_kernel = emulate_dequant(module, torch.bfloat16).float()
    y = x[:, module.perm.long()] @ w_kernel  # what the kernel computes from the gathered activations
    ref = x @ expected_weight(qw, torch.bfloat16).float()
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_bad_weights_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="marlin needs in_features a multiple of 64 and out_features a multiple of 64, "
                                         "got 96x64"):
        marlin_module(random_quantized_weight(96, 64, 32, True, False), torch.float16)
    with pytest.raises(ValueError, match="marlin supports group_size -1/32/64/128, not 256"):
        marlin_module(random_quantized_weight(256, 64, 256, True, False), torch.float16)
    qw = random_quantized_weight(128, 64, 32, True, False)
    qw.g_idx = torch.randint(0, 4, (128,), dtype=torch.int32)  # groups of uneven sizes
    with pytest.raises(ValueError, match=r"marlin's act_order needs every group to hold exactly group_size rows \(as "
                                         r"GPTQ desc_act writes them\); this g_idx does not"):
        marlin_module(qw, torch.float16)
    qw3 = random_quantized_weight(128, 64, 32, True, False)
    qw3.bits = 3
    with pytest.raises(ValueError, match="marlin supports 4-bit and 8-bit weights, not 3-bit"):
        marlin_module(qw3, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, sym, act_order", [(-1, True, False), (64, False, True), (128, False, False),
                                                        (32, True, True)])
def test_8bit_weights_are_two_nibble_planes(dtype, group_size, sym, act_order):
    """An 8-bit weight runs as 4-bit high nibbles (scale 16 s) over 4-bit low nibbles (scale s), each plane padded
    to 128 rows; their sum is the weight, within one rounding of each plane's values in `dtype`."""
    qw = random_quantized_weight(192, 128, group_size, sym, act_order, bits=8)
    module = marlin_module(qw, dtype)
    rows = module.padded_in_features
    assert (module.planes, rows, module.qweight.shape) == (2, 256, (2 * 256 // 16, 2 * 128))
    w = emulate_dequant(module, dtype).float()
    weight = (w[:rows] + w[rows:])[:192]
    perm = None if module.perm is None else module.perm.long()
    exact = expected_weight(qw, torch.float32, perm)
    g = qw.g_idx.long()
    codes, zeros, scales = qw.codes.long(), qw.zeros[g].long(), qw.scales[g].float()
    parts = (16 * ((codes >> 4) - (zeros >> 4)).abs() + ((codes & 15) - (zeros & 15)).abs()) * scales
    parts = parts if perm is None else parts[perm]
    eps = torch.finfo(dtype).eps
    assert ((weight - exact).abs() <= eps * parts).all()


def test_8bit_scales_that_overflow_fp16_are_refused():
    qw = random_quantized_weight(128, 64, 128, True, False, bits=8)
    qw.scales.fill_(5000.0)  # 16 x 5000 is past fp16's 65504
    with pytest.raises(ValueError, match="overflows float16.*16 x scale"):
        marlin_module(qw, torch.float16)
    assert marlin_module(qw, torch.bfloat16).scales.isfinite().all()


# ------------------------------------------------------------------------------------------------
# GPU: outputs against the torch reference kernel
# ------------------------------------------------------------------------------------------------
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # ||out - ref|| / ||ref||
ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 24, 32, 33, 64, 100, 150, 190, 255, 256, 300, 520, 600, 800, 1024, 4096)
# (the attention outputs of Llama-2-70B, 8192 x 8192, and -7B, 4096 x 4096, take decode.cu's wide blocks on Hopper:
# 4 splits -> 2 of 8 warps)
LLAMA_SHAPES = [(4096, 12288), (4096, 11008), (11008, 4096), (8192, 28672), (4096, 14336), (8192, 10240),
                (8192, 8192), (4096, 4096)]
SMALL_SHAPES = [(64, 64), (128, 192), (192, 320), (576, 960), (320, 128), (256, 384), (384, 256), (512, 128)]


def torch_reference(qw: QuantizedWeight, dtype: torch.dtype) -> TorchQuantLinear:
    spec = LayerSpec(qw.in_features, qw.out_features, qw.bits, qw.group_size, qw.sym, qw.act_order)
    ref = TorchQuantLinear(qw.in_features, qw.out_features, qw.bias is not None, spec, dtype)
    ref.load_quantized(qw)
    return ref


def fused_output(module: MarlinQuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The fused kernel's output for any M (the module itself switches to cuBLAS for large M),
    written into a NaN-poisoned buffer so that unwritten elements show."""
    ops = torch.ops.litquant_marlin
    xp = x if module.perm is None else x.index_select(1, module.perm)
    xp = torch.nn.functional.pad(xp, (0, module.padded_in_features - module.in_features))  # as forward() does
    xp = module.kernel_input(xp)
    out = torch.full((x.shape[0], module.out_features), float("nan"), dtype=x.dtype, device=x.device)
    locks = module.locks_for(x.shape[0])
    ops.gemm_out(xp, module.qweight, module.scales, module.zeros, module.bias, locks, module.group_size, out)
    assert not locks.any(), "the kernel must leave its locks at zero"
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_rows(qw: QuantizedWeight, dtype: torch.dtype, rows, fused_up_to: int = 4096) -> None:
    module, ref = marlin_module(qw, dtype), torch_reference(qw, dtype)
    for m in rows:
        x = torch.randn(m, qw.in_features, device="cuda", dtype=dtype)
        expected = ref(x)
        outputs = {"module": module(x)}
        if m <= fused_up_to:
            outputs["fused"] = fused_output(module, x)
        for path, out in outputs.items():
            assert not out.isnan().any(), f"{path}: NaN in the output, M={m}"
            err = relative_error(out, expected)
            assert err < TOLERANCE[dtype], f"{path}: relative error {err:.2e} at M={m}"


@pytest.mark.gpu
def test_gpu_auto_picks_marlin_for_the_layers_it_takes():
    """`auto` takes the fastest kernel: marlin for the 4-bit layers it supports (building it if needed), triton
    for the rest (8-bit too, where triton decodes faster; `--kernel marlin` runs 8-bit)."""
    four_bit = [("mlp.fc", LayerSpec(4096, 11008, 4, 128, False, True))]
    assert select_kernel("auto", four_bit, torch.device("cuda"), torch.bfloat16) is MarlinQuantLinear
    for bits in (3, 8):
        layers = [("mlp.fc", LayerSpec(4096, 11008, bits, 128, False, True))]
        assert select_kernel("auto", layers, torch.device("cuda"), torch.bfloat16).name == "triton"
    eight_bit = [("mlp.fc", LayerSpec(4096, 11008, 8, 128, False, True))]
    assert select_kernel("marlin", eight_bit, torch.device("cuda"), torch.bfloat16) is MarlinQuantLinear


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gpu_every_configuration(dtype, group_size, act_order, sym):
    qw = random_quantized_weight(1024, 768, group_size, sym, act_order and group_size != -1, "cuda", bias=sym)
    check_rows(qw, dtype, ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_groups_of_scale_zero(dtype):
    """Groups whose weights are all 0 (scale 0; `without_zero_scales`), a whole 64-column tile of them too, on
    every path: the decode path keeps its sums in units of the group's scale."""
    qw = random_quantized_weight(1024, 768, 128, sym=False, act_order=True, device="cuda", bias=True)
    qw.scales[2] = 0
    qw.scales[:, 64:128] = 0
    qw.scales[5, 7] = 0
    check_rows(qw, dtype, ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_wgmma_whole_tiles_in_a_nearly_full_round(dtype):
    """11008 x 4096 at M = 1000 and 1024 is 128 tiles of 256 x 128 rows x columns: on an H200 (132 SMs) a round at
    least 90% full, which `plan_wgmma` runs as whole tiles, one a block in rounds (with a bias; at M = 1000 the
    last row tile has rows past M)."""
    qw = random_quantized_weight(11008, 4096, 128, sym=False, act_order=False, device="cuda", bias=True)
    check_rows(qw, dtype, (1000, 1024))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_wgmma_up_to_the_dense_threshold(dtype):
    """On Hopper the fused kernel takes M up to `wgmma_dense_from_m` - 1 (16383: 86 row tiles of 192 rows, the last
    partly past M), dequantize + cuBLAS from there on; with a bias, on a layer whose tiles take several rounds."""
    qw = random_quantized_weight(4096, 11008, 128, sym=False, act_order=True, device="cuda", bias=True)
    assert MarlinQuantLinear.wgmma_dense_from_m == 16384
    check_rows(qw, dtype, (1536, 2047, 8192, 16383, 16384), fused_up_to=16383)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_wgmma_whole_tiles_past_the_l2(dtype):
    """28672 x 8192 (70B-down) at M = 1800 (10 row tiles of 192 rows) and 2048 (8 of 256): a group of 8 row tiles
    reads 88 or 117 MB of activations, more than an H200's L2, so `plan_wgmma` runs whole tiles in rounds where it
    would otherwise share the last ones."""
    qw = random_quantized_weight(28672, 8192, 128, sym=False, act_order=False, device="cuda", bias=True)
    check_rows(qw, dtype, (1800, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_wgmma_k_splits_past_one_round(dtype):
    """28672 x 8192 (70B-down) at M = 480 and 576: 192 tiles of 160 or 192 rows, 1.45 rounds on 132 SMs, which
    `plan_wgmma` runs as 2 k splits in 3 rounds (384 blocks, more than the SMs: blocks start as others end), the
    splits summed by the second kernel; symmetric, with act_order and a bias."""
    qw = random_quantized_weight(28672, 8192, 128, sym=True, act_order=True, device="cuda", bias=True)
    check_rows(qw, dtype, (480, 576))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_wgmma_stream_k_sums_taken_before_and_after_the_run(dtype):
    """8192 x 10240 (70B-qkv) at M = 512: 160 tiles of 256 x 128, shared by 132 blocks in runs of 78 of a tile's 64
    stages, so a tile's finishing block takes the next block's sums into its accumulators before its own run of the
    tile; at M = 256, 80 tiles in runs of 39 stages, a tile is cut between up to three blocks, and the finishing block
    adds their sums after its run. With zero points, act_order and a bias."""
    qw = random_quantized_weight(8192, 10240, 128, sym=False, act_order=True, device="cuda", bias=True)
    check_rows(qw, dtype, (256, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_llama_shapes(dtype, shape):
    qw = random_quantized_weight(*shape, 128, sym=dtype == torch.float16, act_order=dtype == torch.bfloat16,
                                 device="cuda")
    check_rows(qw, dtype, ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, sym", [(-1, True), (32, False), (64, True), (128, False)])
def test_gpu_decode_shallow_ring_every_group(dtype, group_size, sym):
    """decode.cu streams the weights through the shallow ring (kShallowRing tiles, each refilled part-way through a
    chunk from the next one) where the grid is large: at M = 9..16 28672 x 8192 (70B-down: 4 splits, 512 blocks,
    90% of a wave of 4 blocks an SM or more) and at M = 9..32 4096 x 57344 (896 blocks, two waves of 3 blocks an SM
    at four token blocks); at M = 1..8 8192 x 10240 (70B-qkv: 640 blocks, one wave of 5 blocks an SM on an H200);
    4096 x 12288 (7B-qkv: 384 blocks) keeps the deep ring. Every group size, with and without zero points."""
    qkv = random_quantized_weight(8192, 10240, group_size, sym=sym, act_order=group_size == 64, device="cuda")
    check_rows(qkv, dtype, (1, 3, 8))
    down = random_quantized_weight(28672, 8192, group_size, sym=sym, act_order=group_size == 32, device="cuda")
    check_rows(down, dtype, (9, 12, 16))
    wide = random_quantized_weight(4096, 57344, group_size, sym=sym, act_order=group_size == 32, device="cuda")
    check_rows(wide, dtype, (9, 16, 17, 24, 32))
    deep = random_quantized_weight(4096, 12288, group_size, sym=sym, act_order=False, device="cuda")
    check_rows(deep, dtype, (9, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, sym, act_order", [(-1, True, False), (32, False, True), (64, True, False),
                                                        (128, True, True), (128, False, False)])
def test_gpu_8bit_every_configuration(dtype, group_size, sym, act_order):
    """8-bit weights (two 4-bit planes, `nibble_planes`) on every path: decode, mma.sync / wgmma, dequant + cuBLAS."""
    qw = random_quantized_weight(1024, 768, group_size, sym, act_order, "cuda", bias=sym, bits=8)
    check_rows(qw, dtype, ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 12288), (11008, 4096), (8192, 28672), (192, 320)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_8bit_llama_and_odd_shapes(shape):
    qw = random_quantized_weight(*shape, 128 if shape[0] % 128 == 0 else 64, sym=False, act_order=True,
                                 device="cuda", bits=8)
    check_rows(qw, torch.bfloat16, ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("group_size", [32, 64])
def test_gpu_small_shapes(shape, group_size):
    qw = random_quantized_weight(*shape, group_size, sym=False, act_order=True, device="cuda", bias=True)
    check_rows(qw, torch.bfloat16, ROWS)
    check_rows(qw, torch.float16, (1, 17, 100))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size, sym", [(-1, True), (64, False), (128, True), (128, False)])
@pytest.mark.parametrize("shape", [(4096, 11008), (8192, 28672), (11008, 4096), (8192, 8192), (384, 256)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_fused_paths_are_as_accurate_as_the_reference(dtype, group_size, sym, shape):
    """Against the exact product (fp64), no fused path's error may exceed the torch reference's by more than
    10%: the decode path (decode.cu: M <= 16, and <= 32 on layers with N >= 2K or K >= 2N) multiplies the codes
    on the tensor cores, biased (2^m + 2^p q) up to 8 rows and centered above, and applies zero point and scale
    per group to the fp32 sums, kept in units of the group's scale, which activations of a large mean stress (the
    bias times their sum is most of each sum); larger M dequantizes per pair, on mma.sync (marlin.cu) or (Hopper)
    wgmma. 11008x4096 takes decode at M = 24 and 32 as a deep layer."""
    qw = random_quantized_weight(*shape, group_size, sym=sym, act_order=False, device="cuda")
    module, ref = marlin_module(qw, dtype), torch_reference(qw, dtype)
    g = qw.g_idx.long()
    w_exact = (qw.codes.double() - qw.zeros.double()[g]) * qw.scales.to(dtype).double()[g]
    for m in (1, 5, 8, 16, 24, 32, 64, 256):
        for mean in (0.0, 3.0):
            x = torch.randn(m, shape[0], device="cuda", dtype=dtype) + mean
            exact = x.double() @ w_exact
            err_kernel, err_ref = relative_error(fused_output(module, x), exact), relative_error(ref(x), exact)
            assert err_kernel <= 1.1 * err_ref, f"M={m}, mean {mean}: kernel {err_kernel:.2e}, torch reference {err_ref:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_dequant_is_bit_exact(dtype, bits):
    """The dense path's weight: 4-bit, the reference's; 8-bit, the sum of the two planes' values as the CPU
    emulation of the lanes decodes them, added in fp32 and rounded once."""
    qw = random_quantized_weight(512, 384, 64, sym=False, act_order=True, bits=bits)
    module = marlin_module(qw.to("cuda"), dtype)
    w = torch.full((512, 384), float("nan"), dtype=dtype, device="cuda")
    torch.ops.litquant_marlin.dequant_out(module.qweight, module.scales, module.zeros, module.group_size, w)
    if bits == 4:
        expected = expected_weight(qw, dtype, module.perm.cpu().long())
    else:
        planes = emulate_dequant(marlin_module(qw, dtype), dtype).float()
        expected = (planes[:512] + planes[512:]).to(dtype)
    assert torch.equal(w.cpu(), expected)


@pytest.mark.gpu
def test_gpu_bad_calls_raise_and_say_why():
    """Bad arguments to the ops raise a RuntimeError that names the problem, numbers included, and the process goes
    on (the binding builds its messages without iostreams: litquant/csrc/marlin/binding.cpp)."""
    qw = random_quantized_weight(1024, 768, 128, sym=False, act_order=False, device="cuda")
    module = marlin_module(qw, torch.bfloat16)
    ops = torch.ops.litquant_marlin
    x = torch.randn(192, 1024, device="cuda", dtype=torch.bfloat16)
    weight = (module.qweight, module.scales, module.zeros, module.bias)
    with pytest.raises(RuntimeError, match=r"locks must hold \d+ int32 for M=192"):
        ops.gemm(x, *weight, module.locks.float(), module.group_size)
    with pytest.raises(RuntimeError, match=r"qweight must have shape \[K/16, 2N\] = \[64, 1536\], got \[64, 1534\]"):
        ops.gemm(x, module.qweight[:, :-2].contiguous(), *weight[1:], module.locks, module.group_size)
    with pytest.raises(RuntimeError, match="marlin gemm: marlin supports group_size -1, 32, 64 or 128"):
        ops.gemm(x, *weight, module.locks, 16)
    with pytest.raises(RuntimeError, match="marlin dequant: marlin supports group_size"):
        ops.dequant_out(module.qweight, module.scales, module.zeros, 16,
                        torch.empty(1024, 768, device="cuda", dtype=torch.bfloat16))
    assert relative_error(module(x), torch_reference(qw, torch.bfloat16)(x)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_unaligned_and_strided_inputs():
    qw = random_quantized_weight(256, 128, 128, sym=True, act_order=False, device="cuda")
    module, ref = marlin_module(qw, torch.float16), torch_reference(qw, torch.float16)
    base = torch.randn(5 * 256 + 3, device="cuda", dtype=torch.float16)
    x = base[3:].view(5, 256)  # 6-byte offset: not 16-byte aligned
    assert relative_error(module(x), ref(x)) < TOLERANCE[torch.float16]
    x3 = torch.randn(2, 3, 256, device="cuda", dtype=torch.float16)
    out3 = module(x3)
    assert out3.shape == (2, 3, 128)
    assert relative_error(out3, ref(x3)) < TOLERANCE[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns", [(4, 256), (64, 256), (64, 8192)])
def test_gpu_cuda_graph_and_compile(rows, columns):
    # K = 2048: split along K on every path. 4 rows: the decode kernel's k splits. 64 rows on an H100/H200
    # (wgmma): 256 columns, one tile shared by 4 blocks (stream-K, with locks); 8192 columns, 32 tiles x 4 k
    # splits and the split-sum kernel.
    qw = random_quantized_weight(2048, columns, 128, sym=False, act_order=True, device="cuda", bias=True)
    module, ref = marlin_module(qw, torch.bfloat16), torch_reference(qw, torch.bfloat16)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert relative_error(compiled(x), ref(x)) < TOLERANCE[torch.bfloat16]

    static_x = x.clone()
    module(static_x)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = module(static_x)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        static_y.fill_(float("nan"))  # what the replay does not write shows
        graph.replay()
        assert relative_error(static_y, ref(static_x)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width", [(1, 2048), (4, 2048), (64, 2048), (300, 2048), (1, 8192)])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("after_small_kernel", [False, True], ids=["", "after-small-kernel"])
def test_gpu_layers_in_a_chain_read_each_others_outputs(rows, width, graph, after_small_kernel):
    """Each layer's input is the previous layer's output, launched back to back (no kernel in between): on
    Hopper a kernel starts while the one before it still runs (programmatic dependent launch) and must wait
    for it before reading its input. Every output buffer is NaN-poisoned first, so an early read shows.
    `after_small_kernel` makes every decode grid a dependent, those that do not fill the GPU too."""
    dtype, layers = torch.bfloat16, 6
    weights = [random_quantized_weight(width, width, 128, sym=i % 2 == 0, act_order=False, device="cuda",
                                       bias=i % 3 == 0) for i in range(layers)]
    modules = [marlin_module(qw, dtype) for qw in weights]
    x = torch.randn(rows, width, device="cuda", dtype=dtype)
    outs = [torch.empty(rows, width, device="cuda", dtype=dtype) for _ in range(layers)]
    locks = [module.locks_for(rows) for module in modules]  # gemm_out is fused at any M, past the threshold too

    def chain():
        for buffer in outs:
            buffer.fill_(float("nan"))
        inputs = [x] + outs[:-1]
        for module, lock, inp, out in zip(modules, locks, inputs, outs):
            torch.ops.litquant_marlin.gemm_out(inp, module.qweight, module.scales, module.zeros, module.bias, lock,
                                               module.group_size, out, after_small_kernel=after_small_kernel)

    if graph:
        chain()  # warm up outside the graph
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        g.replay()
    else:
        chain()
    inputs = [x] + outs[:-1]
    for i, (qw, inp, out) in enumerate(zip(weights, inputs, outs)):
        assert not out.isnan().any(), f"layer {i}: NaN in the output (read its input too early?)"
        err = relative_error(out, torch_reference(qw, dtype)(inp))
        assert err < TOLERANCE[dtype], f"layer {i}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16, 300])
def test_gpu_after_small_kernels_changes_only_how_the_call_is_launched(rows):
    """`after_small_kernels` (set by litquant's compiled decode) makes small decode grids programmatic dependents;
    the products stay bit for bit the same, on every path."""
    module = marlin_module(random_quantized_weight(4096, 4096, 128, sym=True, act_order=False, device="cuda"),
                           torch.bfloat16)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    expected = module(x)
    module.after_small_kernels = True
    assert torch.equal(module(x), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("act_order, bits", [(False, 4), (True, 4), (True, 8)])
def test_gpu_concat_is_both_layers_side_by_side(act_order, bits):
    """fc_1 and fc_2 of a Llama-2-7B MLP as one layer (litquant.fuse), on every path (decode, mma/wgmma, dense)."""
    first = random_quantized_weight(4096, 11008, 128, sym=False, act_order=act_order, device="cuda", bits=bits)
    second = random_quantized_weight(4096, 11008, 128, sym=False, act_order=False, device="cuda", bits=bits)
    second.g_idx = first.g_idx.clone()
    a, b = marlin_module(first, torch.bfloat16), marlin_module(second, torch.bfloat16)
    fused = a.concat(b)
    assert fused is not None and fused.out_features == 22016
    for m in (1, 7, 16, 300, 2048):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        err = relative_error(fused(x), torch.cat([a(x), b(x)], -1))
        assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.2e} at M={m}"
