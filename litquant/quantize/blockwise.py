"""The block-by-block driver that GPTQ and AWQ share.

The calibration tokens are embedded once; then, for each transformer block in turn, the block is moved
to the compute device, the recipe quantizes it against the activations entering it, and the *quantized*
block is run to produce the next block's inputs (the sequential scheme of the GPTQ paper, which lets
each block correct for the errors of the blocks before it). Only one block and its activations live on
the compute device at a time; with `offload=True` the activations wait on the CPU between uses.

A recipe is one function, `quantize_block(block, inputs, prefix) -> {linear_name: QuantizedWeight}`,
which must leave every Linear it quantized holding its dequantized weight (so that the block's forward
computes what the quantized model will compute) and may re-parametrize the block (AWQ folds scales).
"""
import logging
import time
from typing import Callable, Dict, Iterator, List

import torch
from litgpt.model import GPT, Block
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from litquant.formats import QuantizedWeight
from litquant.precision import quantizable_linears

log = logging.getLogger("litquant.quantize")


class BlockInputs:
    """The calibration activations entering one block, in batches, and the rope tables every call needs."""

    def __init__(self, hidden: List[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, device: torch.device,
                 offload: bool) -> None:
        self.hidden, self.cos, self.sin, self.device, self.offload = hidden, cos, sin, device, offload

    def batches(self) -> Iterator[torch.Tensor]:
        """Each batch [b, T, n_embd] on the compute device."""
        for h in self.hidden:
            yield h.to(self.device, non_blocking=True)

    @torch.no_grad()
    def run(self, module: Block) -> "BlockInputs":
        """The block's outputs for every batch (the next block's inputs)."""
        storage = "cpu" if self.offload else self.device
        outputs = [module(h, self.cos, self.sin).to(storage) for h in self.batches()]
        return BlockInputs(outputs, self.cos, self.sin, self.device, self.offload)

    def forward_block(self, module: Block, h: torch.Tensor) -> torch.Tensor:
        return module(h, self.cos, self.sin)


QuantizeBlock = Callable[[Block, BlockInputs, str], Dict[str, QuantizedWeight]]


def check_linears_in_blocks(model: GPT, ignore_modules: List[str], method: str) -> None:
    """Refuse a model with Linears to quantize outside its transformer blocks, which this driver never reaches (a
    checkpoint without them would not load): lm_head, unless `ignore_modules` names it."""
    outside = [name for name, _ in quantizable_linears(model, ignore_modules) if not name.startswith("transformer.h.")]
    if outside:
        raise ValueError(f"{method} quantizes the Linears of the transformer blocks, and {', '.join(outside)} "
                         f"{'lies' if len(outside) == 1 else 'lie'} outside them: add "
                         f"{'it' if len(outside) == 1 else 'them'} to ignore_modules (as the default, "
                         "['lm_head'], does), or quantize with rtn")


@torch.no_grad()
def embed_calibration(model: GPT, tokens: torch.Tensor, device: torch.device, dtype: torch.dtype,
                      batch_size: int, offload: bool) -> BlockInputs:
    """The activations entering block 0 for calibration `tokens` [n, T]."""
    seq_len = tokens.shape[1]
    if model.max_seq_length < seq_len:
        model.max_seq_length = seq_len
    wte = model.transformer.wte.to(device)
    hidden = []
    for batch in tokens.split(batch_size):
        x = wte(batch.to(device)).to(dtype)
        if model.config.scale_embeddings:
            x = x * torch.tensor(model.config.n_embd**0.5, dtype=x.dtype)
        hidden.append(x.to("cpu") if offload else x)
    model.transformer.wte.to("cpu")
    cos, sin = model.cos[:seq_len].unsqueeze(0).to(device, dtype), model.sin[:seq_len].unsqueeze(0).to(device, dtype)
    return BlockInputs(hidden, cos, sin, torch.device(device), offload)


def quantize_blockwise(model: GPT, tokens: torch.Tensor, quantize_block: QuantizeBlock, device: torch.device,
                       dtype: torch.dtype = torch.float32, batch_size: int = 8, offload: bool = False,
                       description: str = "quantizing") -> Dict[str, QuantizedWeight]:
    """Quantize every block of `model` (kept on the CPU) with `quantize_block`, one block on `device` at a time.

    Returns the quantized weights by full module name (e.g. `transformer.h.0.attn.qkv`).
    """
    device = torch.device(device)
    inputs = embed_calibration(model, tokens, device, dtype, batch_size, offload)
    quantized: Dict[str, QuantizedWeight] = {}
    start = time.perf_counter()
    blocks = model.transformer.h
    # The per-layer errors are logged through tqdm.write, so that each starts its own line above the bar.
    with logging_redirect_tqdm():
        for i, block in enumerate(tqdm(blocks, desc=description, unit="block", dynamic_ncols=True)):
            block.to(device, dtype)
            prefix = f"transformer.h.{i}."
            for name, qw in quantize_block(block, inputs, prefix).items():
                quantized[prefix + name] = qw.to("cpu")
            inputs = inputs.run(block)
            block.to("cpu")
            if not all(torch.isfinite(h).all() for h in inputs.hidden):
                raise FloatingPointError(f"block {i} produced non-finite activations after quantization")
    elapsed = time.perf_counter() - start
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
    log.info(f"quantized {len(blocks)} blocks in {elapsed:.1f} s{peak}")
    return quantized
