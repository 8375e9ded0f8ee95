"""Tokens/s of `litquant generate --compile`'s decode loop on a Llama-2-7B-shaped model (random weights, batch 1).

Two comparisons, each loop decoding greedily with the compiled `next_token` that `litquant generate --compile` uses
(`litquant.generate.compile_next_token`):
- loop: litgpt's `generate` (reads every token back to the host) against litquant's `decode` (reads them back
  `READBACK_EVERY` at a time), with the KV cache sized to the prompt and new tokens, as `litquant generate` sizes it
  (the tokens compared);
- cache: with chat's 4096-position cache, attention over the filled part rounded up to `CACHE_BUCKET` positions
  against the whole cache (a bucket as long as the cache), with how many greedy tokens agree.
Times are the best of `--reps` runs after one that compiles.

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

import litquant.generate as lq
from litquant.generate import compile_next_token, decode, set_kv_cache

sys.path.insert(0, str(Path(__file__).parent))
from e2e_decode import build  # noqa: E402


def best_run(run, reps: int):
    """(tokens, best seconds) of `run()` over reps runs after a first one (compilation, CUDA-graph capture)."""
    tokens, _ = run()
    best = float("inf")
    for _ in range(reps):
        again, seconds = run()
        assert again == tokens, "the same greedy tokens every run"
        best = min(best, seconds)
    return tokens, best


def agreement(case: str, tokens: list, others: list) -> None:
    """Print how many greedy tokens two settings share. Reported, not asserted: different compiled code (attention
    over another length; a graph that dynamo made dynamic) rounds bf16 differently, and a random model's near-tied
    logits then flip a token, after which the rest differs too."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, others)) if a != b), min(len(tokens), len(others)))
    print(f"{case:6} the first {same} of {len(tokens)} greedy tokens agree", flush=True)


def main(variant: str = "marlin", model_name: str = "Llama-2-7b-hf", prompt_len: int = 16, new_tokens: int = 200,
         chat_tokens: int = 1000, reps: int = 3, out: Path = None) -> None:
    model = build(Config.from_name(model_name), variant).eval()
    compile_next_token(True)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), device="cuda")

    def timed(loop: str, tokens: int):
        def run():
            for block in model.transformer.h:
                block.attn.kv_cache.reset_parameters()
            torch.cuda.synchronize()
            start = time.perf_counter()
            if loop == "litgpt":
                out = litgpt_generate(model, prompt, prompt_len + tokens, temperature=0.0, include_prompt=False).tolist()
            else:
                out = [t for run in decode(model, prompt, tokens, temperature=0.0, top_k=None, top_p=1.0) for t in run]
            torch.cuda.synchronize()
            return out, time.perf_counter() - start
        return run

    rows = []

    def record(case: str, setting: str, tokens: int, seconds: float) -> None:
        rows.append({"case": case, "setting": setting, "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds})
        print(f"{case:6} {setting:28} {tokens:5d} tokens in {seconds:7.3f} s: {tokens / seconds:7.1f} tok/s", flush=True)

    model.max_seq_length = prompt_len + new_tokens
    set_kv_cache(model, torch.device("cuda"))
    results = {}
    for loop in ("litgpt", "litquant"):
        results[loop], seconds = best_run(timed(loop, new_tokens), reps)
        record("loop", f"{loop} loop", new_tokens, seconds)
    agreement("loop", results["litgpt"], results["litquant"])

    model.max_seq_length = 4096
    set_kv_cache(model, torch.device("cuda"))
    bucket = lq.CACHE_BUCKET
    results = {}
    for setting in (bucket, 4096):
        lq.CACHE_BUCKET = setting
        results[setting], seconds = best_run(timed("litquant", chat_tokens), reps)
        record("cache", f"attention over {'the whole cache' if setting == 4096 else f'{setting}-position buckets'}",
               chat_tokens, seconds)
    lq.CACHE_BUCKET = bucket
    agreement("cache", results[bucket], results[4096])
    if out:
        out.write_text(json.dumps({"variant": variant, "model": model_name, "gpu": torch.cuda.get_device_name(),
                                   "prompt_len": prompt_len, "readback_every": lq.READBACK_EVERY, "rows": rows}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="marlin")
    parser.add_argument("--model_name", default="Llama-2-7b-hf")
    parser.add_argument("--new_tokens", type=int, default=200)
    parser.add_argument("--chat_tokens", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    main(args.variant, args.model_name, new_tokens=args.new_tokens, chat_tokens=args.chat_tokens, reps=args.reps,
         out=args.out)
