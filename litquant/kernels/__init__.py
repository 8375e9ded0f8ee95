"""The kernel registry: a name users type -> the module class that runs it.

Classes are imported lazily, so a kernel whose dependencies are missing (triton, a CUDA compiler)
costs nothing until it is asked for, and `litquant kernels` can say why it is unavailable.
"""
import importlib
import warnings
from typing import Dict, Iterable, List, Optional, Tuple, Type

import torch

from litquant.kernels.base import LayerSpec, QuantLinear

# name -> "module:Class".
REGISTRY: Dict[str, str] = {
    "marlin": "litquant.kernels.marlin:MarlinQuantLinear",
    "triton": "litquant.kernels.triton_kernel:TritonQuantLinear",
    "torch": "litquant.kernels.torch_dequant:TorchQuantLinear",
}
# The `auto` preference: the fastest first, the reference last. Measured on an H200
# (benchmarks/results/2026-11-30-kernels-v5.md and -v4.md), marlin is ahead of triton at M = 1..256 on
# every Llama-2 layer but one case (7B-down at M = 2), and within 4% at M >= 1024, where both ended in cuBLAS
# then (marlin now stays fused up to M = 16383 on Hopper; README, "How marlin runs a layer").
# For 8-bit layers triton's gemv takes 8-19% less time at M = 1 (decode), so marlin is not `auto`'s pick there
# (its `auto_bits`; 2026-12-01-kernels-8bit-v2.md and -v3.md).
AUTO_ORDER: Tuple[str, ...] = ("marlin", "triton", "torch")


class KernelNotSupported(ValueError):
    """The requested kernel cannot run these layers here; the message says why and what would."""


def resolve_device(device: Optional[str]) -> torch.device:
    """`device`, or by default cuda where torch sees a GPU and cpu otherwise, a GPU always with its index (plain
    cuda: the current one); a clear error for a device that this machine does not have (torch's own would come from
    deep inside the first copy to it)."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: use cuda, cuda:<index> or cpu") from e
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r} is not supported: use cuda, cuda:<index> or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here (torch {torch.__version__}); use cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """The activation dtype that generate, quantize and `litquant kernels` use unless told: bfloat16 on GPUs that
    have it, float16 on older ones, float32 on the CPU (where bf16 matmuls are slow on many machines)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.float32


def kernel_class(name: str) -> Type[QuantLinear]:
    if name not in REGISTRY:
        raise KernelNotSupported(f"unknown kernel {name!r}; known kernels: {', '.join(REGISTRY)} (or 'auto')")
    module, cls = REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:  # a missing optional dependency: report it as unavailable
        return _unavailable_kernel(name, f"cannot import {module}: {e}")


def _unavailable_kernel(name: str, reason: str) -> Type[QuantLinear]:
    return type(f"Unavailable_{name}", (QuantLinear,), {"name": name, "unavailable": classmethod(lambda cls: reason)})


def first_problem(cls: Type[QuantLinear], specs: Iterable[Tuple[str, LayerSpec]], device: torch.device,
                  dtype: torch.dtype) -> Optional[str]:
    for layer_name, spec in specs:
        reason = cls.unsupported(spec, device, dtype)
        if reason:
            return f"{layer_name}: {reason}"
    return None


def select_kernel(name: str, specs: List[Tuple[str, LayerSpec]], device: torch.device,
                  dtype: torch.dtype) -> Type[QuantLinear]:
    """The kernel class for `name` ('auto' picks the first of AUTO_ORDER that supports every layer and gets
    ready here: a CUDA build that fails moves on to the next), or raise
    `KernelNotSupported` naming the reason and the kernels that would work."""
    device = torch.device(device)
    if name == "auto":
        for candidate in AUTO_ORDER:
            cls = kernel_class(candidate)
            wanted = device.type in (cls.auto_devices or cls.devices) and all(
                spec.bits in (cls.auto_bits or cls.bits) for _, spec in specs)
            if wanted and first_problem(cls, specs, device, dtype) is None:
                problem = cls.prepare(device)
                if problem is None:
                    return cls
                warnings.warn(f"kernel 'auto': skipping {candidate}: {problem}")
        name = "torch"
    cls = kernel_class(name)
    problem = first_problem(cls, specs, device, dtype)
    if problem:
        working = [k for k in REGISTRY if k != name and first_problem(kernel_class(k), specs, device, dtype) is None]
        raise KernelNotSupported(f"kernel {name!r} cannot run this checkpoint on {device} in "
                                 f"{str(dtype).replace('torch.', '')}: {problem}. "
                                 f"Kernels that can run it here: {', '.join(working) or 'none'}")
    return cls


def check_kernel_settings(name: str, specs: List[Tuple[str, LayerSpec]]) -> None:
    """At quantize time: fail early if kernel `name` could never run these layers, whatever the machine."""
    if name == "auto":
        return
    cls = kernel_class(name)
    for layer_name, spec in specs:
        reason = cls.unsupported_settings(spec)
        if reason:
            working = [k for k in REGISTRY if all(kernel_class(k).unsupported_settings(s) is None for _, s in specs)]
            raise KernelNotSupported(f"kernel {name!r} cannot run the checkpoint these settings produce: {layer_name}: "
                                     f"{reason}. Kernels that can: {', '.join(working) or 'none'}")


def kernels_table(device: torch.device, dtype: torch.dtype) -> List[Tuple[str, str, str]]:
    """(name, status, description) for each registered kernel on `device` in `dtype`."""
    rows = []
    for name in REGISTRY:
        cls = kernel_class(name)
        reason = cls.cannot_run_here(device, dtype)
        rows.append((name, "ok" if reason is None else f"unavailable: {reason}", cls.description))
    return rows


def kernels(device: Optional[str] = None, dtype: Optional[str] = None, build: bool = False) -> None:
    """List the kernels, which of them run on this machine, and why the others do not.

    Args:
        device: cuda, cuda:<index> or cpu. Default: cuda (the current GPU) if available.
        dtype: activation dtype to check: float16, bfloat16 or float32. Default: what `generate` runs in there:
            bfloat16 on a GPU that has it (else float16), float32 on the CPU.
        build: compile the CUDA kernels now instead of on first use.
    """
    if dtype not in (None, "float16", "bfloat16", "float32"):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, not {dtype!r}")
    dev = resolve_device(device)
    if build:
        from litquant.kernels.build import build_all

        build_all()
    activation_dtype = getattr(torch, dtype) if dtype else default_dtype(dev)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"kernels on {where} ({str(activation_dtype).replace('torch.', '')}):")
    for name, status, description in kernels_table(dev, activation_dtype):
        print(f"  {name:<10} {status}\n  {'':<10} {description}")
