"""Round-to-nearest (RTN): quantize every Linear on its own, with no calibration data.

The baseline that GPTQ and AWQ must beat. It streams the source checkpoint tensor by tensor (the
`.pth` is memory-mapped), so peak memory is the quantized model plus one full-precision layer.
"""
from typing import Dict, Tuple

import torch
from litgpt.config import Config
from litgpt.model import GPT
from tqdm.auto import tqdm

from litquant.config import QuantizeConfig
from litquant.formats import QuantizedWeight
from litquant.precision import quantizable_linears
from litquant.quantize.quantizer import rtn_quantize


@torch.no_grad()
def quantize_state_dict(state: Dict[str, torch.Tensor], model_config: Config, config: QuantizeConfig,
                        device: torch.device, dtype: torch.dtype) -> Tuple[Dict[str, QuantizedWeight], Dict[str, torch.Tensor]]:
    """RTN of every quantizable Linear in `state` (a possibly memory-mapped litgpt state dict).

    Returns the quantized Linears by module name and the other tensors cast to `dtype`.
    """
    with torch.device("meta"):
        targets = {name for name, _ in quantizable_linears(GPT(model_config), config.ignore_modules)}
    quantized: Dict[str, QuantizedWeight] = {}
    others: Dict[str, torch.Tensor] = {}
    for name in tqdm(list(state), desc="rtn", unit="tensor", dynamic_ncols=True):
        module_name, _, key = name.rpartition(".")
        tensor = state[name]
        if module_name in targets and key == "weight":
            w = tensor.to(device, torch.float32)
            if not torch.isfinite(w).all():
                raise FloatingPointError(f"{name} has NaN or inf values; refusing to quantize it")
            quantized[module_name] = rtn_quantize(w, config.bits, config.group_size, config.sym).to("cpu")
        elif module_name in targets and key == "bias":
            others[name] = tensor.to(dtype)
        else:
            others[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for module_name, qw in quantized.items():
        qw.bias = others.pop(f"{module_name}.bias", None)
    missing = targets - set(quantized)
    if missing:
        raise KeyError(f"the checkpoint has no weight for {sorted(missing)[:5]}: it does not match model_config.yaml")
    return quantized, others
