"""AutoAWQ checkpoint tensors, versions "gemm" and "gemv". 4-bit, zero-point, w = (q - z) * s.

GEMM, per Linear with K inputs, N outputs, G = K / group_size groups:
  qweight int32 [K, N/8]  packed along N; nibble i of word c holds output column 8c + AWQ_ORDER[i]
  qzeros  int32 [G, N/8]  the same interleave
  scales  fp16  [G, N]
The interleave [0, 2, 4, 6, 1, 3, 5, 7] puts even columns in the low nibbles of each byte pair, so a
kernel can split a word into two half2 vectors with one shift.

GEMV (AutoAWQ's WQLinear_GEMV), transposed, natural nibble order:
  qweight int32 [N, K/8]  nibble i of word c holds input row 8c + i
  qzeros  int32 [N, W]    the G zero points of a row, packed 8 per word, zero-padded to W words
  scales  fp16  [N, 8W]   the G scales of a row, zero-padded to 8W
  W = ceil(ceil(G/8) / m) * m with m = 1 for group_size >= 128, 2 for 64, 4 for 32 (AutoAWQ's
  `calculate_zeros_width`), so each thread block of the GEMV kernel reads aligned rows.
"""
import torch

from litquant.formats.common import QuantizedWeight, check_tensors, default_g_idx, to_int32

VERSIONS = ("gemm", "gemv")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TENSOR_NAMES = ("qweight", "qzeros", "scales")


def _pack_nibbles(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """uint8 [R, 8C] -> int32 [R, C]; nibble i of word c holds value 8c + order[i]."""
    r, c8 = values.shape
    v = values.to(torch.int64).view(r, c8 // 8, 8)[:, :, list(order)]
    shifts = (torch.arange(8, device=values.device) * 4).view(1, 1, 8)
    return to_int32((v << shifts).sum(-1))


def _unpack_nibbles(words: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """Inverse of `_pack_nibbles`: int32 [R, C] -> uint8 [R, 8C]."""
    r, c = words.shape
    shifts = (torch.arange(8, device=words.device) * 4).view(1, 1, 8)
    nibbles = ((words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF)
    inverse = [order.index(i) for i in range(8)]
    return nibbles[:, :, inverse].reshape(r, c * 8).to(torch.uint8)


def gemv_zeros_width(in_features: int, group_size: int) -> int:
    groups = in_features // group_size
    multiplier = 1 if group_size >= 128 else {64: 2, 32: 4}.get(group_size)
    if multiplier is None:
        raise ValueError(f"AWQ GEMV supports group_size 32, 64 or >= 128, not {group_size}")
    width = -(-groups // 8)
    return -(-width // multiplier) * multiplier


def check_layer(qw_bits: int, in_features: int, out_features: int, group_size: int) -> None:
    if qw_bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit only, not {qw_bits}-bit")
    if group_size == -1 or in_features % group_size:
        raise ValueError(f"AWQ needs in_features ({in_features}) to be a multiple of group_size ({group_size})")
    if out_features % 8 or in_features % 8:
        raise ValueError(f"AWQ packs 8 values per word: in_features ({in_features}) and out_features "
                         f"({out_features}) must be multiples of 8")


def pack(qw: QuantizedWeight, version: str = "gemm") -> dict:
    """The AutoAWQ tensors of `qw` (names without the module prefix). act_order is not representable."""
    check_layer(qw.bits, qw.in_features, qw.out_features, qw.group_size)
    if qw.act_order:
        raise ValueError("AWQ checkpoints have no g_idx: act_order weights cannot be saved as AWQ")
    if version == "gemm":
        tensors = {
            "qweight": _pack_nibbles(qw.codes, AWQ_ORDER),
            "qzeros": _pack_nibbles(qw.zeros, AWQ_ORDER),
            "scales": qw.scales.to(torch.float16).contiguous(),
        }
    elif version == "gemv":
        width = gemv_zeros_width(qw.in_features, qw.group_size)
        groups = qw.scales.shape[0]
        zeros = qw.zeros.new_zeros(qw.out_features, width * 8)
        zeros[:, :groups] = qw.zeros.t()
        scales = torch.zeros(qw.out_features, width * 8, dtype=torch.float16, device=qw.scales.device)
        scales[:, :groups] = qw.scales.t()
        tensors = {"qweight": _pack_nibbles(qw.codes.t().contiguous()), "qzeros": _pack_nibbles(zeros),
                   "scales": scales}
    else:
        raise ValueError(f"unknown AWQ version {version!r}; expected one of {VERSIONS}")
    if qw.bias is not None:
        tensors["bias"] = qw.bias
    return tensors


def unpack(tensors: dict, in_features: int, out_features: int, group_size: int, version: str = "gemm") -> QuantizedWeight:
    """Inverse of `pack`."""
    check_layer(4, in_features, out_features, group_size)
    check_shapes(tensors, in_features, out_features, group_size, version)
    groups = in_features // group_size
    if version == "gemm":
        codes = _unpack_nibbles(tensors["qweight"], AWQ_ORDER)
        zeros = _unpack_nibbles(tensors["qzeros"], AWQ_ORDER)
        scales = tensors["scales"]
    else:
        codes = _unpack_nibbles(tensors["qweight"]).t().contiguous()
        zeros = _unpack_nibbles(tensors["qzeros"])[:, :groups].t().contiguous()
        scales = tensors["scales"][:, :groups].t().contiguous()
    g_idx = default_g_idx(in_features, group_size, codes.device)
    return QuantizedWeight(codes, scales, zeros, g_idx, 4, group_size, tensors.get("bias"))


def expected_shapes(in_features: int, out_features: int, group_size: int, version: str) -> dict:
    groups = in_features // group_size
    if version == "gemm":
        return {"qweight": ((in_features, out_features // 8), torch.int32),
                "qzeros": ((groups, out_features // 8), torch.int32),
                "scales": ((groups, out_features), torch.float16)}
    width = gemv_zeros_width(in_features, group_size)
    return {"qweight": ((out_features, in_features // 8), torch.int32),
            "qzeros": ((out_features, width), torch.int32),
            "scales": ((out_features, width * 8), torch.float16)}


def check_shapes(tensors: dict, in_features: int, out_features: int, group_size: int, version: str,
                 where: str = "") -> None:
    if version not in VERSIONS:
        raise ValueError(f"unknown AWQ version {version!r}; expected one of {VERSIONS}")
    check_tensors(tensors, expected_shapes(in_features, out_features, group_size, version), "AWQ", where)
