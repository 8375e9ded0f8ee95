"""What every kernel module is: a `QuantLinear` that states what it supports and repacks at load.

A kernel is one subclass of `QuantLinear` in its own module, plus one line in the registry
(`litquant/kernels/__init__.py`). The class attributes are its contract: the registry checks them
against each layer before any weight is loaded, so an unsupported choice fails early, with a reason.
"""
import copy
import os
from dataclasses import dataclass, replace
from typing import ClassVar, Dict, Optional, Tuple

import torch
from torch import nn

from litquant.formats import QuantizedWeight


def dependent_launches_allowed() -> bool:
    """Whether kernels may be launched as programmatic dependents of the kernel ahead (sm_90 on): unless
    LITQUANT_PDL=0. marlin's launches read the same variable (litquant/csrc/marlin/marlin.cu), and so do Inductor's
    kernels in the compiled decode (`litquant.generate.compile_options`)."""
    return os.environ.get("LITQUANT_PDL") != "0"


@dataclass(frozen=True)
class LayerSpec:
    """What a kernel must handle for one quantized Linear."""

    in_features: int
    out_features: int
    bits: int
    group_size: int
    sym: bool
    act_order: bool


class QuantLinear(nn.Module):
    """A Linear whose weight is quantized. Subclasses set the contract below and implement
    `load_quantized` (repack a `QuantizedWeight` into the kernel's layout) and `forward`."""

    name: ClassVar[str]
    bits: ClassVar[Tuple[int, ...]] = (2, 3, 4, 8)
    group_sizes: ClassVar[Optional[Tuple[int, ...]]] = None  # None: any group size, -1 included
    zero_point: ClassVar[bool] = True  # asymmetric (GPTQ sym=False, AWQ) weights
    act_order: ClassVar[bool] = True
    dtypes: ClassVar[Tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    devices: ClassVar[Tuple[str, ...]] = ("cpu", "cuda")
    auto_devices: ClassVar[Optional[Tuple[str, ...]]] = None  # where `auto` may pick it (None: `devices`)
    auto_bits: ClassVar[Optional[Tuple[int, ...]]] = None  # the bit widths `auto` may pick it for (None: `bits`)
    min_capability: ClassVar[Optional[Tuple[int, int]]] = None  # CUDA compute capability
    k_multiple: ClassVar[int] = 1
    n_multiple: ClassVar[int] = 1
    compiles: ClassVar[bool] = True  # runs inside torch.compile / CUDA graphs
    # Set on a model's layers by litquant's compiled decode (`litquant.generate.set_next_token`): the kernel
    # ahead of each call is one of Inductor's small fused kernels or attention, never another quantized matmul, so a
    # kernel may launch accordingly (marlin: every decode grid as a programmatic dependent,
    # litquant/csrc/marlin/decode.cu).
    after_small_kernels: bool = False
    description: ClassVar[str] = ""
    # How two layers of this kernel on the same input become one (`concat`): for each buffer, the dim along
    # which it is cut by output column, or None for a buffer both must hold equal (an act_order permutation).
    # Empty: the kernel's layout does not concatenate.
    concat_dims: ClassVar[Dict[str, Optional[int]]] = {}

    @classmethod
    def unavailable(cls) -> Optional[str]:
        """Why this kernel cannot run on this machine at all (a missing package, compiler, GPU), else None."""
        return None

    @classmethod
    def prepare(cls, device: torch.device) -> Optional[str]:
        """Make the kernel ready to run on `device` (compiled kernels build here); why it cannot be, else None."""
        return None

    @classmethod
    def unsupported_settings(cls, spec: LayerSpec) -> Optional[str]:
        """Why this kernel cannot run a layer quantized as `spec`, on any machine; else None."""
        if spec.bits not in cls.bits:
            return f"supports {'/'.join(map(str, cls.bits))}-bit, not {spec.bits}-bit"
        if cls.group_sizes is not None and spec.group_size not in cls.group_sizes:
            return f"supports group_size {'/'.join(map(str, cls.group_sizes))}, not {spec.group_size}"
        if not spec.sym and not cls.zero_point:
            return "supports symmetric weights only, not zero points"
        if spec.act_order and not cls.act_order:
            return "does not support act_order (desc_act)"
        if spec.in_features % cls.k_multiple or spec.out_features % cls.n_multiple:
            return (f"needs in_features a multiple of {cls.k_multiple} and out_features a multiple of {cls.n_multiple}, "
                    f"got {spec.in_features}x{spec.out_features}")
        return None

    @classmethod
    def unsupported(cls, spec: LayerSpec, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """Why this kernel cannot run `spec` on `device` in `dtype` here, else None."""
        return cls.cannot_run_here(device, dtype) or cls.unsupported_settings(spec)

    @classmethod
    def cannot_run_here(cls, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """Why this kernel cannot run any layer on `device` in `dtype` here, else None."""
        reason = cls.unavailable()
        if reason:
            return reason
        if device.type not in cls.devices:
            return f"runs on {'/'.join(cls.devices)}, not {device.type}"
        if device.type == "cuda" and cls.min_capability is not None:
            cap = torch.cuda.get_device_capability(device)
            if cap < cls.min_capability:
                return f"needs compute capability >= {cls.min_capability[0]}.{cls.min_capability[1]}, this GPU is {cap[0]}.{cap[1]}"
        if dtype not in cls.dtypes:
            return f"supports {'/'.join(str(d).replace('torch.', '') for d in cls.dtypes)}, not {str(dtype).replace('torch.', '')}"
        return None

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: LayerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.spec, self.dtype = in_features, out_features, spec, dtype
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta"), requires_grad=False) if bias else None

    def load_quantized(self, qw: QuantizedWeight) -> None:
        """Take the weight (already on the target device) into this module's layout."""
        raise NotImplementedError

    def set_bias(self, bias: Optional[torch.Tensor]) -> None:
        """Take the bias (no-op without one: a bias left on meta is reported by the loader)."""
        if self.bias is not None and bias is not None:
            self.bias = nn.Parameter(bias.to(self.dtype), requires_grad=False)

    def concat(self, other: "QuantLinear") -> Optional["QuantLinear"]:
        """One layer whose output is `torch.cat([self(x), other(x)], -1)`, in new memory (the two can be
        dropped), or None when they do not concatenate: another kernel or quantization, other act_order
        permutations, buffers that differ across the output-column cut, or no `concat_dims`."""
        if (not self.concat_dims or type(other) is not type(self) or self.in_features != other.in_features
                or replace(self.spec, out_features=0) != replace(other.spec, out_features=0)
                or (self.bias is None) != (other.bias is None) or self._buffers.keys() != other._buffers.keys()
                or not self._buffers.keys() <= self.concat_dims.keys()):
            return None
        buffers = {}
        for name, mine in self._buffers.items():
            theirs, dim = other._buffers[name], self.concat_dims[name]
            if mine is None or theirs is None or dim is None:  # must be the same in both (absent in both)
                both_absent = mine is None and theirs is None
                if not both_absent and (mine is None or theirs is None or not torch.equal(mine, theirs)):
                    return None
                buffers[name] = None if both_absent else mine.clone()
            elif mine.shape[:dim] + mine.shape[dim + 1:] != theirs.shape[:dim] + theirs.shape[dim + 1:]:
                return None
            else:
                buffers[name] = torch.cat([mine, theirs], dim)
        # A shallow copy keeps what load_quantized set besides buffers (group size, padding, thresholds);
        # nn.Module.__init__ then gives it its own parameter, buffer and hook tables.
        fused = copy.copy(self)
        nn.Module.__init__(fused)
        fused.train(self.training)
        fused.out_features = self.out_features + other.out_features
        fused.spec = replace(self.spec, out_features=fused.out_features)
        for name, tensor in buffers.items():
            fused.register_buffer(name, tensor, persistent=name not in self._non_persistent_buffers_set)
        fused.bias = None if self.bias is None else nn.Parameter(torch.cat([self.bias, other.bias]), requires_grad=False)
        return fused

    def extra_repr(self) -> str:
        s = self.spec
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={s.bits}, "
                f"group_size={s.group_size}, sym={s.sym}, act_order={s.act_order}, kernel={self.name}")
