"""Attention for the compiled single-token decode step: FlexAttention that reads only the filled part of the KV cache.

Compiled under CUDA graphs, litquant's decode does not pass litgpt's `input_pos_maxp1` (an int that grows every
token would record a new graph for every length; see `litquant.generate.compile_next_token`). So each step's
attention sees the whole static cache, and litgpt's SDPA (cuDNN on an H200) reads all of it under the mask: a
4096-position cache costs the same at the 10th token as at the 4000th.

Here the one-token query goes through `torch.nn.attention.flex_attention` instead, with a block mask built on the GPU
from the mask row litgpt passes (the positions up to the current one), inside the graph: the cache blocks wholly
filled are "full" blocks (no mask evaluated), the block holding the current position is a partial one (positions
past it masked), and the blocks after it are not read at all. Inductor turns it into its split-KV flex-decoding
kernel, fused into the compiled step (no custom op splitting the graph).

When it pays (H200, Llama-2-7B shapes: 32 heads of 128, bf16 cache, 32 layers in one CUDA graph;
benchmarks/results/2026-12-03-flex-decoding.md): litgpt's SDPA costs the same at any fill, 8.3 us a layer for a
144-position cache, 13.5 for 1024, 24.0 for 4096. This costs 10.8 us on the full 144-position cache, and 13.4 /
13.9 / 16.2 with 144 / 512 / 1024 of 1024 positions filled: it grows with the filled part, and costs more than
SDPA when most of a long cache is filled. So litquant uses it for chat, whose cache holds 4096 positions while each
turn fills only its prompt and answer from position 0 (a 7B-shaped marlin model decoded 15% more tokens/s with 16
of them filled; with a 3000-token prompt, 9% fewer), and not for `generate`, whose cache is the prompt plus the new
tokens.
"""
import inspect
import types

import torch
from litgpt.model import GPT, CausalSelfAttention
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Positions a block of the block mask covers (FlexAttention's default block size).
KV_BLOCK = 128
# Where torch has the option, the block mask leaves out its transposed (query-block) indices, which only the backward
# pass reads: building them takes two argsorts per layer and step, which Inductor leaves to eager kernels.
FORWARD_ONLY = ({"compute_q_blocks": False}
                if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {})


def filled_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Attention of one query token over the filled prefix of a KV cache.

    q: (1, heads, 1, head_size); k, v: (1, heads, cache, head_size); mask: (1, 1, 1, cache), True on the filled
    prefix (the positions up to the query's). Returns (1, heads, 1, head_size), as `F.scaled_dot_product_attention`.
    """
    cache = k.size(2)
    filled = mask.reshape(-1).sum(dtype=torch.int32)  # positions 0 .. filled-1 are attended
    n_blocks = -(-cache // KV_BLOCK)
    block_index = torch.arange(n_blocks, device=q.device, dtype=torch.int32)
    full_blocks = filled // KV_BLOCK
    partial_block = filled % KV_BLOCK != 0
    # FlexAttention's block mask, one query block of 1 batch and 1 (broadcast) head: the first `full_blocks` cache
    # blocks whole, then at most one partial block, `full_blocks` itself, whose positions past `filled` the mask_mod
    # hides. Only the leading entries of each index list are read (their counts say how many).
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks=partial_block.to(torch.int32).view(1, 1, 1),
        kv_indices=(block_index + full_blocks).clamp(max=n_blocks - 1).view(1, 1, 1, n_blocks),
        full_kv_num_blocks=full_blocks.view(1, 1, 1),
        full_kv_indices=block_index.view(1, 1, 1, n_blocks),
        BLOCK_SIZE=KV_BLOCK,
        mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < filled,
        seq_lengths=(1, cache),
        **FORWARD_ONLY,
    )
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def _attention_with_flex_decoding(self: CausalSelfAttention, q, k, v, mask=None):
    """`CausalSelfAttention.scaled_dot_product_attention`, with the compiled one-token step through FlexAttention."""
    if torch.compiler.is_compiling() and q.size(0) == 1 and q.size(2) == 1 and mask is not None:
        scale = self.mscale * self.mscale / (self.config.attention_scores_scalar or self.config.head_size) ** 0.5
        return filled_prefix_attention(q, k, v, mask, scale).transpose(1, 2)
    return CausalSelfAttention.scaled_dot_product_attention(self, q, k, v, mask)


def use_flex_decoding(model: GPT, enable: bool = True) -> int:
    """Route the compiled one-token decode step of `model`'s attention layers through `filled_prefix_attention`
    (`enable=False` gives them back litgpt's attention).

    Layers it does not apply to keep litgpt's attention: logit softcapping or a sliding window (masks that are not
    a filled prefix), another attention class (multi-head latent attention), head sizes FlexAttention's kernels do
    not take (not a power of two from 16 to 256). Eager steps and prefill keep litgpt's attention too. Returns the
    number of layers routed.
    """
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
    return routed
