"""Tokens/s of `litquant generate --compile`'s decode loop on a Llama-2-7B-shaped model (random weights, batch 1).

litgpt's `generate` (which reads every token back to the host) against litquant's `decode` (which reads them back
`READBACK_EVERY` at a time), both decoding greedily with the compiled `next_token` that `litquant generate
--compile` uses (`litquant.generate.set_next_token`), with the KV cache sized to the prompt and new tokens as
`litquant generate` sizes it. Times are the best of `--reps` runs after one that compiles; every run's tokens are
compared with the first run's, and the two loops' tokens with each other.

    python benchmarks/generate_speed.py --variant marlin --out benchmarks/results/generate-speed.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from litgpt.config import Config
from litgpt.generate.base import generate as litgpt_generate

from litquant.generate import READBACK_EVERY, decode, flex_decoding_pays_in_generate, set_kv_cache, set_next_token

sys.path.insert(0, str(Path(__file__).parent))
from e2e_decode import build  # noqa: E402


def agreement(what: str, tokens: list, others: list) -> int:
    """Print and return how many greedy tokens two runs share before they first differ. Reported, not asserted:
    different compiled code rounds bf16 differently, and a random model's near-tied logits then flip a token."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, others)) if a != b), min(len(tokens), len(others)))
    print(f"{what}: the first {same} of {len(tokens)} greedy tokens agree", flush=True)
    return same


def main(variant: str = "marlin", model_name: str = "Llama-2-7b-hf", prompt_len: int = 16, new_tokens: int = 200,
         reps: int = 3, out: Path = None) -> None:
    model = build(Config.from_name(model_name), variant).eval()
    set_next_token(model, compile=True, flex_decoding=flex_decoding_pays_in_generate(model.config, torch.device("cuda")))
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), device="cuda")
    model.max_seq_length = prompt_len + new_tokens
    set_kv_cache(model, torch.device("cuda"))

    def run(loop: str):
        for block in model.transformer.h:
            block.attn.kv_cache.reset_parameters()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if loop == "litgpt":
            tokens = litgpt_generate(model, prompt, prompt_len + new_tokens, temperature=0.0, include_prompt=False).tolist()
        else:  # the same sampling arguments as litgpt passes, so that dynamo compiles the same graph for both
            tokens = [t for part in decode(model, prompt, new_tokens, temperature=0.0, top_k=None, top_p=1.0) for t in part]
        torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    rows, last = [], {}
    for loop in ("litgpt", "litquant"):
        first, _ = run(loop)  # compiles and captures the CUDA graphs
        best = float("inf")
        for _ in range(reps):
            tokens, seconds = run(loop)
            agreement(f"{loop} loop, a run against the first", first, tokens)
            best = min(best, seconds)
        last[loop] = tokens
        rows.append({"loop": loop, "tokens": new_tokens, "seconds": best, "tokens_per_s": new_tokens / best})
        print(f"{loop} loop: {new_tokens} tokens in {best:.3f} s, {new_tokens / best:.1f} tok/s", flush=True)
    same = agreement("litgpt's loop against litquant's", last["litgpt"], last["litquant"])
    if out:
        out.write_text(json.dumps({"variant": variant, "model": model_name, "gpu": torch.cuda.get_device_name(),
                                   "prompt_len": prompt_len, "readback_every": READBACK_EVERY, "rows": rows,
                                   "tokens_agreeing": same}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="marlin")
    parser.add_argument("--model_name", default="Llama-2-7b-hf")
    parser.add_argument("--new_tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    main(args.variant, args.model_name, new_tokens=args.new_tokens, reps=args.reps, out=args.out)
