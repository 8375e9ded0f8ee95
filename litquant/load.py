"""Load any checkpoint a litquant user has, ready to run: quantized (any kernel), or ordinary
(full precision, bitsandbytes, or RTN while loading)."""
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import lightning as L
import torch
import yaml
from litgpt.config import Config
from litgpt.model import GPT

from litquant.checkpoint import (CheckpointError, materialize_rope, check_materialized, load_litgpt_state,
                                 load_quantized_checkpoint, load_with_rtn, open_weights)
from litquant.config import QuantizeConfig, is_quantized_checkpoint
from litquant.fuse import fuse_gate_up
from litquant.kernels import KernelNotSupported, default_dtype, resolve_device, select_kernel
from litquant.precision import QuantizedPrecision, layer_specs, quantizable_linears
from litquant.tokenizer import Tokenizer

BNB_MODES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")
RTN_PATTERN = re.compile(r"^rtn\.int([2348])(?:-g(-1|\d+))?$")
PRECISIONS = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32}


@dataclass
class LoadedModel:
    fabric: L.Fabric
    model: GPT
    tokenizer: Tokenizer
    config: Config
    quantization: str  # what the user is running, for tables and logs
    kernel: Optional[str]
    load_seconds: float


def checkpoint_config(checkpoint_dir: Path) -> Config:
    """The model config of a litgpt or litquant checkpoint directory, or a clear error if it is not one: its
    model_config.yaml or tokenizer missing, or its model_config.yaml unreadable (checked here, before any work)."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / "model_config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a litgpt or litquant checkpoint")
    if not any((checkpoint_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(f"{checkpoint_dir} has no tokenizer.json or tokenizer.model: copy the tokenizer files "
                                "of the model into it (litgpt's download puts them there)")
    try:
        return Config.from_file(path)
    except (yaml.YAMLError, UnicodeDecodeError, AttributeError, TypeError, ValueError) as e:  # AttributeError: not a
        # mapping; TypeError: a field litgpt's Config does not have
        raise CheckpointError(f"{path} is not a valid litgpt model config ({type(e).__name__}: {e})") from None


def load_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    """litgpt's Tokenizer of a checkpoint (litquant's subclass, which streams whole characters), or an error that
    names the file it could not read (the tokenizers library raises a bare Exception without one, and a corrupt
    tokenizer_config.json a JSONDecodeError)."""
    try:
        return Tokenizer(checkpoint_dir)
    except Exception as e:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(checkpoint_dir) / name).is_file():
                try:
                    json.loads((Path(checkpoint_dir) / name).read_text(encoding="utf-8"))
                except ValueError as bad:  # JSONDecodeError or UnicodeDecodeError
                    raise CheckpointError(f"{Path(checkpoint_dir) / name} is corrupt: {bad}") from None
        raise CheckpointError(f"the tokenizer of {checkpoint_dir} cannot be loaded ({type(e).__name__}: {e})") from None


def parse_rtn(quantize: str) -> Tuple[int, int]:
    m = RTN_PATTERN.match(quantize)
    if not m:
        raise ValueError(f"--quantize {quantize!r}: expected one of {BNB_MODES} or rtn.int<bits>[-g<group_size>], "
                         "e.g. rtn.int4-g128")
    return int(m.group(1)), int(m.group(2) or 128)


@dataclass
class LoadPlan:
    """What `load_model` will load, with every refusal that needs no weights already made."""
    checkpoint_dir: Path
    config: Config
    device: torch.device
    precision: str
    tokenizer: Tokenizer
    qconfig: Optional[QuantizeConfig]  # for a quantized checkpoint, or RTN while loading
    kernel: Optional[str]
    quantize: Optional[str]
    quantized: bool


def plan_load(checkpoint_dir: Path, *, kernel: Optional[str] = None, quantize: Optional[str] = None,
              precision: Optional[str] = None, device: Optional[str] = None) -> LoadPlan:
    """Check the checkpoint and the settings before any weight is read: the config, the device and precision, the
    quantize config, the weights file's header (a truncated file fails here), and a kernel named for this device.
    `serve` calls it in its own process, because LitServe loads the model in a worker, where a refusal would end
    in a traceback."""
    checkpoint_dir = Path(checkpoint_dir)
    config = checkpoint_config(checkpoint_dir)
    device = resolve_device(device)
    precision = precision or {dtype: name for name, dtype in PRECISIONS.items()}[default_dtype(device)]
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    quantized = is_quantized_checkpoint(checkpoint_dir)
    if quantized and quantize:
        raise ValueError(f"{checkpoint_dir} is already quantized; drop --quantize")
    if kernel and not quantized and not (quantize or "").startswith("rtn"):
        raise ValueError("--kernel applies to quantized checkpoints and --quantize rtn.*; this checkpoint is neither")
    qconfig = None
    if quantized:
        qconfig = QuantizeConfig.load(checkpoint_dir)
    elif (quantize or "").startswith("rtn"):
        bits, group_size = parse_rtn(quantize)
        qconfig = QuantizeConfig(method="rtn", bits=bits, group_size=group_size)
    elif quantize and quantize not in BNB_MODES:
        parse_rtn(quantize)  # raises the error that lists the valid choices
    if qconfig:
        recorded, kernel = not kernel, kernel or qconfig.kernel
        if kernel != "auto":  # auto falls back to torch; it is picked (and built) at load
            with torch.device("meta"):
                specs = layer_specs(GPT(config), qconfig)
            try:
                select_kernel(kernel, specs, device, PRECISIONS[precision])
            except KernelNotSupported as e:
                if not recorded:
                    raise
                raise KernelNotSupported(f"{e}. {kernel!r} is the kernel that the checkpoint's quantize_config.json "
                                         "names; --kernel picks another (auto: the first that runs here)") from None
    if quantized:
        open_weights(checkpoint_dir, torch.device("cpu"))  # the header: a truncated file fails here
    tokenizer = load_tokenizer(checkpoint_dir)
    return LoadPlan(checkpoint_dir, config, device, precision, tokenizer, qconfig, kernel, quantize, quantized)


def load_model(checkpoint_dir: Path, *, kernel: Optional[str] = None, quantize: Optional[str] = None,
               precision: Optional[str] = None, device: Optional[str] = None) -> LoadedModel:
    """Build the model on the meta device and load `checkpoint_dir` into it.

    A quantized checkpoint runs with `kernel` (default: the one recorded at quantize time, else auto).
    An ordinary checkpoint runs in `precision`, or quantized while loading with `quantize`
    (bitsandbytes modes, or `rtn.int4-g128` style RTN with litquant's kernels). With litquant's kernels, the
    gate and up projections of LLaMA-style MLPs run as one matmul (`litquant.fuse`). A GPU `device` becomes the
    current CUDA device, as Fabric's `launch` makes it.
    """
    start = time.perf_counter()
    plan = plan_load(checkpoint_dir, kernel=kernel, quantize=quantize, precision=precision, device=device)
    checkpoint_dir, config, device, dtype = plan.checkpoint_dir, plan.config, plan.device, PRECISIONS[plan.precision]
    if device.type == "cuda":
        # Triton's launches, CUDA graph captures and the generate loop's own allocations go to the current device,
        # whatever device their tensors are on
        torch.cuda.set_device(device)
    if plan.qconfig:
        plugin = QuantizedPrecision(plan.qconfig, kernel=plan.kernel, dtype=dtype, device=device)
        fabric = one_device_fabric(device, plugins=plugin)
        with fabric.init_module(empty_init=True):
            model = GPT(config)
        plugin.convert_module(model)  # selects the kernel ('auto': the first that runs here) before any weight is read
        if plan.quantized:
            load_quantized_checkpoint(model, checkpoint_dir, plan.qconfig, device, dtype)
        else:
            load_with_rtn(model, load_litgpt_state(checkpoint_dir, config).items(), plan.qconfig, device, dtype)
        fuse_gate_up(model)
        label, kernel = plan.qconfig.describe(), plugin.kernel_cls.name
    elif plan.quantize:
        fabric = one_device_fabric(device, precision=plan.precision)
        model = _load_bnb(config, checkpoint_dir, plan.quantize[4:], dtype, device)
        label, kernel = plan.quantize, None
    else:
        fabric = one_device_fabric(device, precision=plan.precision)
        model = _load_plain(fabric, config, checkpoint_dir)
        label, kernel = str(dtype).replace("torch.", ""), None
    model.eval()
    model = fabric.setup_module(model)
    return LoadedModel(fabric, model, plan.tokenizer, config, label, kernel, time.perf_counter() - start)


def one_device_fabric(device: torch.device, **kwargs) -> L.Fabric:
    """A Fabric on `device` itself: Fabric's `devices=1` alone means the first GPU, whatever index `device` has."""
    return L.Fabric(accelerator=device.type, devices=[device.index] if device.type == "cuda" else 1, **kwargs)


def _load_bnb(config: Config, checkpoint_dir: Path, mode: str, dtype: torch.dtype, device: torch.device) -> GPT:
    """The bitsandbytes 4-bit baseline: the Linear4bit layers Lightning's `BitsandbytesPrecision` builds
    (lm_head left in `dtype`, as litquant does), built here directly because that plugin refuses the CPU,
    where bitsandbytes >= 0.45 runs nf4/fp4 too."""
    # On CPUs with AVX512-BF16, bitsandbytes' import tries to fetch an optional kernel from the Hugging Face Hub through
    # the `kernels` package and, without it, logs "Failed to load CPU gemm_4bit_forward ...", then runs its own code
    # as it does everywhere else: nothing has failed, so the message is left out.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda r: "gemm_4bit_forward" not in r.getMessage())
    import bitsandbytes as bnb

    state = load_litgpt_state(checkpoint_dir, config)
    with torch.device("meta"):
        model = GPT(config)
    quant_type, double_quant = mode.split("-")[0], mode.endswith("-dq")
    for name, linear in quantizable_linears(model, ["lm_head"]):
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=dtype, quant_type=quant_type, compress_statistics=double_quant,
                                  device="meta")
        layer.weight = bnb.nn.Params4bit(state.pop(f"{name}.weight").to(dtype), requires_grad=False,
                                         quant_type=quant_type, compress_statistics=double_quant).to(device)
        if linear.in_features % layer.weight.quant_state.blocksize or linear.out_features % 32:
            # bitsandbytes' AVX512-BF16 CPU path (0.50) repacks the weight assuming whole quantization blocks along
            # K and 32-row tiles along N, and fails on other shapes; its generic path takes any shape
            layer.support_avx512bf16_for_cpu = False
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(state.pop(f"{name}.bias").to(device, dtype), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    model.load_state_dict({n: t.to(device, dtype) for n, t in state.items()}, strict=False, assign=True)
    materialize_rope(model, device)
    check_materialized(model)
    return model


def _load_plain(fabric: L.Fabric, config: Config, checkpoint_dir: Path) -> GPT:
    state = load_litgpt_state(checkpoint_dir, config)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model.load_state_dict(state, strict=True)  # load_model wraps it with fabric.setup_module once, for every path
    return model
