"""AWQ: activation-aware weight quantization (Lin et al., 2023, arXiv:2306.00978).

A few input channels of each Linear carry much larger activations than the rest, and the weights that
multiply them matter most. AWQ protects them without mixed precision: it multiplies those weight
columns by a scale s > 1 before quantizing (their relative rounding error shrinks) and divides the
activations by s, folding 1/s into the op that produces them (a norm or the Linear before), so the
full-precision model computes exactly what it computed before. Per block:

1. Statistics. One forward of the block with hooks on the Linears collects, for each distinct Linear
   input X [tokens, K], the mean |x| per channel and the Gram matrix H = X^T X (fp32).
2. Scale search, per group of Linears that read the same input (`plan_block`): the candidates are
   s = mean|x|^α (duo scaling: mean|x|^α / mean|w|^(1-α), with mean|w| the mean per-group-normalized
   weight magnitude of the group's Linears), normalized so that max(s) * min(s) = 1, for α = i / n_grid,
   i < n_grid (AutoAWQ's grid: 20 values in [0, 1)). The best s minimizes the paper's objective, the
   output error of the group's pseudo-quantized Linears, ||Q(W diag(s)) diag(s)^-1 X - W X||^2; it is
   folded into the preceding op, and the Linears' columns are multiplied by it.
3. Clip search (optional): per output row and group, shrink the row's range [min, max] by factors
   1, 0.95, ..., 0.55 (AutoAWQ: 20 steps, half of them) and keep the one with the least output error
   of that group's slice of the dot product. The ends shrink proportionally, which suits zero-point
   grids (AutoAWQ clamps to a symmetric +-max|w| instead). Query and key rows are not clipped, as in
   AutoAWQ (their errors pass through the softmax); litgpt fuses them into `attn.qkv`, so only the
   value rows of that matrix are clipped.
4. Quantization on the (clipped) ranges with the shared grid of `quantizer.find_params`.

Why the Gram matrix: the output error of a Linear is linear in its weight error D = W - Q(W s) / s,
    sum over tokens ||D x||^2 = trace(D H D^T),
so every candidate's error comes from H without revisiting the activations: exact, in fp32, over all
calibration tokens, with memory independent of their number. The α grid (and the clip grid) is
evaluated as one batched matmul per chunk of candidates.

For the attention group we measure the error at the concatenated q/k/v outputs, the paper's objective,
whereas AutoAWQ runs the attention module and measures its output (through the softmax, which weighs
q/k errors by their effect on the attention pattern). Our choice keeps the search in the Gram form
above: no stored activations, no 20 re-runs of attention over the calibration set, and one code path
for every group. The price is that q/k/v errors weigh equally, in proportion to their output magnitude.

Folds (what 1/s is folded into, see `plan_block`):
- `norm_1` -> `attn.qkv` (LayerNorm: weight and bias; RMSNorm with Gemma's unit offset: (1 + w) / s - 1);
  with `shared_attention_norm` (Falcon), norm_1 also feeds the MLP, which then joins this group;
- the value rows of `attn.qkv` -> `attn.proj`. Value channel (g, d) of KV group g reaches proj's input
  channel (h, d) of every query head h of that group, so with GQA/MQA the scale has one entry per value
  channel, is repeated over the q_per_kv heads of its group on proj's side, and its statistics are the
  means over those heads. This is exact for MHA, GQA and MQA alike;
- `norm_2` -> the MLP's input Linears;
- `mlp.fc_2` -> `mlp.proj` for LLaMA/Gemma MLPs (proj reads act(fc_1) * fc_2, linear in fc_2's output).
  GptNeoxMLP's `fc` -> `proj` goes through a GELU and cannot be folded: proj is only clipped.
Post-attention/post-MLP norms (Gemma 2) sit after these ops and do not affect the folds.

The quantized model is `model` itself afterwards: the norms (and the value rows of `attn.qkv`, the rows
of `mlp.fc_2`, through the quantized weights and biases) carry the scales, so the checkpoint writer must
save the non-Linear parameters from the modified model, not from the original checkpoint.
"""
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from litgpt.model import GPT, Block, CausalSelfAttention, GptNeoxMLP, LLaMAMLP, RMSNorm

from litquant.config import QuantizeConfig
from litquant.formats import QuantizedWeight
from litquant.formats.common import default_g_idx
from litquant.kernels import default_dtype
from litquant.precision import quantizable_linears
from litquant.quantize.blockwise import BlockInputs, QuantizeBlock, check_linears_in_blocks, quantize_blockwise
from litquant.quantize.quantizer import find_params, quantize_codes

log = logging.getLogger("litquant.quantize")

CLIP_GRID = 20  # the clip search tries shrink factors 1 - i / CLIP_GRID ...
CLIP_MAX_SHRINK = 0.5  # ... for i < CLIP_MAX_SHRINK * CLIP_GRID (AutoAWQ's defaults)
# Candidates are evaluated in chunks of about this many weight elements (fp32), to bound the
# temporaries of the batched search (about three tensors of this size).
CHUNK_ELEMENTS = 2**26


class InputStatistics:
    """What the searches need to know about the inputs X [tokens, K] of a Linear: mean |x| per channel
    and the Gram matrix H = X^T X, both fp32, accumulated batch by batch."""

    def __init__(self, features: int, device: torch.device) -> None:
        self.gram = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.abs_sum = torch.zeros(features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.gram.addmm_(x.t(), x)
        self.abs_sum += x.abs().sum(0)
        self.tokens += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.tokens

    def divide_inputs(self, s: torch.Tensor) -> None:
        """The statistics of X diag(s)^-1 (after a scale was folded into the op producing X)."""
        self.gram.div_(s.unsqueeze(1)).div_(s.unsqueeze(0))
        self.abs_sum.div_(s)


@dataclass
class ScaleGroup:
    """Linears that read the same input, and the op before them whose output channels can absorb 1/s.

    The scale is searched in the space of the preceding op's output channels. When that op is the value
    part of `attn.qkv` under GQA/MQA, each of its channels feeds `repeats` input channels of `attn.proj`
    (one per query head of the KV group): `expand` maps a scale to the Linears' input channels and
    `reduce` averages per-input-channel statistics back over those heads.
    """

    name: str
    linears: List[str]
    fold: Callable[[torch.Tensor], None]  # divides the preceding op's output channels by s
    repeats: int = 1
    head_size: int = 1

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """[..., C] scales of the preceding op's channels -> [..., C * repeats] of the Linears' inputs."""
        if self.repeats == 1:
            return s
        *lead, channels = s.shape
        groups = channels // self.head_size
        s = s.reshape(*lead, groups, 1, self.head_size).expand(*lead, groups, self.repeats, self.head_size)
        return s.reshape(*lead, channels * self.repeats)

    def reduce(self, v: torch.Tensor) -> torch.Tensor:
        """[C * repeats] statistics of the Linears' inputs -> [C], the mean over the heads sharing a channel."""
        if self.repeats == 1:
            return v
        return v.reshape(-1, self.repeats, self.head_size).mean(1).reshape(-1)


@dataclass
class BlockPlan:
    """How AWQ treats one block: the scale groups, which hooked input each Linear reads, and which of its
    rows the clip search may shrink."""

    groups: List[ScaleGroup]
    input_of: Dict[str, str] = field(default_factory=dict)  # Linear -> the Linear whose input it shares
    clip_rows: Dict[str, slice] = field(default_factory=dict)


def plan_block(block: Block) -> BlockPlan:
    """The scale groups and folds of a litgpt block; raises a ValueError naming what is unsupported.

    Supported: `CausalSelfAttention`; `LLaMAMLP`, `GemmaMLP` or `GptNeoxMLP`; `RMSNorm` or affine
    `LayerNorm` before attention and MLP; sequential or parallel residual, with or without a shared norm.
    """
    config = block.config
    problems = []
    if not isinstance(block.attn, CausalSelfAttention):
        problems.append(f"attention {type(block.attn).__name__} (only CausalSelfAttention with its fused qkv; "
                        "the low-rank projections of multi-head latent attention are not mapped)")
    if not isinstance(block.mlp, (LLaMAMLP, GptNeoxMLP)):
        problems.append(f"MLP {type(block.mlp).__name__} (only LLaMAMLP, GemmaMLP and GptNeoxMLP; "
                        "mixture-of-experts MLPs are not supported)")
    norms = {"norm_1": block.norm_1}
    if not config.shared_attention_norm:
        norms["norm_2"] = block.norm_2
    for name, norm in norms.items():
        if not isinstance(norm, (RMSNorm, nn.LayerNorm)) or getattr(norm, "weight", None) is None:
            problems.append(f"{name} {type(norm).__name__} without a weight (scales are folded into an RMSNorm "
                            "or an affine LayerNorm)")
    if problems:
        raise ValueError("AWQ does not support this block: " + "; ".join(problems))

    attn, mlp = block.attn, block.mlp
    gated = isinstance(mlp, LLaMAMLP)  # LLaMAMLP and GemmaMLP: proj(act(fc_1(x)) * fc_2(x))
    mlp_inputs = ["mlp.fc_1", "mlp.fc_2"] if gated else ["mlp.fc"]
    q_size = config.n_head * config.head_size
    kv_size = config.n_query_groups * config.head_size
    value_rows = slice(q_size + kv_size, q_size + 2 * kv_size)

    attn_group = ["attn.qkv"] + (mlp_inputs if config.shared_attention_norm else [])
    groups = [
        ScaleGroup(f"norm_1 -> {', '.join(attn_group)}", attn_group, lambda s: _divide_norm(block.norm_1, s)),
        ScaleGroup("attn.qkv[v] -> attn.proj", ["attn.proj"], lambda s: _divide_rows(attn.qkv, value_rows, s),
                   repeats=config.n_head // config.n_query_groups, head_size=config.head_size),
    ]
    if not config.shared_attention_norm:
        groups.append(ScaleGroup(f"norm_2 -> {', '.join(mlp_inputs)}", mlp_inputs,
                                 lambda s: _divide_norm(block.norm_2, s)))
    if gated:
        groups.append(ScaleGroup("mlp.fc_2 -> mlp.proj", ["mlp.proj"],
                                 lambda s: _divide_rows(mlp.fc_2, slice(None), s)))

    mlp_input = "attn.qkv" if config.shared_attention_norm else mlp_inputs[0]
    input_of = {"attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "mlp.proj": "mlp.proj",
                **{name: mlp_input for name in mlp_inputs}}
    linears = {name for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    if linears != set(input_of):
        unexpected = sorted(linears - set(input_of))
        raise ValueError(f"AWQ does not support this block: unexpected Linears {unexpected}")
    clip_rows = {name: slice(None) for name in input_of}
    clip_rows["attn.qkv"] = value_rows
    return BlockPlan(groups, input_of, clip_rows)


def _divide_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """Divide the norm's output channels by s, in fp32."""
    weight = norm.weight.float()
    if getattr(norm, "add_unit_offset", False):  # Gemma: out = x_normed * (1 + w)
        new_weight = (1 + weight) / s - 1
    else:
        new_weight = weight / s
    norm.weight.data.copy_(new_weight)
    if getattr(norm, "bias", None) is not None:
        norm.bias.data.copy_(norm.bias.float() / s)


def _divide_rows(linear: nn.Linear, rows: slice, s: torch.Tensor) -> None:
    """Divide the given output channels of `linear` (weight rows and bias) by s."""
    linear.weight.data[rows] = linear.weight.data[rows].float() / s.unsqueeze(1)
    if linear.bias is not None:
        linear.bias.data[rows] = linear.bias.data[rows].float() / s


def _check_shapes(block: Block, group_size: int, where: str) -> None:
    if group_size == -1:
        return
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear) and m.in_features % group_size:
            raise ValueError(f"AWQ needs in_features to be a multiple of group_size: {where}{name} has "
                             f"{m.in_features} inputs, group_size is {group_size}")


# -- grid math on many candidates at once --

def _fake_quantize(groups: torch.Tensor, bits: int, sym: bool, xmin: Optional[torch.Tensor] = None,
                   xmax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize and dequantize each row of `groups` [M, g] (one quantization group per row).

    The arithmetic of `quantize_codes` then `dequantize_codes` (so the searches see exactly the weights
    that `quantize_weight` saves), in place on one buffer: the searches run this on every
    candidate, and the passes over memory are what they spend their time on.
    """
    scale, zero = find_params(groups, bits, sym, xmin, xmax)
    scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    # clamp(round(w / scale) + zero, 0, maxq) - zero == clamp(round(w / scale), -zero, maxq - zero), exactly
    return (groups.float() / scale).round_().clamp_(-zero, 2**bits - 1 - zero).mul_(scale)


def _group_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., K] -> [M, group_size] rows, one per quantization group."""
    return w.reshape(-1, w.shape[-1] if group_size == -1 else group_size)


def _gram_error(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """trace(D H D^T) summed over all but the last dim of the weight error `d` [..., N, K] -> [...]."""
    dh = (d.reshape(-1, d.shape[-1]) @ gram).reshape(d.shape)
    return dh.mul_(d).sum((-2, -1))


def output_error(weight: torch.Tensor, dequantized: torch.Tensor, stats: InputStatistics) -> float:
    """Mean squared output error of replacing `weight` [N, K] by `dequantized` on the inputs of `stats`."""
    return _gram_error(dequantized - weight, stats.gram).item() / (stats.tokens * weight.shape[0])


def _candidate_errors(weight: torch.Tensor, gram: torch.Tensor, scales: torch.Tensor, bits: int,
                      group_size: int, sym: bool) -> torch.Tensor:
    """Output error trace(D H D^T) of `weight` [N, K] quantized after scaling its columns by each row of
    `scales` [A, K] (D = W - Q(W diag(s)) diag(s)^-1, H the Gram matrix of the unscaled inputs) -> [A]."""
    per_chunk = max(1, CHUNK_ELEMENTS // weight.numel())
    errors = []
    for s in scales.split(per_chunk):
        s = s.unsqueeze(1)  # [a, 1, K]
        scaled = weight * s
        dequantized = _fake_quantize(_group_view(scaled, group_size), bits, sym).view(scaled.shape)
        errors.append(_gram_error(dequantized.div_(s).sub_(weight), gram))  # the sign of D does not matter
    return torch.cat(errors)


def _weight_magnitude(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| normalized by its quantization group's max |w| -> [K] (duo scaling)."""
    groups = _group_view(weight, group_size).abs()
    normalized = groups / (groups.amax(1, keepdim=True) + 1e-6)
    return normalized.view(weight.shape).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: Optional[torch.Tensor],
                     n_grid: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scale candidates [n_grid, C] for α = i / n_grid, and the αs.

    s = x_mean^α, or with duo scaling (`w_mean` given) x_mean^α / w_mean^(1-α); clamped to >= 1e-4 and
    normalized by sqrt(max(s) * min(s)), as AutoAWQ does.
    """
    alphas = torch.arange(n_grid, dtype=torch.float32, device=x_mean.device) / n_grid
    a = alphas.unsqueeze(1)
    s = x_mean.unsqueeze(0).pow(a)
    if w_mean is not None:
        s = s / (w_mean.unsqueeze(0).pow(1 - a) + 1e-4)
    s = s.clamp(min=1e-4)
    s = s / (s.amax(1, keepdim=True) * s.amin(1, keepdim=True)).sqrt()
    return s, alphas


@torch.no_grad()
def search_scale(group: ScaleGroup, weights: List[torch.Tensor], stats: InputStatistics, bits: int,
                 group_size: int, sym: bool, duo_scaling: bool,
                 n_grid: int) -> Tuple[torch.Tensor, float, float, float]:
    """The best scale of `group` (in the preceding op's channels), its α, and the mean squared output
    error of the group's Linears without scaling (RTN) and with the best scale."""
    x_mean = group.reduce(stats.mean_abs)
    w_mean = group.reduce(_weight_magnitude(torch.cat(weights), group_size)) if duo_scaling else None
    scales, alphas = candidate_scales(x_mean, w_mean, n_grid)
    # the last candidate, no scaling, is RTN: the reference the log compares with
    candidates = torch.cat([group.expand(scales), torch.ones_like(scales[:1, :1]).expand(1, stats.gram.shape[0])])
    errors = sum(_candidate_errors(w, stats.gram, candidates, bits, group_size, sym) for w in weights)
    errors = errors / (stats.tokens * sum(w.shape[0] for w in weights))
    best = int(errors[:-1].argmin())
    return scales[best], alphas[best].item(), errors[-1].item(), errors[best].item()


@torch.no_grad()
def collect_statistics(block: Block, inputs: BlockInputs, plan: BlockPlan) -> Dict[str, InputStatistics]:
    """Run the block over the calibration inputs once, accumulating the statistics of each distinct
    Linear input (keyed by the Linear it is hooked on)."""
    stats, handles = {}, []
    for name in sorted(set(plan.input_of.values())):
        linear = block.get_submodule(name)
        stats[name] = InputStatistics(linear.in_features, linear.weight.device)
        handles.append(linear.register_forward_pre_hook(lambda module, args, s=stats[name]: s.add(args[0])))
    try:
        for h in inputs.batches():
            inputs.forward_block(block, h)
    finally:
        for handle in handles:
            handle.remove()
    return stats


@torch.no_grad()
def scale_block(block: Block, inputs: BlockInputs, config: QuantizeConfig, duo_scaling: bool = True,
                n_grid: int = 20, prefix: str = "") -> Tuple[BlockPlan, Dict[str, InputStatistics]]:
    """Search and fold the AWQ scales of one block (an exact re-parametrization in full precision).

    Returns the block's plan and the input statistics as seen by the scaled Linears (for the clip search).
    """
    plan = plan_block(block)
    _check_shapes(block, config.group_size, prefix)
    stats = collect_statistics(block, inputs, plan)
    for group in plan.groups:
        group_stats = stats[plan.input_of[group.linears[0]]]
        linears = [block.get_submodule(name) for name in group.linears]
        s, alpha, rtn_error, awq_error = search_scale(group, [m.weight.float() for m in linears], group_stats,
                                                      config.bits, config.group_size, config.sym, duo_scaling, n_grid)
        group.fold(s)
        expanded = group.expand(s)
        for m in linears:
            m.weight.data.copy_(m.weight.float() * expanded)
        group_stats.divide_inputs(expanded)
        log.info(f"{prefix}{group.name}: alpha {alpha:.2f}, output error {rtn_error:.4e} (RTN) -> {awq_error:.4e}")
    return plan, stats


def _group_ranges(weight: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    groups = weight.reshape(weight.shape[0], -1, weight.shape[1] if group_size == -1 else group_size)
    return groups.amin(-1), groups.amax(-1)


@torch.no_grad()
def search_clip(weight: torch.Tensor, gram: torch.Tensor, bits: int, group_size: int, sym: bool,
                rows: slice = slice(None)) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per output row and group, the clipped range [xmin, xmax] (each [N, G]) of `weight` [N, K].

    Only `rows` are searched; the others keep their full range. The error of a (row, group) is that
    group's share of the row's output error, d H_gg d^T, with H_gg the group's diagonal block of `gram`.
    """
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    num_groups = k // size
    xmin, xmax = _group_ranges(weight, group_size)
    # the diagonal blocks H_gg: [G, size, size]
    blocks = gram.reshape(num_groups, size, num_groups, size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    shrink = 1 - torch.arange(int(CLIP_MAX_SHRINK * CLIP_GRID), dtype=torch.float32, device=weight.device) / CLIP_GRID
    r = shrink.view(-1, 1, 1)
    row_ids = torch.arange(n, device=weight.device)[rows]
    per_chunk = max(1, CHUNK_ELEMENTS // (len(shrink) * k))
    for chunk in row_ids.split(per_chunk):
        w = weight[chunk].reshape(1, len(chunk), num_groups, size)
        lo, hi = xmin[chunk] * r, xmax[chunk] * r  # [R, n, G]
        candidates = w.expand(len(shrink), -1, -1, -1)
        dequantized = _fake_quantize(candidates.reshape(-1, size), bits, sym, lo.flatten(), hi.flatten())
        d = dequantized.view(candidates.shape).sub_(w)
        errors = torch.einsum("rngi,gij->rngj", d, blocks).mul_(d).sum(-1)  # [R, n, G]
        best = errors.argmin(0, keepdim=True)  # ties keep the first, the unclipped range
        xmin[chunk], xmax[chunk] = lo.gather(0, best).squeeze(0), hi.gather(0, best).squeeze(0)
    return xmin, xmax


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int, sym: bool, xmin: torch.Tensor,
                    xmax: torch.Tensor, bias: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """Quantize `weight` [N, K] on the ranges `xmin`, `xmax` [N, G] of each row and group."""
    n, k = weight.shape
    groups = _group_view(weight.float(), group_size)
    scale, zero = find_params(groups, bits, sym, xmin.flatten(), xmax.flatten())
    codes = quantize_codes(groups, scale, zero, bits).view(n, k)
    return QuantizedWeight(codes.t().to(torch.uint8).contiguous(), scale.view(n, -1).t().half().contiguous(),
                           zero.view(n, -1).t().to(torch.uint8).contiguous(),
                           default_g_idx(k, group_size, weight.device), bits, group_size,
                           None if bias is None else bias.detach().clone())


def block_quantizer(config: QuantizeConfig, duo_scaling: bool = True, apply_clip: bool = True,
                    n_grid: int = 20) -> QuantizeBlock:
    """The AWQ `quantize_block(block, inputs, prefix)` for `quantize_blockwise`."""
    if n_grid < 1:
        raise ValueError(f"n_grid must be at least 1, not {n_grid}")

    @torch.no_grad()
    def quantize_block(block: Block, inputs: BlockInputs, prefix: str) -> Dict[str, QuantizedWeight]:
        plan, stats = scale_block(block, inputs, config, duo_scaling, n_grid, prefix)
        quantized = {}
        for name, linear in quantizable_linears(block, config.ignore_modules, prefix):
            weight, input_stats = linear.weight.float(), stats[plan.input_of[name]]
            xmin, xmax = _group_ranges(weight, config.group_size)
            if apply_clip:
                unclipped = _fake_quantize(_group_view(weight, config.group_size), config.bits, config.sym)
                unclipped_error = output_error(weight, unclipped.view(weight.shape), input_stats)
                xmin, xmax = search_clip(weight, input_stats.gram, config.bits, config.group_size, config.sym,
                                         plan.clip_rows[name])
            qw = quantize_weight(weight, config.bits, config.group_size, config.sym, xmin, xmax, linear.bias)
            dequantized = qw.dequantize(torch.float32)
            error = output_error(weight, dequantized, input_stats)
            if apply_clip:
                log.info(f"{prefix}{name}: output error {unclipped_error:.4e} -> {error:.4e} (clip)")
            else:
                log.info(f"{prefix}{name}: output error {error:.4e}")
            linear.weight.data.copy_(dequantized)
            quantized[name] = qw
        return quantized

    return quantize_block


def check_model(model: GPT, config: QuantizeConfig) -> None:
    """Fail before any work (calibration included) where AWQ cannot quantize `model` as `config` says."""
    if config.method != "awq":
        raise ValueError(f"AWQ needs config.method='awq', not {config.method!r}")
    if config.desc_act:
        raise ValueError("AWQ quantizes groups in order: desc_act (act_order) is not supported")
    check_linears_in_blocks(model, config.ignore_modules, "AWQ")
    for i, block in enumerate(model.transformer.h):
        plan_block(block)
        _check_shapes(block, config.group_size, f"transformer.h.{i}.")


def quantize_model(model: GPT, tokens: torch.Tensor, config: QuantizeConfig, device: torch.device,
                   batch_size: int = 8, offload: bool = False, duo_scaling: bool = True, apply_clip: bool = True,
                   n_grid: int = 20, dtype: Optional[torch.dtype] = None) -> Dict[str, QuantizedWeight]:
    """AWQ-quantize every block of `model` on calibration `tokens` [n, T]; the quantized weights by full name.

    `model` is modified in place and must be saved from afterwards: its norms (and the biases of
    `attn.qkv` / `mlp.fc_2`, carried in the returned weights) hold the folded scales, and each quantized
    Linear holds its dequantized weight. Pack the returned weights with `config.pack`.

    Args:
        model: a litgpt GPT on the CPU.
        tokens: calibration token ids [num_samples, seq_len].
        config: bits, group size, sym (AWQ formats: 4-bit, sym=False) and the modules left unquantized.
        device: where each block is quantized.
        batch_size: calibration samples per forward pass.
        offload: keep the activations between blocks on the CPU.
        duo_scaling: scale by mean|x|^α / mean|w|^(1-α) instead of mean|x|^α.
        apply_clip: search a clipped range per output row and group.
        n_grid: number of α values tried, i / n_grid for i < n_grid.
        dtype: the blocks' dtype during quantization (None: `default_dtype(device)`).
    """
    check_model(model, config)
    device = torch.device(device)
    if dtype is None:
        dtype = default_dtype(device)
    quantize_block = block_quantizer(config, duo_scaling, apply_clip, n_grid)
    return quantize_blockwise(model, tokens, quantize_block, device, dtype, batch_size, offload, description="AWQ")
