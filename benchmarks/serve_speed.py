"""Tokens/s of `litquant serve`'s answers, eager and with `--compile`, on a Llama-2-7B-shaped model (random weights).

The server answers a request with litgpt's `LLM.generate` on the `LLM` that `litquant.serve.serving_llm` builds;
this times those calls in one process, without HTTP: eager first (litgpt sizes the KV cache to each request), then
compiled (one 4096-position cache, FlexAttention over its filled part, the startup compile done before timing).
Each call asks for `--new_tokens` tokens, greedy (top_k 1), and the tokens are counted as returned. The tokenizer is
the tests' character-level one (only the prompt is encoded; the answer is returned as token ids, as a random model's
ids mostly lie past that tokenizer's vocabulary). Compiled and eager tokens are compared, not asserted: in bf16 the
two programs round differently, and a random model's near-tied logits then flip a token.

    python benchmarks/serve_speed.py --variant marlin --out benchmarks/results/serve-speed.json
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from litgpt.config import Config
from litgpt.tokenizer import Tokenizer

from litquant.load import LoadedModel
from litquant.serve import serving_llm

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from conftest import write_tiny_tokenizer  # noqa: E402
from e2e_decode import build  # noqa: E402
from generate_speed import agreement  # noqa: E402

PROMPT = "What do llamas eat?"


def main(variant: str = "marlin", model_name: str = "Llama-2-7b-hf", new_tokens: int = 200, reps: int = 3,
         out: Path = None) -> None:
    """Time `reps` requests of `new_tokens` tokens to an eager server and to a compiled one (see the module's docstring).

    Args:
        variant: the quantized kernel (marlin, triton, torch) or bf16.
        model_name: a litgpt model name, for the shapes.
        new_tokens: tokens a request asks for.
        reps: timed requests per server, after a first one.
        out: write the results as JSON here.
    """
    config = Config.from_name(model_name)
    model = build(config, variant).eval()
    with tempfile.TemporaryDirectory() as directory:
        write_tiny_tokenizer(Path(directory))
        tokenizer = Tokenizer(directory)
        loaded = LoadedModel(L.Fabric(accelerator="cuda", devices=1), model, tokenizer, config, variant, variant, 0.0)
        rows, tokens_of = [], {}
        for compile in (False, True):  # compile swaps litgpt's next_token for the process: eager first
            t0 = time.perf_counter()
            llm = serving_llm(loaded, Path(directory), compile=compile)

            def answer() -> list:
                return llm.generate(PROMPT, max_new_tokens=new_tokens, top_k=1, return_as_token_ids=True).tolist()

            first = answer()  # compiles (and records the CUDA graphs) when compiled
            startup = time.perf_counter() - t0
            best = float("inf")
            for _ in range(reps):
                torch.cuda.synchronize()
                start = time.perf_counter()
                tokens = answer()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
                agreement(f"{'compiled' if compile else 'eager'}, a request against the first", first, tokens)
            name = "compiled" if compile else "eager"
            tokens_of[name] = tokens
            rows.append({"server": name, "tokens": len(tokens), "seconds": best, "tokens_per_s": len(tokens) / best,
                         "first_request_s": startup})
            print(f"{name}: {len(tokens)} tokens in {best:.3f} s, {len(tokens) / best:.1f} tok/s (first request, "
                  f"with setup: {startup:.1f} s)", flush=True)
    same = agreement("compiled against eager", tokens_of["eager"], tokens_of["compiled"])
    if out:
        out.write_text(json.dumps({"variant": variant, "model": model_name, "gpu": torch.cuda.get_device_name(),
                                   "prompt": PROMPT, "rows": rows, "tokens_agreeing": same}, indent=1))


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
