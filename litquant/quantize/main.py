"""`litquant quantize`: turn a litgpt checkpoint into a quantized checkpoint with RTN, GPTQ or AWQ."""
import logging
import time
from pathlib import Path
from typing import List, Literal, Optional

import torch
from litgpt.config import Config
from litgpt.data import DataModule
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer

from litquant.checkpoint import check_out_dir, load_litgpt_state, save_quantized_checkpoint
from litquant.config import QuantizeConfig, is_quantized_checkpoint
from litquant.kernels import check_kernel_settings, default_dtype, resolve_device
from litquant.load import checkpoint_config, load_tokenizer
from litquant.precision import is_ignored, layer_specs
from litquant.quantize import awq, gptq, rtn
from litquant.quantize.calibration import calibration_files, calibration_tokens

log = logging.getLogger("litquant.quantize")
RECIPES = {"gptq": gptq, "awq": awq}  # the calibrated methods (RTN needs no model run)


def check_quantizable(checkpoint_dir: Path, config: QuantizeConfig) -> Config:
    """Check, before any work, that `config` can quantize the checkpoint and that its kernel can run the result;
    returns the model's config. (`benchmark` calls it for each method before its first row.)"""
    if is_quantized_checkpoint(checkpoint_dir):
        raise ValueError(f"{checkpoint_dir} is already quantized: quantize the full-precision checkpoint it came from")
    model_config = checkpoint_config(checkpoint_dir)
    load_tokenizer(checkpoint_dir)  # RTN reads it only when it saves, GPTQ and AWQ after loading the model
    with torch.device("meta"):  # the model's structure only
        structure = GPT(model_config)
    linears = [name for name, module in structure.named_modules() if isinstance(module, torch.nn.Linear)]
    for entry in config.ignore_modules:  # a typo would quietly quantize what it meant to keep
        if not any(is_ignored(name, [entry]) for name in linears):
            examples = [n for n in linears if not n.startswith("transformer.h.") or ".h.0." in n]
            raise ValueError(f"ignore_modules entry {entry!r} names no Linear of this model (a name or a prefix up to "
                             f"a dot); its Linears: {', '.join(examples)}, and so on in each block")
    check_kernel_settings(config.kernel, layer_specs(structure, config))
    if config.method in RECIPES:
        RECIPES[config.method].check_model(structure, config)
    return model_config


def quantize(
    checkpoint_dir: Path,
    out_dir: Optional[Path] = None,
    *,
    method: Literal["rtn", "gptq", "awq"] = "gptq",
    bits: int = 4,
    group_size: int = 128,
    sym: Optional[bool] = None,
    desc_act: bool = False,
    static_groups: bool = False,
    true_sequential: bool = True,
    damp_percent: float = 0.01,
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq",
    version: Literal["gemm", "gemv"] = "gemm",
    duo_scaling: bool = True,
    apply_clip: bool = True,
    kernel: str = "auto",
    data: Optional[DataModule] = None,
    calibration_file: Optional[Path] = None,
    num_samples: int = 128,
    seq_len: Optional[int] = None,
    batch_size: int = 8,
    device: Optional[str] = None,
    offload: bool = False,
    seed: int = 42,
    ignore_modules: List[str] = ["lm_head"],
    overwrite: bool = False,
) -> Path:
    """Quantize a litgpt checkpoint and save a quantized checkpoint (GPTQ or AutoAWQ format).

    Args:
        checkpoint_dir: the litgpt checkpoint to quantize (lit_model.pth, model_config.yaml, tokenizer).
        out_dir: where to write the quantized checkpoint. Default: `<checkpoint_dir>-<method>-<bits>bit-g<group_size>`.
        method: rtn (no data), gptq (Hessian-aware error feedback) or awq (activation-aware scaling).
        bits: bits per weight: 2, 3, 4 or 8 (AWQ: 4).
        group_size: input channels that share a scale and zero point; -1 for one group per row.
        sym: symmetric grid (no stored zero points). Default: true for rtn/gptq, false for awq.
        desc_act: GPTQ act_order: quantize columns in order of decreasing Hessian diagonal (saves g_idx).
        static_groups: GPTQ with desc_act: fix group parameters before reordering, so g_idx stays monotone.
        true_sequential: GPTQ: quantize attn.qkv, attn.proj, mlp.fc_1/fc_2, mlp.proj in turn, re-running inputs after
            each.
        damp_percent: GPTQ dampening, as a fraction of the mean Hessian diagonal.
        checkpoint_format: GPTQ tensor format: "gptq" (v1, AutoGPTQ's zero-minus-one) or "gptq_v2".
        version: AWQ tensor layout: "gemm" or "gemv" (AutoAWQ).
        duo_scaling: AWQ: scales from both activation and weight magnitudes.
        apply_clip: AWQ: search a clipping range per group.
        kernel: the kernel `litquant generate` uses by default: auto, or one that `litquant kernels` lists; checked
            against the settings before any work.
        data: a litgpt DataModule for calibration (e.g. Alpaca, where the hub is reachable).
        calibration_file: a .txt, .jsonl or .json file, or a directory of them, for calibration. With neither `data` nor
            this, calibration text is sampled from the model itself (data-free).
        num_samples: calibration sequences.
        seq_len: tokens per calibration sequence. Default: 2048 for gptq, 512 for awq.
        batch_size: calibration sequences per forward pass (also when the model writes its own calibration text).
        device: where blocks are quantized: cuda, cuda:<index> or cpu. Default: cuda if available, else cpu.
        offload: keep calibration activations on the CPU between blocks (for very large models).
        seed: seed for shuffling and self-generated calibration.
        ignore_modules: Linears left unquantized (prefix match on the LitGPT module name).
        overwrite: replace an existing checkpoint at out_dir (never a directory of other files).
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    checkpoint_dir = Path(checkpoint_dir)
    if seq_len is None:
        seq_len = 512 if method == "awq" else 2048
    if method != "rtn" and (num_samples < 1 or seq_len < 2 or batch_size < 1):
        raise ValueError(f"need num_samples >= 1, seq_len >= 2 and batch_size >= 1, got num_samples={num_samples}, "
                         f"seq_len={seq_len}, batch_size={batch_size}")
    if method != "rtn" and calibration_file is not None:
        calibration_files(calibration_file)  # a missing file fails here, not after the model has loaded
    config = QuantizeConfig.for_method(method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                                       static_groups=static_groups, true_sequential=true_sequential,
                                       damp_percent=damp_percent, checkpoint_format=checkpoint_format, version=version,
                                       kernel=kernel, ignore_modules=list(ignore_modules))
    model_config = check_quantizable(checkpoint_dir, config)
    if method != "rtn" and seq_len > model_config.block_size:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context, {model_config.block_size} tokens")
    if not out_dir:  # beside the checkpoint (resolved: `quantize .` names it after the directory, not "")
        source = checkpoint_dir.resolve()
        out_dir = source.parent / f"{source.name}-{method}-{bits}bit-g{group_size}"
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    device = resolve_device(device)
    dtype = default_dtype(device)
    save_dtype = torch.bfloat16
    state = load_litgpt_state(checkpoint_dir, model_config)
    log.info(f"quantizing {checkpoint_dir} with {config.describe()} on {device}")
    start = time.perf_counter()

    if method == "rtn":
        quantized, others = rtn.quantize_state_dict(state, model_config, config, device, save_dtype)
    else:
        model = GPT(model_config)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
        model.eval()
        tokens = calibration_tokens(Tokenizer(checkpoint_dir), model=model, data=data, calibration_file=calibration_file,
                                    num_samples=num_samples, seq_len=seq_len,
                                    seed=seed, device=device, batch_size=batch_size)
        recipe_options = dict(duo_scaling=duo_scaling, apply_clip=apply_clip) if method == "awq" else {}
        quantized = RECIPES[method].quantize_model(model, tokens, config, device=device, batch_size=batch_size,
                                                   offload=offload, dtype=dtype, **recipe_options)
        others = {n: t.to(save_dtype) if t.is_floating_point() else t for n, t in model.state_dict().items()
                  if n.rpartition(".")[0] not in quantized}
        for name, qw in quantized.items():
            qw.bias = others.pop(f"{name}.bias", None)
    save_quantized_checkpoint(out_dir, quantized, others, config, model_config, checkpoint_dir, overwrite=overwrite)
    log.info(f"saved {out_dir} ({len(quantized)} quantized Linears) in {time.perf_counter() - start:.1f} s")
    return out_dir
