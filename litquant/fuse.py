"""One quantized matmul for the gate and up projections of every LLaMA-style MLP, done at load.

litgpt's `LLaMAMLP` runs `fc_1(x)` and `fc_2(x)` on the same input: two quantized matmuls, each paying a
kernel's fixed cost (launch, ramp-up, the split-K reduction), which at batch-1 decode is a good part of a small
layer's time. Their weights side by side are one layer of twice the columns, so the loader swaps each such MLP
for `GateUpMLP`, which runs that one layer and splits its output. The checkpoint is untouched (fc_1 and fc_2
stay separate tensors on disk, as every GPTQ/AWQ tool writes them); only the loaded model differs. vLLM merges
these two projections the same way (its "gate_up_proj").

Layers that do not concatenate stay as they are: kernels without `concat_dims`, or act_order weights whose
two permutations differ (GPTQ quantizes fc_1 and fc_2 from the same Hessian, so they normally agree).
"""
import torch
import torch.nn.functional as F
from litgpt.model import LLaMAMLP
from torch import nn

from litquant.kernels.base import QuantLinear


class GateUpMLP(nn.Module):
    """`LLaMAMLP` with fc_1 and fc_2 as one layer: `proj(silu(fc_1(x)) * fc_2(x))`."""

    def __init__(self, fc_1_2: QuantLinear, proj: nn.Module, intermediate_size: int) -> None:
        super().__init__()
        self.fc_1_2, self.proj, self.intermediate_size = fc_1_2, proj, intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc_1, x_fc_2 = self.fc_1_2(x).split(self.intermediate_size, dim=-1)
        return self.proj(F.silu(x_fc_1) * x_fc_2)


def fuse_gate_up(model: nn.Module) -> int:
    """Swap every `LLaMAMLP` whose fc_1 and fc_2 are quantized layers that concatenate for a `GateUpMLP`;
    returns how many were swapped. Run it after the weights are loaded."""
    swapped = 0
    for name, mlp in list(model.named_modules()):
        if type(mlp) is not LLaMAMLP or not isinstance(mlp.fc_1, QuantLinear):
            continue
        fc_1_2 = mlp.fc_1.concat(mlp.fc_2)
        if fc_1_2 is None:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, GateUpMLP(fc_1_2, mlp.proj, mlp.intermediate_size))
        swapped += 1
    return swapped
