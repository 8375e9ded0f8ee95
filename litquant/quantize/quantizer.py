"""Uniform integer quantization of weight groups: the arithmetic that RTN, GPTQ and AWQ share.

Weights are [N, K] (the `nn.Linear.weight` layout): a group is `group_size` consecutive input
columns, and each output row has its own scale and zero point per group. The grid follows AutoGPTQ:
  zero-point: scale = (xmax - xmin) / maxq, zero = round(-xmin / scale), with xmin <= 0 <= xmax;
  symmetric:  xmax = max(|xmin|, xmax), xmin = -xmax, zero = 2**(bits-1) (stored as 7 in v1 4-bit).
Scales are rounded (up) to fp16 before codes are computed, so dequantizing the saved tensors gives exactly
the weights the recipe optimized against.
"""
from typing import Optional, Tuple

import torch

from litquant.formats.common import QuantizedWeight, default_g_idx


def find_params(w: torch.Tensor, bits: int, sym: bool, xmin: Optional[torch.Tensor] = None,
                xmax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of `w` [N, g] (both float32 [N]; zeros are whole numbers).

    `xmin`/`xmax` override the row range (AWQ's clip search shrinks it).
    """
    maxq = 2**bits - 1
    w = w.float()
    xmin = torch.clamp(w.amin(1) if xmin is None else xmin.float(), max=0)
    xmax = torch.clamp(w.amax(1) if xmax is None else xmax.float(), min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    dead = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(dead, -1.0, xmin), torch.where(dead, 1.0, xmax)
    exact = (xmax - xmin) / maxq
    scale = exact.half()
    # round the fp16 scale up, never down, so the grid still spans [xmin, xmax] and nothing extra is clipped
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale).float()
    scale = torch.where(scale == 0, torch.finfo(torch.float16).tiny, scale)  # fp16 underflow of tiny ranges
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.clamp(torch.round(-xmin / scale), 0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `w` [N, g] on the grid of per-row `scale`, `zero` [N] (float, same shape as w)."""
    return torch.clamp(torch.round(w.float() / scale.unsqueeze(1)) + zero.unsqueeze(1), 0, 2**bits - 1)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The weights that codes `q` [N, g] stand for on the grid of per-row `scale`, `zero` [N]."""
    return scale.unsqueeze(1) * (q - zero.unsqueeze(1))


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                 bias: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """Round-to-nearest quantization of one Linear weight [N, K], all groups at once.

    A last partial group is zero-padded: the grid always spans 0 (xmin <= 0 <= xmax), so padding with
    zeros does not change any group's scale or zero point.
    """
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    padded = torch.nn.functional.pad(weight.float(), (0, groups * size - k)).view(n * groups, size)
    scale, zero = find_params(padded, bits, sym)
    codes = quantize_codes(padded, scale, zero, bits).view(n, groups * size)[:, :k]
    return QuantizedWeight(codes.t().to(torch.uint8).contiguous(), scale.view(n, groups).t().half().contiguous(),
                           zero.view(n, groups).t().to(torch.uint8).contiguous(),
                           default_g_idx(k, group_size, weight.device), bits, group_size, bias)
