"""The `torch` kernel: dequantize to the activation dtype, then `F.linear`.

Runs anywhere (CPU and CUDA, every bit width, group size, act_order and zero points) and is the
reference every other kernel is tested against. It keeps the weight packed as GPTQ v2 tensors (true
zero points), the smallest exact layout, and unpacks it on each call with a few vectorized shifts.
"""
import torch
import torch.nn.functional as F

from litquant.formats import QuantizedWeight, gptq
from litquant.formats.common import unpack_along_rows
from litquant.kernels.base import QuantLinear


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, dtype: torch.dtype) -> torch.Tensor:
    """GPTQ v2 tensors -> weight [N, K] in `dtype`."""
    k, n = g_idx.shape[0], scales.shape[1]
    codes = unpack_along_rows(qweight, bits, k)  # [K, N]
    zeros = unpack_along_rows(qzeros.t(), bits, n).t()  # [G, N]
    g = g_idx.long()
    compute = torch.float32 if dtype == torch.float32 or codes.device.type == "cpu" else dtype
    w = (codes.to(compute) - zeros.to(compute)[g]) * scales.to(compute)[g]
    return w.t().to(dtype)


class TorchQuantLinear(QuantLinear):
    name = "torch"
    description = "dequantize + F.linear; any device, every format (the reference)"

    def load_quantized(self, qw: QuantizedWeight) -> None:
        for key, t in gptq.pack(qw, "gptq_v2").items():
            if key != "bias":
                self.register_buffer(key, t)
        self.set_bias(qw.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.spec.bits, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
