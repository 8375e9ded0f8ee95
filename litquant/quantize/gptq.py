"""GPTQ: accurate post-training quantization for generative transformers (Frantar et al., 2022, arXiv:2210.17323).

Each Linear `W` [N, K] is quantized to minimize its output error on calibration inputs X [K, n tokens],
||W X - Q X||^2 = n/2 * trace((W - Q) H (W - Q)^T) with H = 2 X X^T / n. The rows of W share H and are
independent, so all rows go through the same column loop (written over matrices):

1. For input column k (in order, or by descending H_kk with act_order): quantize it on the grid of its
   group, Q[:, k] = quant(W[:, k]).
2. Spread the error over the columns not yet quantized (F), the Optimal Brain Surgeon update
   W[:, F] -= (W[:, k] - Q[:, k]) / [H_F^-1]_kk * [H_F^-1]_k,F  (F includes k).
3. Every H_F^-1 the loop needs comes from one factorization: with U the upper Cholesky factor of H^-1
   (H^-1 = U^T U), row k of H_F^-1 is U_kk times row k of U. The update becomes
   W[:, k+1:] -= E[:, k] U[k, k+1:] with E[:, k] = (W[:, k] - Q[:, k]) / U_kk.
4. Lazy batch updates: step 3 touches only the current block of `block_size` columns; the rest of W
   gets the block's accumulated errors in one matmul (E[:, block] @ U[block, after]).

Since every update is exact, W0 - Q = E U, and trace((W0 - Q) H (W0 - Q)^T) = ||E||^2 (U H U^T = I): the
loss we report, ||E||^2 / 2, is the output error per calibration token, ||(W0 - Q) X||^2 / n, of the
returned (dequantized) weight under the damped H. Tests check this identity, which also proves that the
QuantizedWeight is exactly what the loop optimized.

Details from the paper and its reference code (IST-DASLab/gptq), written anew here:
- dampening: H += damp_percent * mean(diag H) * I before the Cholesky; when it still fails (fp32 rounding
  makes rank-deficient Hessians indefinite), damping grows x10 until it works, with a warning;
- dead inputs (H_kk = 0: the input channel was always zero) get H_kk = 1 and W[:, k] = 0;
- groups: a group's scale and zero point come from its columns as updated when the group starts. We align
  the lazy blocks on group boundaries so that those columns have received every earlier update;
- act_order (desc_act): columns in order of decreasing H_kk; groups are then consecutive in that order, so
  g_idx is not monotone in the original order. static_groups fixes each group's grid on the original
  weight, in the original order, before any update, so that g_idx stays k // group_size.

Within a transformer block, `block_quantizer` follows the true-sequential order of the paper's code: the
Linears of a litgpt block are quantized stage by stage (attn.qkv, attn.proj, the MLP's input Linears, the
MLP's output Linear), each stage against inputs recomputed through the stages already quantized.
"""
import logging
import re
import resource
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from litgpt.model import GPT, Block

from litquant.config import QuantizeConfig
from litquant.formats import QuantizedWeight
from litquant.formats.common import num_groups
from litquant.kernels import default_dtype
from litquant.precision import quantizable_linears
from litquant.quantize.blockwise import BlockInputs, QuantizeBlock, check_linears_in_blocks, quantize_blockwise
from litquant.quantize.quantizer import dequantize_codes, find_params, quantize_codes, rtn_quantize

log = logging.getLogger("litquant.quantize")

# When dampening fails, it is multiplied by this factor (starting from at least the floor) until it
# exceeds the cap, a fraction of the mean Hessian diagonal.
DAMP_GROWTH, DAMP_FLOOR, DAMP_CAP = 10.0, 0.01, 1.0

# The order in which a litgpt Block calls its Linears (names with any `experts.{j}.` removed). Linears of
# one stage read inputs that no other Linear of the stage produces, so they are quantized together.
SEQUENTIAL_STAGES = (
    ("attn.qkv",),
    ("attn.proj",),
    ("mlp.fc_1", "mlp.fc_2", "mlp.fc"),
    ("mlp.proj",),
)
_EXPERT = re.compile(r"(shared_)?experts\.(\d+\.)?")


class Hessian:
    """The running average H = 2 X X^T / n over the n calibration tokens a Linear has seen (fp32 [K, K])."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.matrix = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Fold a batch of inputs [..., K] into the average."""
        x = x.reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return
        total = self.tokens + x.shape[0]
        # H <- H * n / (n + m) + 2 X^T X / (n + m), in one addmm
        self.matrix.addmm_(x.t(), x, beta=self.tokens / total, alpha=2.0 / total)
        self.tokens = total


def inverse_cholesky(hessian: torch.Tensor, damp_percent: float, name: str = "weight") -> Tuple[torch.Tensor, float]:
    """U, upper triangular with U^T U = (H + damp * mean(diag H) * I)^-1, and the damp fraction that worked.

    Raises the dampening (x10, up to `DAMP_CAP`) while H is not numerically positive definite.
    """
    mean_diag = hessian.diagonal().mean()
    damp = damp_percent
    while True:
        damped = hessian.clone()
        damped.diagonal().add_(damp * mean_diag)
        lower, info = torch.linalg.cholesky_ex(damped)
        if info.item() == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if info.item() == 0 and torch.isfinite(upper).all():
                return upper, damp
        next_damp = max(damp * DAMP_GROWTH, DAMP_FLOOR)
        if next_damp > DAMP_CAP:
            raise torch.linalg.LinAlgError(
                f"{name}: the Hessian is not positive definite even with damp_percent={damp:g}; "
                "the calibration data may be degenerate (too few or repeated tokens)")
        log.warning(f"{name}: Cholesky failed with damp_percent={damp:g}; retrying with damp_percent={next_damp:g}")
        damp = next_damp


@torch.no_grad()
def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                         desc_act: bool = False, static_groups: bool = False, damp_percent: float = 0.01,
                         block_size: int = 128, *, name: str = "weight") -> Tuple[QuantizedWeight, float]:
    """GPTQ of one Linear weight [N, K] against its Hessian [K, K] (2 X X^T / n of its inputs).

    Runs on the device of `weight` and `hessian`. Returns the QuantizedWeight in the original column order
    (with act_order, a non-monotone g_idx), without bias, and the loss: the mean squared output error per
    calibration token, trace((W - Q) H (W - Q)^T) / 2 with the damped H.

    Args:
        weight: the Linear's weight [N, K] (any float dtype; the work is in fp32).
        hessian: H [K, K]; it is not modified.
        bits: bits per weight (2 to 8).
        group_size: input columns per scale/zero group, -1 for one group; need not divide K.
        sym: symmetric grid (zero point 2**(bits-1)) instead of a fitted zero point.
        desc_act: act_order, quantize columns in order of decreasing H_kk.
        static_groups: fix each group's grid on the unquantized weight, in the original order.
        damp_percent: dampening as a fraction of the mean of diag(H).
        block_size: columns per lazy batch update.
        name: the Linear's name, for messages.
    """
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D [out_features, in_features], got shape {list(weight.shape)}")
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"{name}: the Hessian has shape {list(hessian.shape)}, expected [{k}, {k}]")
    if not 2 <= bits <= 8:
        raise ValueError(f"{name}: bits must be between 2 and 8, not {bits}")
    if group_size != -1 and group_size < 1:
        raise ValueError(f"{name}: group_size must be -1 or positive, not {group_size}")
    if not 0 <= damp_percent < 1:
        raise ValueError(f"{name}: damp_percent must be in [0, 1), not {damp_percent}")
    if not torch.isfinite(hessian).all():
        raise FloatingPointError(f"{name}: the Hessian has NaN or inf entries (were the calibration activations "
                                 "finite?); cannot quantize")
    if not torch.isfinite(weight).all():
        raise FloatingPointError(f"{name}: the weight has NaN or inf entries; cannot quantize")

    w = weight.float().clone()
    h = hessian.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    group = k if group_size == -1 else group_size
    n_groups = num_groups(k, group_size)
    scales = torch.empty(n_groups, n, dtype=torch.float32, device=w.device)
    zeros = torch.empty_like(scales)
    if static_groups:
        for g in range(n_groups):
            scales[g], zeros[g] = find_params(w[:, g * group:(g + 1) * group], bits, sym)

    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if desc_act else torch.arange(k, device=w.device)
    if desc_act:
        w, h = w[:, perm], h[perm][:, perm]
    # group of each column in quantization order: consecutive in that order, except with static groups
    group_of = (perm // group if static_groups else torch.arange(k, device=w.device) // group).tolist()
    if group_size != -1 and not static_groups:
        # blocks start on group boundaries, so a group's columns are fully updated when its grid is fitted
        block_size = group * max(1, block_size // group)

    u, _ = inverse_cholesky(h, damp_percent, name)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    loss = torch.zeros((), dtype=torch.float32, device=w.device)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb = w[:, b0:b1]  # a view: the in-block updates land in w
        ub = u[b0:b1, b0:b1]
        errors = torch.empty(n, b1 - b0, dtype=torch.float32, device=w.device)
        for j in range(b1 - b0):
            col = b0 + j
            if not static_groups and col % group == 0:
                scales[col // group], zeros[col // group] = find_params(w[:, col:col + group], bits, sym)
            g = group_of[col]
            x = wb[:, j:j + 1]
            q = quantize_codes(x, scales[g], zeros[g], bits)
            codes[:, col] = q[:, 0].to(torch.uint8)
            err = (x - dequantize_codes(q, scales[g], zeros[g])) / ub[j, j]
            wb[:, j + 1:].addmm_(err, ub[j:j + 1, j + 1:], alpha=-1.0)
            errors[:, j:j + 1] = err
        w[:, b1:].addmm_(errors, u[b0:b1, b1:], alpha=-1.0)
        loss += errors.square().sum()

    # back to the original column order
    g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
    g_idx[perm] = torch.tensor(group_of, dtype=torch.int32, device=w.device)
    original_codes = torch.empty_like(codes)
    original_codes[:, perm] = codes
    qw = QuantizedWeight(original_codes.t().contiguous(), scales.half(), zeros.to(torch.uint8), g_idx, bits, group_size)
    return qw, loss.item() / 2


def sequential_stages(names: List[str]) -> List[List[str]]:
    """Split a block's Linear names into the stages of `SEQUENTIAL_STAGES`, in the order the block calls them."""
    stage_of = {}
    for name in names:
        role = _EXPERT.sub("", name)
        stage = next((i for i, roles in enumerate(SEQUENTIAL_STAGES) if role in roles), None)
        if stage is None:
            raise ValueError(f"true_sequential: {name!r} is not a Linear of a known litgpt block "
                             f"({', '.join(r for roles in SEQUENTIAL_STAGES for r in roles)}); "
                             "quantize with true_sequential=False")
        stage_of[name] = stage
    return [[n for n in names if stage_of[n] == i] for i in range(len(SEQUENTIAL_STAGES)) if i in stage_of.values()]


class StageInputsSeen(Exception):
    """Raised once every Linear of a stage has had its input in this pass: the rest of the block's forward would
    compute nothing that the Hessians need."""


@torch.no_grad()
def collect_hessians(block: Block, inputs: BlockInputs, names: List[str]) -> Dict[str, Hessian]:
    """One pass of the calibration inputs through `block`, accumulating the Hessian of each named Linear.

    Linears called on the very same input tensor (`mlp.fc_1` and `mlp.fc_2`) share one Hessian: the
    result maps each of them to the same object. A Linear the block never called is absent. Each batch's pass
    stops at the last of the Linears to get its input (the stages of true_sequential: `attn.qkv`'s pass is the norm
    before it, `attn.proj`'s the attention), unless one of them is not called (an MoE expert no token chose).
    """
    hessians: Dict[str, Hessian] = {}
    seen: List[Tuple[torch.Tensor, str]] = []  # the inputs met during the current forward pass
    waiting = set(names)  # the Linears of this stage not yet called in the current pass

    def hook(name: str, module: nn.Linear, args: tuple) -> None:
        x = args[0]
        if name not in hessians:  # first call: share the Hessian of a Linear that read this same tensor
            owner = next((other for tensor, other in seen if tensor is x), None)
            hessians[name] = hessians[owner] if owner is not None else Hessian(module.in_features, x.device)
        if not any(tensor is x for tensor, _ in seen):
            hessians[name].add(x)
            seen.append((x, name))
        waiting.discard(name)
        if not waiting:
            raise StageInputsSeen

    handles = [block.get_submodule(name).register_forward_pre_hook(lambda m, args, name=name: hook(name, m, args))
               for name in names]
    try:
        for h in inputs.batches():
            try:
                inputs.forward_block(block, h)
            except StageInputsSeen:
                pass
            seen.clear()
            waiting.update(names)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def block_quantizer(config: QuantizeConfig, block_size: int = 128) -> QuantizeBlock:
    """The GPTQ `quantize_block(block, inputs, prefix)` for `quantize_blockwise`."""

    @torch.no_grad()
    def quantize_block(block: Block, inputs: BlockInputs, prefix: str) -> Dict[str, QuantizedWeight]:
        names = [name for name, _ in quantizable_linears(block, config.ignore_modules, prefix)]
        stages = sequential_stages(names) if config.true_sequential else [names]
        quantized = {}
        for stage in stages:
            hessians = collect_hessians(block, inputs, stage)
            for name in stage:
                quantized[name] = quantize_linear(block.get_submodule(name), hessians.get(name), config,
                                                  block_size, prefix + name)
        return quantized

    return quantize_block


def quantize_linear(linear: nn.Linear, hessian: Optional[Hessian], config: QuantizeConfig, block_size: int,
                    name: str) -> QuantizedWeight:
    """GPTQ of one Linear, which afterwards holds its dequantized weight; RTN if it saw no calibration tokens."""
    start = time.perf_counter()
    if hessian is None or hessian.tokens == 0:
        # e.g. an expert that the router never picked on the calibration data
        log.warning(f"{name}: no calibration token reached this Linear; quantizing it with round-to-nearest")
        qw = rtn_quantize(linear.weight.float(), config.bits, config.group_size, config.sym)
        loss_note = "RTN"
    else:
        qw, loss = gptq_quantize_weight(linear.weight, hessian.matrix, config.bits, config.group_size, config.sym,
                                        config.desc_act, config.static_groups, config.damp_percent, block_size,
                                        name=name)
        loss_note = f"loss {loss:.4e}"
    qw.bias = None if linear.bias is None else linear.bias.detach().clone()
    linear.weight.data.copy_(qw.dequantize(linear.weight.dtype))
    log.info(f"{name}: {loss_note}, {time.perf_counter() - start:.2f} s")
    return qw


def check_model(model: GPT, config: QuantizeConfig) -> None:
    """Fail before any work (calibration included) where GPTQ cannot quantize `model` as `config` says."""
    if config.method != "gptq":
        raise ValueError(f"GPTQ needs config.method='gptq', not {config.method!r}")
    check_linears_in_blocks(model, config.ignore_modules, "GPTQ")
    if config.true_sequential:
        for i, block in enumerate(model.transformer.h):
            sequential_stages([name for name, _ in quantizable_linears(block, config.ignore_modules,
                                                                       f"transformer.h.{i}.")])


def quantize_model(model: GPT, tokens: torch.Tensor, config: QuantizeConfig, device: torch.device,
                   batch_size: int = 8, offload: bool = False,
                   dtype: Optional[torch.dtype] = None) -> Dict[str, QuantizedWeight]:
    """GPTQ-quantize every block of `model` on calibration `tokens` [n, T]; the quantized weights by full name.

    `model` stays on the CPU except for the block being quantized, and is modified in place: each quantized
    Linear holds its dequantized weight, and the blocks are cast to `dtype`. Pack the result with `config.pack`.

    Args:
        model: a litgpt GPT on the CPU.
        tokens: calibration token ids [num_samples, seq_len].
        config: bits, group size, sym, desc_act, static_groups, true_sequential, damp_percent, ignored modules.
        device: where each block is quantized.
        batch_size: calibration samples per forward pass.
        offload: keep the activations between blocks on the CPU.
        dtype: the blocks' dtype during quantization (None: `default_dtype(device)`). Hessians
            and the GPTQ updates are always fp32.
    """
    check_model(model, config)
    if tokens.dim() != 2:
        raise ValueError(f"calibration tokens must be [num_samples, seq_len], got shape {list(tokens.shape)}")
    device = torch.device(device)
    if dtype is None:
        dtype = default_dtype(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    quantized = quantize_blockwise(model, tokens, block_quantizer(config), device, dtype, batch_size, offload,
                                   description="GPTQ")
    gpu = ""
    if device.type == "cuda":
        gpu = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    log.info(f"GPTQ {config.describe()}: {len(quantized)} Linears in {time.perf_counter() - start:.1f} s"
             f"{gpu}, peak CPU memory (max RSS) {cpu:.2f} GiB")
    return quantized
