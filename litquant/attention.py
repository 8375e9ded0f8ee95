"""Attention for the compiled single-token decode step: FlexAttention that reads only the filled part of the KV cache.

Compiled under CUDA graphs, litquant's decode does not pass litgpt's `input_pos_maxp1` (an int that grows every
token would record a new graph for every length; see `litquant.generate.set_next_token`). So each step's
attention sees the whole static cache, and litgpt's SDPA (cuDNN on an H200) reads all of it under the mask: a
4096-position cache costs the same at the 10th token as at the 4000th.

Here the one-token query goes through `torch.nn.attention.flex_attention` instead, with a block mask built on the GPU
from the step's position, inside the graph, once per step for all layers: the cache blocks wholly filled are "full"
blocks (no mask evaluated), the block holding the current position is a partial one (positions past it masked), and
the blocks after it are not read at all. Inductor turns it into its split-KV flex-decoding kernel, fused into the
compiled step (no custom op splitting the graph). With grouped-query attention it reads the cache's key/value heads
as they are, where litgpt's SDPA path first copies them out once per query head.

When it pays (H200, 32 layers in one CUDA graph, a marlin 4-bit model, bf16 cache of 4096 positions;
benchmarks/results/2026-12-03-flex-decoding-v2.md): litgpt's SDPA costs the same at any fill, this grows with the
filled part. Llama-2-7B shapes (32 heads of 128): 500.5 against 412.5 tokens/s with 16 positions filled, 389.2
against 413.9 with 3000. Llama-3.1-8B shapes (8 key/value heads): 397.1 against 237.7 with 16, 389.5 against 237.3
with 3000. So litquant uses it for chat, whose cache holds 4096 positions while each turn fills only its prompt and
answer from position 0. `generate`'s cache is the prompt plus the new tokens, mostly filled: there it uses it only
for grouped-query attention on a GPU (`litquant.generate.flex_decoding_pays_in_generate`,
2026-12-03-flex-generate.md).
"""
import inspect
import types
from typing import Optional

import torch
from litgpt.model import GPT, CausalSelfAttention
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Positions a block of the block mask covers (FlexAttention's default block size).
KV_BLOCK = 128
# Where torch has the option, the block mask leaves out its transposed (query-block) indices, which only the backward
# pass reads: building them takes two argsorts per layer and step, which Inductor leaves to eager kernels.
FORWARD_ONLY = ({"compute_q_blocks": False}
                if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {})


def filled_prefix_block_mask(position: torch.Tensor, cache: int) -> BlockMask:
    """FlexAttention's block mask for one query at `position` (a 1-element integer tensor) over a `cache`-position
    KV cache: it attends positions 0 .. position, the filled prefix.

    One query block of 1 batch and 1 (broadcast) head: the cache blocks wholly inside the prefix are "full" blocks
    (no mask evaluated), then at most one partial block, the one holding `position`, whose positions past it the
    mask_mod hides; the blocks after it are not read. Built from a tensor, so on the GPU, inside a CUDA graph. Only
    the leading entries of each index list are read (their counts say how many).
    """
    position = position.reshape(1)
    filled = position[0].to(torch.int32) + 1
    n_blocks = -(-cache // KV_BLOCK)
    block_index = torch.arange(n_blocks, device=filled.device, dtype=torch.int32)
    full_blocks = filled // KV_BLOCK
    partial_block = filled % KV_BLOCK != 0
    return BlockMask.from_kv_blocks(
        kv_num_blocks=partial_block.to(torch.int32).view(1, 1, 1),
        kv_indices=(block_index + full_blocks).clamp(max=n_blocks - 1).view(1, 1, 1, n_blocks),
        full_kv_num_blocks=full_blocks.view(1, 1, 1),
        full_kv_indices=block_index.view(1, 1, 1, n_blocks),
        BLOCK_SIZE=KV_BLOCK,
        # reads the position itself: a graph input, which Inductor's CPU FlexAttention takes (not a value
        # computed from it)
        mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= position[0],
        seq_lengths=(1, cache),
        **FORWARD_ONLY,
    )


def filled_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                            scale: float) -> torch.Tensor:
    """Attention of one query token over the filled prefix of a KV cache that `block_mask`
    (`filled_prefix_block_mask`) describes.

    q: (1, heads, 1, head_size); k, v: (1, kv_heads, cache, head_size), kv_heads dividing heads (grouped-query
    attention). Returns (1, heads, 1, head_size), as `F.scaled_dot_product_attention`.
    """
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.size(1) != q.size(1))


# The block mask of the compiled one-token step being traced: `_forward_with_step_block_mask` builds it once from the
# step's position for all the layers (built in each layer, Inductor would repeat it in each: it does not merge
# identical subgraphs), and clears it when the step returns. Only tracing reads and writes it; the compiled graph
# holds the mask's tensors itself.
_step_block_mask: Optional[BlockMask] = None


def _forward_with_step_block_mask(self: GPT, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                                  *args, **kwargs):
    """`GPT.forward`; a compiled one-token step first builds the block mask its attention layers share."""
    global _step_block_mask
    if not (torch.compiler.is_compiling() and input_pos is not None and idx.shape == (1, 1)):
        return GPT.forward(self, idx, input_pos, *args, **kwargs)
    _step_block_mask = filled_prefix_block_mask(input_pos, self.mask_cache.size(-1))  # as litgpt's mask row
    try:
        return GPT.forward(self, idx, input_pos, *args, **kwargs)
    finally:
        _step_block_mask = None


def _attention_with_flex_decoding(self: CausalSelfAttention, q, k, v, mask=None):
    """`CausalSelfAttention.scaled_dot_product_attention`, with the compiled one-token step through FlexAttention."""
    if (_step_block_mask is not None and q.size(0) == 1 and q.size(2) == 1
            and k.size(2) == _step_block_mask.seq_lengths[1]):
        scale = self.mscale * self.mscale / (self.config.attention_scores_scalar or self.config.head_size) ** 0.5
        if k.size(1) != self.kv_cache.k.size(1) and k.size(2) == self.kv_cache.k.size(2):
            # litgpt repeated the cache's key/value heads for the query heads, a copy of the whole cache every step:
            # FlexAttention takes grouped heads itself, so it reads the cache, and Inductor drops the unused copy.
            k, v = self.kv_cache.k, self.kv_cache.v
        return filled_prefix_attention(q, k, v, _step_block_mask, scale).transpose(1, 2)
    return CausalSelfAttention.scaled_dot_product_attention(self, q, k, v, mask)


def use_flex_decoding(model: torch.nn.Module, enable: bool = True) -> int:
    """Route the compiled one-token decode step of `model`'s attention layers through `filled_prefix_attention`
    (`enable=False` gives them back litgpt's attention).

    Layers it does not apply to keep litgpt's attention: logit softcapping or a sliding window (masks that are not
    a filled prefix), another attention class (multi-head latent attention), head sizes FlexAttention's kernels do
    not take (not a power of two from 16 to 256). Eager steps and prefill keep litgpt's attention too. When any
    layer is routed, the GPT's `forward` is wrapped too, to build the step's block mask once for all layers. Returns
    the number of layers routed.
    """
    # A model from `litquant.load.load_model` is wrapped by Fabric: the step's forward goes on the GPT inside, so that
    # the wrapper's own forward (the precision plugin's input conversion and context) still runs in front of it.
    gpt = getattr(model, "module", model)
    gpt.__dict__.pop("forward", None)
    routed = 0
    for block in model.transformer.h:
        attn = block.attn
        attn.__dict__.pop("scaled_dot_product_attention", None)
        head_size = attn.config.head_size
        if (enable and type(attn) is CausalSelfAttention and attn.config.attention_logit_softcapping is None
                and not attn.apply_sliding_window_attention and 16 <= head_size <= 256
                and head_size & (head_size - 1) == 0):
            attn.scaled_dot_product_attention = types.MethodType(_attention_with_flex_decoding, attn)
            routed += 1
    if routed:
        gpt.forward = types.MethodType(_forward_with_step_block_mask, gpt)
    return routed
