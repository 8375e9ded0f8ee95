"""The `torch` kernel: dequantize to the activation dtype, then `F.linear`.

Runs anywhere (CPU and CUDA, every bit width, group size, act_order and zero points) and is the
reference every other kernel is tested against. It keeps the weight packed as GPTQ v2 tensors (true
zero points), the smallest exact layout, and unpacks it on each call with a few vectorized shifts.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from litquant.formats import QuantizedWeight, gptq
from litquant.formats.common import unpack_along_rows
from litquant.kernels.base import QuantLinear


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """GPTQ v2 tensors -> weight [N, K] in `dtype`. `group_size` -1 means: gather each row's group via
    g_idx (act_order, or one group); otherwise rows come in whole groups of `group_size` in order."""
    k, n = g_idx.shape[0], scales.shape[1]
    compute = torch.float32 if dtype == torch.float32 or qweight.device.type == "cpu" else dtype
    zeros = unpack_along_rows(qzeros.t(), bits, n).t().to(compute)  # [G, N], small
    scales = scales.to(compute)
    if 32 % bits == 0:  # shift whole words and convert once, then work in place: few passes over [K, N]
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device).view(1, -1, 1)
        w = (qweight.unsqueeze(1) >> shifts).bitwise_and_((1 << bits) - 1).view(-1, n)[:k].to(compute)
    else:
        w = unpack_along_rows(qweight, bits, k).to(compute)
    if group_size != -1 and k % group_size == 0:
        # groups are consecutive rows: broadcast each group's zero and scale instead of gathering per row
        grouped = w.view(-1, group_size, n)
        grouped.sub_(zeros.unsqueeze(1)).mul_(scales.unsqueeze(1))
    else:
        g = g_idx.long()
        w.sub_(zeros[g]).mul_(scales[g])
    return w.t().to(dtype)


class TorchQuantLinear(QuantLinear):
    name = "torch"
    description = "dequantize + F.linear; any device, every format (the reference)"
    concat_dims = {"qweight": 1, "qzeros": 1, "scales": 1, "g_idx": None}

    def concat(self, other: QuantLinear) -> Optional[QuantLinear]:
        # qzeros packs the zero points along N: the cut must fall on a word boundary
        return None if self.out_features * self.spec.bits % 32 else super().concat(other)

    def load_quantized(self, qw: QuantizedWeight) -> None:
        for key, t in gptq.pack(qw, "gptq_v2").items():
            if key != "bias":
                self.register_buffer(key, t)
        # the broadcast fast path needs rows in group order; act_order weights take the gather path
        self.group_size = -1 if qw.act_order else qw.group_size
        self.set_bias(qw.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.spec.bits, self.group_size, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
