"""The `triton` kernel against the torch reference kernel and exact float64 math.

On the CPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before the kernel module is
imported (Triton reads it when the kernels are decorated), so this module sets it first. The GPU tests (marked
`gpu`) run the compiled kernels at real Llama-2 shapes.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from litquant.formats import QuantizedWeight  # noqa: E402
from litquant.formats.common import default_g_idx  # noqa: E402
from litquant.kernels import AUTO_ORDER, KernelNotSupported, select_kernel  # noqa: E402
from litquant.kernels import triton_kernel as tk  # noqa: E402
from litquant.kernels.base import LayerSpec  # noqa: E402
from litquant.kernels.torch_dequant import TorchQuantLinear  # noqa: E402

if not torch.cuda.is_available() and not (tk.INTERPRET and isinstance(tl.sum, InterpretedFunction)):
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on this CPU-only "
                "machine: set it before anything imports triton (tests/conftest.py does)", pytrace=False)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}  # about 2x the unit roundoff
# Tiles wider than N = 45 (masked edges); M = 17 spans two row tiles, and gemv splits K (partial sums).
PATHS = {
    "gemv": tk.KernelConfig("gemv", block_n=64, block_m=2, split_k=2),  # M = 3: a full and a masked row block
    "mma": tk.KernelConfig("mma", block_n=64, block_m=16),  # one dot a chunk (the default here)
    "mma-per-field": tk.KernelConfig("mma", block_n=64, block_m=16, fields_per_dot=1),  # sm_80's default
    "mma-x-descriptor": tk.KernelConfig("mma", block_n=64, block_m=16, x_descriptor=True),  # TMA: zeros past M, K
    "dequant": tk.KernelConfig("dequant"),
}


def random_quantized(k: int, n: int, bits: int, group_size: int, act_order: bool, zero_point: bool,
                     seed: int = 0, device: torch.device = DEVICE) -> QuantizedWeight:
    """Random codes over the full range, random fp16 scales, random or symmetric zeros, and a GPTQ act_order
    g_idx (group i holds the rows at positions [i*g, (i+1)*g) of a random permutation) when asked."""
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    codes = torch.randint(0, 2**bits, (k, n), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=gen, device=device) * 0.02 + 0.005).to(torch.float16)
    if zero_point:
        zeros = torch.randint(0, 2**bits, (groups, n), generator=gen, device=device, dtype=torch.uint8)
    else:
        zeros = torch.full((groups, n), 2 ** (bits - 1), device=device, dtype=torch.uint8)
    g_idx = default_g_idx(k, group_size, device)
    if act_order:
        order = torch.randperm(k, generator=gen, device=device)
        g_idx = torch.empty_like(g_idx)
        g_idx[order] = default_g_idx(k, group_size, device)
    return QuantizedWeight(codes, scales, zeros, g_idx, bits, group_size)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_against_references(qw: QuantizedWeight, config: tk.KernelConfig, dtype: torch.dtype, ms) -> None:
    """`quant_matmul` with `config` into NaN-poisoned outputs, against float64 math and the torch kernel."""
    packed = tk.repack(qw)
    spec = LayerSpec(qw.in_features, qw.out_features, qw.bits, qw.group_size, qw.sym, qw.act_order)
    reference = TorchQuantLinear(qw.in_features, qw.out_features, False, spec, dtype)
    reference.load_quantized(qw)
    exact_weight = qw.dequantize(torch.float64)
    for m in ms:
        x = torch.randn(m, qw.in_features, device=qw.codes.device).to(dtype)
        out = torch.full((m, qw.out_features), float("nan"), dtype=dtype, device=x.device)
        tk.quant_matmul(x, packed, out=out, config=config)
        assert torch.isfinite(out).all(), f"M={m}: unwritten (NaN) outputs"
        exact = x.double() @ exact_weight.t()
        assert relative_error(out, exact) <= TOLERANCE[dtype], f"M={m}: {relative_error(out, exact):.2e}"
        assert relative_error(out, reference(x)) <= 1.5 * TOLERANCE[dtype]


CASES = {  # name: (group_size, act_order, zero_point, in_features)
    "g32-act-zp": (32, True, True, 224),  # groups smaller than a 128-row chunk; K not a multiple of it
    "g64-zp": (64, False, True, 320),
    "g128-act-sym": (128, True, False, 256),
    "g128-sym": (128, False, False, 256),
    "gall-zp": (-1, False, True, 200),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_4bit_matches_reference(case, dtype, path):
    group_size, act_order, zero_point, k = CASES[case]
    qw = random_quantized(k, 45, 4, group_size, act_order, zero_point)  # N = 45: odd, masked column tiles
    check_against_references(qw, PATHS[path], dtype, ms=(1, 3) if path == "gemv" else (1, 3, 17))


@pytest.mark.parametrize("case", ["g32-act-zp", "g128-act-sym", "g128-sym", "gall-zp"])
def test_gemv_without_masks_on_even_shapes(case):
    """M, N and K multiples of the gemv's row block, column block and chunk: its loads go unmasked (EVEN)."""
    group_size, act_order, zero_point, _ = CASES[case]
    qw = random_quantized(256, 128, 4, group_size, act_order, zero_point)
    check_against_references(qw, tk.KernelConfig("gemv", block_n=64, block_m=2, split_k=2), torch.bfloat16, ms=(2, 4))


@pytest.mark.parametrize("bits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", ["g32-act-zp", "g128-sym", "gall-zp"])
def test_2_3_and_8_bit_match_reference(bits, dtype, case):
    """(On a GPU, the mma path dequantizes 8-bit codes in 16 bits for fp16 and in fp32 for bf16.)"""
    group_size, act_order, zero_point, k = CASES[case]
    qw = random_quantized(k, 40, bits, group_size, act_order, zero_point, seed=bits)
    # split_k 3 over 1-2 chunks: gemv splits get no chunk and must add zeros, mma takes one split a chunk; 4
    # fields a dot take 3-bit chunks as 4 + 4 + 2
    for config in (tk.KernelConfig("gemv", block_n=64, block_m=1), tk.KernelConfig("mma", block_n=32, split_k=3),
                   tk.KernelConfig("mma", block_n=32, fields_per_dot=4), PATHS["mma-per-field"], PATHS["dequant"]):
        check_against_references(qw, config, dtype, ms=(1, 5))


@pytest.mark.parametrize("path", ["gemv", "mma"])
def test_any_split_count_covers_every_chunk_once(path):
    """K splits need not divide the chunks: 7 chunks over 3, 5 and 7 splits (runs of 2-3, 1-2 and 1 chunks)."""
    qw = random_quantized(7 * 128, 40, 4, 64, act_order=True, zero_point=True, seed=7)
    for split_k in (3, 5, 7):
        config = tk.KernelConfig(path, block_n=64 if path == "gemv" else 32, block_m=1 if path == "gemv" else 16,
                                 split_k=split_k)
        check_against_references(qw, config, torch.bfloat16, ms=(1, 2))


def test_3bit_layout():
    """At 3 bits a word holds ten codes (bits 0..29): field j of word (c, n, w) is sorted row c*160 + 16*j + w."""
    qw = random_quantized(320, 8, 3, 64, act_order=True, zero_point=True)
    packed = tk.repack(qw)
    assert tk.chunk_rows(3) == 160 and packed.qweight.shape == (2, 8, 16)
    fields = (packed.qweight.unsqueeze(-1).long() >> (torch.arange(10, device=DEVICE) * 3)) & 7  # [c, n, w, j]
    assert torch.equal(fields.permute(0, 3, 2, 1).reshape(320, 8).to(torch.uint8), qw.codes[packed.perm.long()])
    assert not (packed.qweight.long() & (3 << 30)).any()  # the top two bits stay clear


@pytest.mark.parametrize("config", [tk.KernelConfig("gemv", block_n=64, block_m=1, split_k=3),
                                    tk.KernelConfig("mma", block_n=32, block_m=16, split_k=2)], ids=["gemv", "mma"])
def test_split_k_counters_reset(config):
    """The last program of a split tile sums the partials and resets its arrival counter: the counters are zero
    after every call, and a second call (with a bias) over the same counters is right too."""
    qw = random_quantized(256, 40, 4, 64, act_order=False, zero_point=True)
    packed = tk.repack(qw)
    assert packed.locks.numel() == tk.lock_count(40, DEVICE) and not packed.locks.any()
    bias = torch.randn(40, device=DEVICE, dtype=torch.float16)
    exact_weight = qw.dequantize(torch.float64)
    for m, b in ((3, None), (2, bias)):
        x = torch.randn(m, 256, device=DEVICE).to(torch.float16)
        out = tk.quant_matmul(x, packed, bias=b, out=torch.full((m, 40), float("nan"), dtype=torch.float16,
                                                                  device=DEVICE), config=config)
        exact = x.double() @ exact_weight.t() + (0 if b is None else b.double())
        assert relative_error(out, exact) <= TOLERANCE[torch.float16]
        assert not packed.locks.any(), "split-K counters left non-zero"
    with pytest.raises(ValueError, match="splits more output tiles than the 1 split-K counters given"):
        tk.launch(config, x, packed.qweight, packed.scale_zero, None, None, packed.locks[:1], 4, 64, out)


def test_packed_layout():
    """Field j of word (c, n, w) holds the code of sorted input row c*ROWS + 16*j + w (the layout contract), and
    scale_zero[g, n] the fp16 scale's bits low and the zero point high."""
    qw = random_quantized(256, 8, 4, 128, act_order=True, zero_point=True)
    packed = tk.repack(qw)
    assert packed.qweight.shape == (2, 8, 16) and packed.qweight.dtype == torch.int32
    shifts = torch.arange(8, device=DEVICE) * 4
    fields = (packed.qweight.unsqueeze(-1).long() >> shifts) & 15  # [c, n, w, j]
    rows = fields.permute(0, 3, 2, 1).reshape(256, 8)  # row c*128 + 16*j + w
    assert torch.equal(rows.to(torch.uint8), qw.codes[packed.perm.long()])
    assert torch.equal(packed.scale_zero >> 16, qw.zeros.int())
    assert torch.equal((packed.scale_zero & 0xFFFF).to(torch.int16).view(torch.float16), qw.scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_module_matches_torch_kernel(dtype):
    """The registered module, picked through the registry, on [batch, seq, K] inputs with a bias, default configs."""
    qw = random_quantized(256, 48, 4, 64, act_order=True, zero_point=True)
    qw.bias = torch.randn(48, device=DEVICE)
    spec = LayerSpec(256, 48, 4, 64, qw.sym, qw.act_order)
    cls = select_kernel("triton", [("layer", spec)], DEVICE, dtype)
    module = cls(256, 48, True, spec, dtype)
    module.load_quantized(qw)
    reference = TorchQuantLinear(256, 48, True, spec, dtype)
    reference.load_quantized(qw)
    for shape in ((1, 1, 256), (2, 3, 256)):
        x = torch.randn(shape, device=DEVICE).to(dtype)
        out = module(x)
        assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
        assert relative_error(out, reference(x)) <= 1.5 * TOLERANCE[dtype]


def test_auto_prefers_triton_on_gpus_only():
    assert AUTO_ORDER.index("triton") < AUTO_ORDER.index("torch")
    spec = LayerSpec(256, 48, 4, 128, True, False)
    # the interpreter runs triton on the CPU for tests, but `auto` never picks it there
    expected = tk.TritonQuantLinear if DEVICE.type == "cuda" else TorchQuantLinear
    assert select_kernel("auto", [("layer", spec)], DEVICE, torch.bfloat16) is expected


def test_auto_skips_a_kernel_for_bit_widths_outside_its_auto_bits(monkeypatch):
    import litquant.kernels as registry

    class FourBitOnlyForAuto(TorchQuantLinear):
        name = "fourbit"
        auto_bits = (4,)

    monkeypatch.setattr(registry, "kernel_class",
                        lambda name: FourBitOnlyForAuto if name == "fourbit" else TorchQuantLinear)
    monkeypatch.setattr(registry, "AUTO_ORDER", ("fourbit", "torch"))
    layers = lambda bits: [("layer", LayerSpec(256, 48, bits, 128, True, False))]  # noqa: E731
    assert select_kernel("auto", layers(4), torch.device("cpu"), torch.float32) is FourBitOnlyForAuto
    assert select_kernel("auto", layers(8), torch.device("cpu"), torch.float32) is TorchQuantLinear
    assert select_kernel("fourbit", layers(8), torch.device("cpu"), torch.float32) is FourBitOnlyForAuto


def test_unsupported_layers_are_refused_with_reasons():
    cls = tk.TritonQuantLinear
    assert cls.unsupported(LayerSpec(256, 48, 5, 128, True, False), DEVICE, torch.float16) == (
        "supports 2/3/4/8-bit, not 5-bit")
    assert cls.unsupported(LayerSpec(256, 48, 4, 48, True, False), DEVICE, torch.float16) == (
        "supports group_size 32/64/128/256/-1, not 48")
    with pytest.raises(KernelNotSupported, match="kernel 'triton' cannot run .* not 48. Kernels that can run it here: torch"):
        select_kernel("triton", [("h.0.attn.qkv", LayerSpec(256, 48, 4, 48, True, False))], DEVICE, torch.float16)


def test_concat_is_both_layers_side_by_side():
    """Two layers on the same input as one (litquant.fuse): act_order with the same permutation, zero points."""
    first = random_quantized(256, 48, 4, 64, act_order=True, zero_point=True, seed=1)
    second = random_quantized(256, 32, 4, 64, act_order=True, zero_point=True, seed=2)
    second.g_idx = first.g_idx.clone()
    a, b = (tk.TritonQuantLinear(256, qw.out_features, False, LayerSpec(256, qw.out_features, 4, 64, False, True),
                                 torch.float16) for qw in (first, second))
    a.load_quantized(first)
    b.load_quantized(second)
    fused = a.concat(b)
    assert fused is not None and fused.out_features == 80
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.float16)
    assert relative_error(fused(x), torch.cat([a(x), b(x)], -1)) < TOLERANCE[torch.float16]


def test_bad_weights_raise_clear_errors():
    qw = random_quantized(256, 48, 4, 64, act_order=False, zero_point=True)
    qw.g_idx = torch.arange(256, device=DEVICE, dtype=torch.int32) % 3  # 3 interleaved groups of 85-86 rows
    with pytest.raises(ValueError, match=r"triton's act_order needs every group to hold exactly group_size rows \(as "
                                         r"GPTQ desc_act writes them\); this g_idx does not. The torch kernel can run it."):
        tk.repack(qw)
    module = tk.TritonQuantLinear(256, 48, False, LayerSpec(256, 48, 4, 128, False, False), torch.float16)
    with pytest.raises(ValueError, match="weight is 4-bit g64 256x48, the layer expects 4-bit g128 256x48"):
        module.load_quantized(random_quantized(256, 48, 4, 64, act_order=False, zero_point=True))
    packed = tk.repack(random_quantized(256, 48, 4, 64, act_order=False, zero_point=True))
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float16 tensor of shape \[2, 48\]"):
        tk.quant_matmul(x, packed, out=torch.empty(2, 47, device=DEVICE, dtype=torch.float16))
    for fields in (3, 16):
        with pytest.raises(ValueError, match=f"fields_per_dot must be a power of two from 1 to 8 at 4 bits, got "
                                             f"{fields}"):
            tk.quant_matmul(x, packed, config=tk.KernelConfig("mma", block_n=64, fields_per_dot=fields))


def test_unavailable_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tk.TritonQuantLinear.unavailable() == (
        "needs a CUDA GPU (or TRITON_INTERPRET=1 set before import, to run it slowly on the CPU)")


def test_candidate_configs_per_m_bucket():
    assert [tk.m_bucket(m) for m in (1, 2, 3, 17, 4096, 5000)] == [1, 2, 4, 32, 4096, 8192]
    cpu = torch.device("cpu")
    assert tk.candidate_configs(1, 4096, 4096, 4, cpu)[0].path == "gemv"
    assert {c.block_m for c in tk.candidate_configs(3, 4096, 4096, 4, cpu) if c.path == "gemv"} == {1, 4}
    assert {c.path for c in tk.candidate_configs(16, 4096, 4096, 4, cpu)} == {"mma"}
    assert {c.path for c in tk.candidate_configs(1024, 4096, 4096, 4, cpu)} == {"mma", "dequant"}


# ---------------------------------------------------------------------------------------------------------------
# GPU: real Llama-2 shapes, every path, and the autotuned choice
# ---------------------------------------------------------------------------------------------------------------
GPU_PATHS = {
    "gemv": (tk.KernelConfig("gemv", block_n=128, block_m=4, split_k=4), (1, 3)),
    "mma-small": (tk.KernelConfig("mma", block_n=128, block_m=16, split_k=4), (1, 16)),
    "mma-per-field": (tk.KernelConfig("mma", block_n=128, block_m=64, split_k=2, fields_per_dot=1), (64, 100)),
    "mma-large": (tk.KernelConfig("mma", block_n=128, block_m=128, num_warps=8, num_stages=3), (333, 4096)),
    "mma-x-descriptor": (tk.KernelConfig("mma", block_n=128, block_m=128, num_warps=8, num_stages=2,
                                         x_descriptor=True), (333, 4096)),
    "dequant": (tk.KernelConfig("dequant"), (333, 4096)),
    "wgmma": (tk.KernelConfig("wgmma", block_n=128, block_m=128, num_warps=8, num_stages=4), (333, 4096)),
    "wgmma-split": (tk.KernelConfig("wgmma", block_n=128, block_m=256, split_k=3, num_warps=8, num_stages=3), (333,)),
    "wgmma-stream-k": (tk.KernelConfig("wgmma", block_n=128, block_m=256, num_warps=8, num_stages=3, stream_k=True),
                       (333,)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", GPU_PATHS)
@pytest.mark.parametrize("shape", [(4096, 12288), (4096, 11008), (8192, 28672)], ids=["7B-qkv", "7B-up", "70B-up"])
def test_real_shapes_gpu(shape, path):
    k, n = shape
    config, ms = GPU_PATHS[path]
    qw = random_quantized(k, n, 4, 128, act_order=path == "gemv", zero_point=True, device=torch.device("cuda"))
    packed = tk.repack(qw)
    weight = qw.dequantize(torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            tk.quant_matmul(x, packed, out=out, config=config)
            assert torch.isfinite(out).all()
            assert relative_error(out, x.float() @ weight.t()) <= TOLERANCE[dtype], f"{dtype} M={m}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", [path for path in GPU_PATHS if "wgmma" not in path])  # (2 and 4 bits only)
def test_3bit_real_shape_gpu(path):
    """3-bit codes, ten to a word (160-row chunks, in which no quantization group ends evenly)."""
    config, ms = GPU_PATHS[path]
    qw = random_quantized(4096, 11008, 3, 128, act_order=True, zero_point=True, device=torch.device("cuda"))
    packed = tk.repack(qw)
    weight = qw.dequantize(torch.float32)
    for m in ms:
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        out = torch.full((m, 11008), float("nan"), dtype=torch.bfloat16, device="cuda")
        tk.quant_matmul(x, packed, out=out, config=config)
        assert torch.isfinite(out).all()
        assert relative_error(out, x.float() @ weight.t()) <= TOLERANCE[torch.bfloat16], f"M={m}"


WGMMA_CASES = {  # name: (in_features, out_features, bits, group_size, act_order, zero_point)
    "g128-act": (4096, 1000, 4, 128, True, True),  # x permuted first; N not a multiple of the tile
    "gall-odd-chunks": (33 * 128, 1000, 4, -1, False, True),  # an odd number of chunks (the loop's last one alone)
    "g256-sym": (4096, 1088, 4, 256, False, False),  # a group of two chunks
    "2bit-g256": (4096, 1000, 2, 256, True, True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the wgmma path is for sm_90")
@pytest.mark.parametrize("tile", [(128, 4, 1, False), (64, 4, 1, False), (256, 3, 1, False), (128, 4, 3, False),
                                  (128, 4, 1, True)],
                         ids=lambda t: f"{t[0]}rows-{t[1]}stages-{t[2]}splits{'-stream-k' if t[3] else ''}")
@pytest.mark.parametrize("case", WGMMA_CASES)
def test_wgmma_path_gpu(case, tile):
    """The Gluon wgmma path at the shapes and formats it takes, both dtypes, split over K, stream-K or neither, a bias,
    and an x whose rows are not 16-byte aligned (the launch copies it for the TMA descriptor)."""
    k, n, bits, group_size, act_order, zero_point = WGMMA_CASES[case]
    if bits == 2 and tile[0] == 256:
        pytest.skip("two stages of 256 x 256 bf16 x do not fit an SM's shared memory (not a candidate at 2 bits)")
    config = tk.KernelConfig("wgmma", block_n=128, block_m=tile[0], num_warps=8, num_stages=tile[1],
                             split_k=tile[2], stream_k=tile[3])
    qw = random_quantized(k, n, bits, group_size, act_order, zero_point, device=torch.device("cuda"))
    check_against_references(qw, config, torch.bfloat16, ms=(65, 333))
    check_against_references(qw, config, torch.float16, ms=(256,))
    packed = tk.repack(qw)
    x = torch.randn(300, k + 1, device="cuda", dtype=torch.float16)[:, 1:]
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    out = tk.quant_matmul(x, packed, bias=bias, config=config)
    exact = x.double() @ qw.dequantize(torch.float64).t() + bias.double()
    assert relative_error(out, exact) <= TOLERANCE[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the wgmma path is for sm_90")
@pytest.mark.parametrize("k, n, m, block_m, split", [(4096, 10240, 256, 128, 0), (4096, 10240, 512, 256, 0),
                                                     (4096, 10240, 256, 128, 4), (8192, 10240, 256, 256, 0),
                                                     (4096, 1000, 65, 128, 0)],
                         ids=["160-tiles", "160-tiles-256rows", "160-tiles-split", "80-tiles-unaligned",
                              "8-tiles-aligned"])
def test_wgmma_shared_out_gpu(k, n, m, block_m, split):
    """Whole tiles in rounds of the SMs, then the last round's chunks shared out, a tile's parts summed by whichever
    of its sharers comes last: stream-K (split 0) or each tile of that round in `split` runs. 160 tiles: a round and
    28 tiles; 80 tiles of 64 chunks: shares of 38-39 chunks that straddle tiles; 8 tiles of 32 chunks: shares of 8
    that start together, so that any of a tile's four may come last. The sums run in a fixed order: repeated calls
    agree bit for bit; the split-K counters are left zeroed."""
    qw = random_quantized(k, n, 4, 128, act_order=False, zero_point=True, device=torch.device("cuda"))
    packed = tk.repack(qw)
    config = tk.KernelConfig("wgmma", block_n=128, block_m=block_m, num_warps=8, num_stages=3, split_k=max(split, 1),
                             stream_k=split == 0)
    check_against_references(qw, config, torch.bfloat16, ms=(m,))
    assert not packed.locks.any()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    first = tk.quant_matmul(x, packed, config=config)
    for _ in range(20):
        assert torch.equal(tk.quant_matmul(x, packed, config=config), first)
    assert not packed.locks.any()


@pytest.mark.gpu
def test_wgmma_path_refuses_what_it_cannot_take_gpu():
    config = tk.KernelConfig("wgmma", block_n=128, block_m=128, num_warps=8, num_stages=4)
    for bits, group_size in ((3, 128), (4, 64), (8, 128)):
        packed = tk.repack(random_quantized(512, 256, bits, group_size, False, True, device=torch.device("cuda")))
        x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="the wgmma path takes sm_90, 2 or 4-bit codes"):
            tk.quant_matmul(x, packed, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_dependent_gemv_layers_in_a_chain_gpu(graph):
    """Each layer's input is the previous layer's output, back to back: a gemv launched as a programmatic dependent
    starts while the kernel ahead still runs and must wait for it before reading x, scales or the split-K buffers.
    Every output is NaN-poisoned first, so an early read shows."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch is sm_90 on")
    width, layers, dtype = 2048, 6, torch.bfloat16
    weights = [random_quantized(width, width, 4, 128, act_order=i % 2 == 1, zero_point=True, seed=i,
                                device=torch.device("cuda")) for i in range(layers)]
    packed = [tk.repack(qw) for qw in weights]
    configs = [tk.KernelConfig("gemv", block_n=256, block_m=1, split_k=split, num_warps=4, num_stages=3,
                               dependent=True) for split in (1, 4, 8, 1, 16, 4)]
    x = torch.randn(1, width, device="cuda", dtype=dtype)
    outs = [torch.empty(1, width, device="cuda", dtype=dtype) for _ in range(layers)]

    def chain():
        for buffer in outs:
            buffer.fill_(float("nan"))
        for weight, config, inp, out in zip(packed, configs, [x] + outs[:-1], outs):
            tk.quant_matmul(inp, weight, out=out, config=config)

    chain()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        g.replay()
    for i, (qw, inp, out) in enumerate(zip(weights, [x] + outs[:-1], outs)):
        assert not out.isnan().any(), f"layer {i}: NaN in the output (read its input too early?)"
        exact = inp.double() @ qw.dequantize(torch.float64).t()
        assert relative_error(out, exact) <= TOLERANCE[dtype], f"layer {i}: {relative_error(out, exact):.2e}"


@pytest.mark.gpu
def test_autotuned_module_gpu():
    """The module with its tuned configs, M from 1 to 4096, and inside a CUDA graph."""
    qw = random_quantized(4096, 12288, 4, 128, act_order=True, zero_point=False, device=torch.device("cuda"))
    spec = LayerSpec(4096, 12288, 4, 128, qw.sym, qw.act_order)
    module = tk.TritonQuantLinear(4096, 12288, False, spec, torch.bfloat16)
    module.load_quantized(qw)
    weight = qw.dequantize(torch.float32)
    for m in (1, 4, 64, 512, 4096):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        assert relative_error(module(x), x.float() @ weight.t()) <= TOLERANCE[torch.bfloat16], f"M={m}"
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    module(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, module(x))
