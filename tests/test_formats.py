"""Round trips of every on-disk format at every bit width and odd shapes, and the public layout facts."""
import pytest
import torch

from litquant.formats import QuantizedWeight, awq, gptq
from litquant.formats.common import default_g_idx, num_groups, pack_along_rows, unpack_along_rows


def random_qw(k, n, bits, group_size, act_order=False, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    groups = num_groups(k, group_size)
    g_idx = default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return QuantizedWeight(torch.randint(0, 2**bits, (k, n), generator=g, dtype=torch.uint8),
                           torch.rand(groups, n, generator=g).half() + 0.01,
                           torch.randint(0, 2**bits, (groups, n), generator=g, dtype=torch.uint8),
                           g_idx, bits, group_size)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rows,cols", [(32, 1), (64, 7), (96, 33), (160, 5)])
def test_pack_along_rows_round_trip(bits, rows, cols):
    codes = torch.randint(0, 2**bits, (rows, cols), dtype=torch.uint8)
    words = pack_along_rows(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (rows * bits // 32, cols)
    assert torch.equal(unpack_along_rows(words, bits), codes)


def test_three_bit_values_straddle_words():
    # value 10 of a 3-bit stream occupies bits 30..32: its low two bits end word 0, its top bit starts word 1
    codes = torch.zeros(32, 1, dtype=torch.uint8)
    codes[10] = 0b111
    words = pack_along_rows(codes, 3)
    assert (words[0, 0].item() & 0xFFFFFFFF) == 0b11 << 30
    assert words[1, 0].item() == 1 and words[2, 0].item() == 0


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k,n,group_size", [(128, 64, 32), (100, 24, -1), (96, 40, 64), (70, 33, 32), (576, 40, 128)])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_round_trip(bits, k, n, group_size, fmt, act_order):
    qw = random_qw(k, n, bits, group_size, act_order)
    tensors = gptq.pack(qw, fmt)
    back = gptq.unpack(tensors, bits, group_size, fmt)
    for field in ("codes", "zeros", "scales", "g_idx"):
        assert torch.equal(getattr(back, field), getattr(qw, field)), field
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_gptq_v1_stores_zero_minus_one():
    qw = random_qw(64, 16, 4, -1)
    qw.zeros.fill_(8)  # symmetric 4-bit
    assert (gptq.pack(qw, "gptq")["qzeros"] == 0x77777777).all()
    assert (gptq.pack(qw, "gptq_v2")["qzeros"].view(torch.int32) == int.from_bytes(b"\x88" * 4, "little", signed=True)).all()


def test_gptq_layout_matches_spec_by_hand():
    # value j of a column sits at bits [4j, 4j+4) of word j // 8, least significant first
    qw = random_qw(8, 2, 4, -1)
    qw.codes[:, 0] = torch.arange(8, dtype=torch.uint8)
    word = gptq.pack(qw)["qweight"][0, 0].item() & 0xFFFFFFFF
    assert word == 0x76543210


@pytest.mark.parametrize("version", ["gemm", "gemv"])
@pytest.mark.parametrize("k,n,group_size", [(256, 64, 32), (576, 1536, 64), (512, 24, 128), (1024, 8, 128)])
def test_awq_round_trip(version, k, n, group_size):
    qw = random_qw(k, n, 4, group_size)
    back = awq.unpack(awq.pack(qw, version), k, n, group_size, version)
    for field in ("codes", "zeros", "scales", "g_idx"):
        assert torch.equal(getattr(back, field), getattr(qw, field)), field


def test_awq_gemm_interleave():
    # nibble i of word c holds column 8c + [0,2,4,6,1,3,5,7][i]
    qw = random_qw(32, 8, 4, 32)
    qw.codes[0] = torch.arange(8, dtype=torch.uint8)
    word = awq.pack(qw, "gemm")["qweight"][0, 0].item() & 0xFFFFFFFF
    assert word == 0x75316420


def test_awq_gemv_padding():
    # 576 / 64 = 9 groups -> ceil(9 / 8) = 2 words, rounded to a multiple of 2 (group 64) = 2
    tensors = awq.pack(random_qw(576, 16, 4, 64), "gemv")
    assert tensors["qzeros"].shape == (16, 2) and tensors["scales"].shape == (16, 16)
    # 4096 / 32 = 128 groups -> 16 words, multiple of 4 -> 16; 256/32 = 8 groups -> 1 word -> 4
    assert awq.gemv_zeros_width(4096, 32) == 16 and awq.gemv_zeros_width(256, 32) == 4


def test_format_errors():
    qw = random_qw(64, 16, 4, 32)
    with pytest.raises(ValueError, match="unknown GPTQ checkpoint_format 'gptq_v3'"):
        gptq.pack(qw, "gptq_v3")
    tensors = gptq.pack(qw)
    tensors["scales"] = tensors["scales"][:1]
    with pytest.raises(ValueError, match="qzeros is torch.int32 \\[2, 2\\], expected torch.int32 \\[1, 2\\]"):
        gptq.unpack(tensors, 4, 32)
    with pytest.raises(ValueError, match="AWQ checkpoints are 4-bit only"):
        awq.pack(random_qw(64, 16, 3, 32))
    with pytest.raises(ValueError, match="act_order weights cannot be saved as AWQ"):
        awq.pack(random_qw(64, 16, 4, 32, act_order=True))
    with pytest.raises(ValueError, match="multiples of 8"):
        awq.pack(random_qw(64, 12, 4, 32))
