"""Perplexity of a model over a text: the quality number every quantization is judged by.

The text is tokenized once and cut into non-overlapping windows of `window` tokens; each window is
scored on its own (no context carried across windows), so numbers are comparable between models
and kernels as long as the tokenizer, window and text are the same.
"""
import math
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer
from tqdm.auto import tqdm

from litquant.assets import evaluation_text, read_text_file


def check_windows(window: int, max_windows: Optional[int], batch_size: int = 1) -> None:
    """Refuse window settings that score nothing (callers check them before loading a model)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, not {window}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1 (or none, for every window), not {max_windows}")


def check_window_fits(window: int, block_size: int) -> None:
    if window > block_size:
        raise ValueError(f"window {window} is longer than the model's context, {block_size} tokens")


@torch.inference_mode()
def compute_perplexity(model: GPT, tokens: torch.Tensor, window: int = 512, batch_size: int = 4,
                       max_windows: Optional[int] = None, progress: bool = False) -> Tuple[float, int]:
    """Perplexity of `model` over the 1-D `tokens`, and the number of tokens predicted.

    Args:
        model: a litgpt GPT (any precision or quantization), on the device it runs on.
        tokens: the token ids of the whole text.
        window: tokens per window; the model must accept sequences that long.
        batch_size: windows per forward pass.
        max_windows: score only the first `max_windows` windows (None: all).
        progress: show a progress bar over the windows.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {list(tokens.shape)}")
    check_windows(window, max_windows, batch_size)
    check_window_fits(window, model.config.block_size)
    n_windows = tokens.numel() // window
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"the text has {tokens.numel()} tokens, fewer than one window of {window}")
    if model.max_seq_length < window:
        model.max_seq_length = window
    device = next(p for p in model.parameters() if p.device.type != "meta").device
    windows = tokens[: n_windows * window].long().view(n_windows, window)
    nll, count = 0.0, 0
    bar = tqdm(total=n_windows, desc="perplexity", unit="window", disable=not progress, dynamic_ncols=True)
    for batch in windows.split(batch_size):
        bar.update(len(batch))
        batch = batch.to(device)
        logits = model(batch[:, :-1]).float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    bar.close()
    ppl = math.exp(nll / count)
    if not math.isfinite(ppl):
        raise FloatingPointError("perplexity is not finite: the model produced NaN/inf logits")
    return ppl, count


def perplexity(
    checkpoint_dir: Path,
    text_file: Optional[Path] = None,
    *,
    window: int = 512,
    batch_size: int = 4,
    max_windows: Optional[int] = None,
    kernel: Optional[str] = None,
    quantize: Optional[str] = None,
    precision: Optional[str] = None,
    device: Optional[str] = None,
) -> float:
    """Perplexity of a checkpoint (quantized or not) over a text file, in non-overlapping windows.

    Prints `perplexity: <float>` and the number of tokens evaluated.

    Args:
        checkpoint_dir: a quantized checkpoint from `litquant quantize`, or an ordinary litgpt checkpoint.
        text_file: a UTF-8 text file (.txt or .gz). Default: the evaluation slice of Debian's jargon-text.
        window: tokens per window.
        batch_size: windows per forward pass.
        max_windows: evaluate only the first N windows. Default: all.
        kernel: kernel for quantized Linears: auto, or one that `litquant kernels` lists (torch, triton, marlin, ...).
            Default: the checkpoint's.
        quantize: for an ordinary checkpoint, quantize while loading: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq
            (bitsandbytes) or rtn.int<bits>[-g<group_size>], e.g. rtn.int4-g128 (litquant's kernels).
        precision: bf16-true, 16-true or 32-true. Default: bf16-true on a GPU that has bf16 (else 16-true), 32-true
            on the CPU.
        device: cuda, cuda:<index> or cpu. Default: cuda (the current GPU) if available.
    """
    from litquant.load import checkpoint_config, load_model

    check_windows(window, max_windows, batch_size)
    check_window_fits(window, checkpoint_config(checkpoint_dir).block_size)
    text = read_text(text_file)
    loaded = load_model(checkpoint_dir, kernel=kernel, quantize=quantize, precision=precision, device=device)
    tokens = encode_start(loaded.tokenizer, text, None if max_windows is None else max_windows * window)
    ppl, count = compute_perplexity(loaded.model, tokens, window=window, batch_size=batch_size, max_windows=max_windows,
                                    progress=True)
    print(f"perplexity: {ppl:.4f}")
    print(f"tokens evaluated: {count} ({loaded.quantization}, kernel {loaded.kernel or '-'}, window {window})")
    return ppl


def encode_start(tokenizer: Tokenizer, text: str, tokens_needed: Optional[int]) -> torch.Tensor:
    """The first `tokens_needed` token ids of `text` (all of them for None), tokenizing no more of it than that takes.

    Tokenizers split text into words before they merge, so the ids of a prefix are the whole text's except near the
    cut: a prefix that gives 64 ids more than needed gives the needed ones exactly. (A 65 MB text took 100 s whole.)
    """
    if tokens_needed is None:
        return tokenizer.encode(text, bos=False, eos=False)
    chars = 8 * tokens_needed + 4096  # a few characters a token, generously
    while True:
        tokens = tokenizer.encode(text[:chars], bos=False, eos=False)
        if chars >= len(text):
            return tokens
        if tokens.numel() >= tokens_needed + 64:
            return tokens[:tokens_needed]
        chars *= 2


def read_text(text_file: Optional[Path]) -> str:
    """The text of `text_file` (.txt or .gz), or the evaluation slice of jargon-text when None."""
    if text_file is None:
        return evaluation_text()
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} not found")
    text = read_text_file(path, "text file")
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return text
