"""The Fabric precision plugin that runs a LitGPT model with quantized Linears.

`QuantizedPrecision` does for litquant's kernels what Lightning's `BitsandbytesPrecision` does for
bitsandbytes: inside `fabric.init_module()` the model is built on the meta device (so the full-precision
model is never materialized), and `convert_module` swaps every `nn.Linear` (except `ignore_modules`,
`lm_head` by default) for the chosen kernel's `QuantLinear`. The kernel is chosen, and checked against
every layer, *before* any weight is read: an unsupported choice fails with the reason and the kernels
that would work. Weights then arrive through `checkpoint.load_quantized_checkpoint` (a quantized
checkpoint) or, with an RTN `config` and an ordinary checkpoint, as full-precision weights that are quantized
while they load (`checkpoint.load_with_rtn`).
"""
from contextlib import ExitStack
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.utilities.types import _DEVICE
from torch import nn

from litquant.config import QuantizeConfig
from litquant.kernels import select_kernel
from litquant.kernels.base import LayerSpec, QuantLinear


def is_ignored(name: str, ignore_modules: Iterable[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in ignore_modules)


def quantizable_linears(model: nn.Module, ignore_modules: Iterable[str],
                        prefix: str = "") -> List[Tuple[str, nn.Linear]]:
    """The (name, module) of every Linear that a quantized checkpoint of `model` quantizes; for a submodule, its
    full name in the model is `prefix` + name. MoE routers (`mlp.gate`) always stay in full precision: they are
    tiny and routing is sensitive to their error."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and not is_ignored(prefix + name, ignore_modules) and not (prefix + name).endswith("mlp.gate")]


def layer_specs(model: nn.Module, config: QuantizeConfig) -> List[Tuple[str, LayerSpec]]:
    return [(name, LayerSpec(m.in_features, m.out_features, config.bits, config.group_size, config.sym, config.desc_act))
            for name, m in quantizable_linears(model, config.ignore_modules)]


class QuantizedPrecision(Precision):
    """Run a model whose Linears are quantized as `config` says, with `kernel`, in `dtype` on `device`.

    Args:
        config: the checkpoint's quantization settings (from its quantize_config.json), or the RTN
            settings to quantize an ordinary checkpoint with while it loads.
        kernel: a registered kernel name, or "auto" for the fastest that supports every layer.
        dtype: the activation dtype (and of the unquantized parameters).
        device: where the model will run; the kernel is checked against it.
    """

    def __init__(self, config: QuantizeConfig, kernel: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 device: _DEVICE = "cpu") -> None:
        self.config, self.kernel, self.dtype, self.device = config, kernel, dtype, torch.device(device)
        self.kernel_cls: Optional[type] = None

    def module_init_context(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(_default_dtype(self.dtype))
        return stack

    def tensor_init_context(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(_default_dtype(self.dtype))
        return stack

    def forward_context(self) -> ExitStack:
        return self.tensor_init_context()

    def convert_module(self, module: nn.Module) -> nn.Module:
        if any(isinstance(m, QuantLinear) for m in module.modules()):
            return module  # already converted
        specs = layer_specs(module, self.config)
        if not specs:
            raise ValueError("QuantizedPrecision found no Linear layers to quantize in this model")
        self.kernel_cls = select_kernel(self.kernel, specs, self.device, self.dtype)
        spec_by_name: Dict[str, LayerSpec] = dict(specs)
        for name, linear in quantizable_linears(module, self.config.ignore_modules):
            q = self.kernel_cls(linear.in_features, linear.out_features, linear.bias is not None,
                                spec_by_name[name], self.dtype)
            parent_name, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, child, q)
        return module

    def convert_input(self, data: Any) -> Any:
        return _convert_floats(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return _convert_floats(data, torch.get_default_dtype())


class _default_dtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *args: Any) -> None:
        torch.set_default_dtype(self.previous)


def _convert_floats(data: Any, dtype: torch.dtype) -> Any:
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)
