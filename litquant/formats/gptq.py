"""GPTQ checkpoint tensors (AutoGPTQ / GPTQModel / HF), checkpoint_format "gptq" (v1) and "gptq_v2".

Per quantized Linear with K inputs, N outputs, G groups:
  qweight int32 [K*bits/32, N]  codes packed along K (value j of a column at bits [bits*j, bits*j+bits))
  qzeros  int32 [G, N*bits/32]  zero points packed along N the same way
  scales  fp16  [G, N]
  g_idx   int32 [K]             group of each input row; `k // group_size` unless act_order
v1 stores every zero point minus one (w = s * (q - (stored + 1))); v2 stores the true zero point.
A v1 zero point of 0 is stored as 2**bits - 1 (the -1 wraps); AutoGPTQ's CUDA kernels add one without
wrapping and so misread it, our unpack wraps it back. K and N that are not a multiple of the packing
period are padded with zero codes (3-bit packs in periods of 32 rows).
"""
import torch

from litquant.formats.common import (QuantizedWeight, check_tensors, pack_along_rows, rows_multiple,
                                     unpack_along_rows)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
TENSOR_NAMES = ("qweight", "qzeros", "scales", "g_idx")


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def pack(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict:
    """The checkpoint tensors of `qw` (names without the module prefix)."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; expected one of {CHECKPOINT_FORMATS}")
    bits, mult = qw.bits, rows_multiple(qw.bits)
    zeros = qw.zeros.to(torch.int32)
    if checkpoint_format == "gptq":
        zeros = (zeros - 1) & ((1 << bits) - 1)
    tensors = {
        "qweight": pack_along_rows(_pad_rows(qw.codes, mult), bits),
        "qzeros": pack_along_rows(_pad_rows(zeros.t(), mult), bits).t().contiguous(),
        "scales": qw.scales.to(torch.float16).contiguous(),
        "g_idx": qw.g_idx.to(torch.int32).contiguous(),
    }
    if qw.bias is not None:
        tensors["bias"] = qw.bias
    return tensors


def unpack(tensors: dict, bits: int, group_size: int, checkpoint_format: str = "gptq") -> QuantizedWeight:
    """Inverse of `pack`. K comes from g_idx, N from scales."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; expected one of {CHECKPOINT_FORMATS}")
    g_idx, scales = tensors["g_idx"], tensors["scales"]
    in_features, out_features = g_idx.shape[0], scales.shape[1]
    check_shapes(tensors, bits, in_features, out_features, scales.shape[0])
    codes = unpack_along_rows(tensors["qweight"], bits, in_features)
    zeros = unpack_along_rows(tensors["qzeros"].t(), bits, out_features).t()
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    return QuantizedWeight(codes, scales, zeros.contiguous(), g_idx.to(torch.int32), bits, group_size,
                           tensors.get("bias"))


def expected_shapes(bits: int, in_features: int, out_features: int, groups: int) -> dict:
    mult = rows_multiple(bits)
    padded_k = -(-in_features // mult) * mult
    padded_n = -(-out_features // mult) * mult
    return {
        "qweight": ((padded_k * bits // 32, out_features), torch.int32),
        "qzeros": ((groups, padded_n * bits // 32), torch.int32),
        "scales": ((groups, out_features), torch.float16),
        "g_idx": ((in_features,), torch.int32),
    }


def check_shapes(tensors: dict, bits: int, in_features: int, out_features: int, groups: int, where: str = "") -> None:
    """Raise a ValueError naming every tensor whose shape or dtype does not fit the layer."""
    check_tensors(tensors, expected_shapes(bits, in_features, out_features, groups), "GPTQ", where)
