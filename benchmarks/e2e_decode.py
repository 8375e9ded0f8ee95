"""End-to-end batch-1 decode speed of a Llama-2-7B-shaped litgpt model: bf16, bnb.nf4 and 4-bit kernels.

Random weights (speed does not depend on them), built on the GPU; every quantized variant is RTN 4-bit
g128 through litquant's own loading path (QuantizedPrecision + the kernel's repack). Decode runs litgpt's
`next_token` with a static KV cache, compiled with CUDA graphs as
`litquant generate --compile` compiles it (`litquant.generate.compile_options`) where the kernel compiles, so Python
overhead does not hide the kernels. The weight-bandwidth limit is the bytes of weights read per token over the
device-to-device copy bandwidth measured in the same run.

    python benchmarks/e2e_decode.py --out_dir benchmarks/results --variants bf16,marlin
    python benchmarks/e2e_decode.py --variants bf16,marlin --compile yes --profile 20
    python benchmarks/e2e_decode.py --variants marlin --compile yes --cache 4096 --attention both   # chat's cache

`--profile N` then decodes N more tokens under torch.profiler and prints, per variant, where a token's GPU time
goes (quantized matmuls, cuBLAS, attention, Inductor's fused kernels, copies) and how much of the token the GPU
is idle; the kernels are written to `profile_<variant>.json` beside the results.
"""
import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from litgpt.config import Config
from litgpt.generate.base import next_token
from litgpt.model import GPT

from litquant.attention import use_flex_decoding
from litquant.config import QuantizeConfig
from litquant.benchmark import model_bytes
from litquant.fuse import fuse_gate_up
from litquant.generate import (compile_options, eager_next_token, mark_quantized_layers_after_small_kernels,
                               set_kv_cache)
from litquant.precision import QuantizedPrecision
from litquant.quantize.quantizer import rtn_quantize


def copy_bandwidth() -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def build(config: Config, variant: str) -> GPT:
    """A random model in bf16, or with its Linears (not lm_head) quantized for `variant`."""
    torch.manual_seed(0)
    if variant == "bf16":
        with torch.device("cuda"):
            model = GPT(config).to(torch.bfloat16)
        return model
    if variant == "bnb.nf4":
        import bitsandbytes as bnb

        with torch.device("cuda"):
            model = GPT(config).to(torch.bfloat16)
        for name, m in list(model.named_modules()):
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                layer = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=False, compute_dtype=torch.bfloat16,
                                          quant_type="nf4", device="meta")
                layer.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False, quant_type="nf4").to("cuda")
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, layer)
        return model
    qconfig = QuantizeConfig(method="rtn", bits=4, group_size=128, kernel=variant)
    plugin = QuantizedPrecision(qconfig, kernel=variant, dtype=torch.bfloat16, device="cuda")
    with torch.device("cuda"):
        model = GPT(config).to(torch.bfloat16)
    plugin.convert_module(model)
    for m in model.modules():
        if hasattr(m, "load_quantized"):
            w = torch.randn(m.out_features, m.in_features, device="cuda") * 0.02
            m.load_quantized(rtn_quantize(w, 4, 128, True))
    fuse_gate_up(model)  # as litquant's loader does
    return model


@torch.inference_mode()
def decoder(model: GPT, compile: bool, max_tokens: int, prompt_len: int = 16, cache: int = 0,
            flex: bool = False) -> Callable[[int], float]:
    """Prefill a random prompt and decode 3 warm-up tokens (capturing the CUDA graph); returns `decode(n)`, which
    decodes n more tokens (n in all at most `max_tokens`) and returns the seconds they took. The KV cache holds
    `cache` positions (at least the prompt, the tokens and 8 more). Compiled, the one-token attention is litgpt's
    SDPA, as in `litquant generate --compile`, or with `flex` FlexAttention over the filled part of the cache, as in
    `litquant chat --compile` (`litquant.attention`), and the quantized layers are told so
    (`mark_quantized_layers_after_small_kernels`), as by `set_next_token`."""
    model.eval()
    model.max_seq_length = max(cache, prompt_len + max_tokens + 8)
    set_kv_cache(model, torch.device("cuda"))
    use_flex_decoding(model, compile and flex)
    if compile:
        mark_quantized_layers_after_small_kernels(model)
    compiled = torch.compile(next_token, options=compile_options()) if compile else next_token

    def step(*args):  # a new CUDA-graph step per token; copy the output out before the next replay reuses it
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args).clone()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda")
    # The token and its position stay on the GPU and nothing waits for them, so the host queues the next steps
    # while the GPU runs this one (as a serving loop does). A position built on the host each step
    # (torch.tensor([pos], device="cuda")) is a blocking copy: the GPU idled ~700 us a token while the host
    # launched the next step (2026-12-01 profile: 2.9 ms a token wall, 2.2 ms of kernels).
    # The prompt runs eagerly, as `litquant generate --compile` runs it (set_next_token): one static step compiled.
    state = {"token": eager_next_token(model, torch.arange(prompt_len, device="cuda"), prompt),
             "position": torch.tensor([prompt_len], device="cuda")}

    @torch.inference_mode()
    def decode(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            state["token"] = step(model, state["position"], state["token"].view(1, -1))
            state["position"].add_(1)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    decode(3)  # warm up (and capture the CUDA graph)
    return decode


# Kernel name -> what it is, first match wins (names as the CUDA profiler reports them).
CATEGORIES = [
    ("quantized matmul", ("marlin", "gemv_kernel", "mma_kernel", "dequant_kernel", "kgemm_4bit", "tinygemm",
                          "int4")),
    ("attention", ("flash", "fmha", "attention", "Attention", "sdpa")),
    ("Inductor fused", ("triton_",)),  # before cuBLAS: Inductor names kernels after the ops they fuse ("..._gemm_...")
    ("cuBLAS matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma")),
    ("copy / index", ("memcpy", "Memcpy", "memset", "Memset", "copy", "index", "Cat", "scatter", "gather")),
]


def category(kernel_name: str) -> str:
    return next((name for name, keys in CATEGORIES if any(k in kernel_name for k in keys)), "other")


def own_times(intervals: List[Tuple[float, float]]) -> List[float]:
    """Each (start, end) interval's own time: the part of it after every interval that started before it has ended.

    The own times add up to the union of the intervals, the GPU's busy time. A kernel launched as a programmatic
    dependent starts while the kernel ahead still runs and waits for it: its recorded time holds that wait, its own
    time is what it adds after the kernel ahead has ended. (Intervals that start together: the longer one first.)"""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    own, busy_until = [0.0] * len(intervals), float("-inf")
    for i in order:
        start, end = intervals[i]
        own[i] = max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    return own


def profile_decode(decode: Callable[[int], float], tokens: int, trace: Path) -> Dict:
    """Decode `tokens` tokens under torch.profiler: per category and per kernel, the kernels a token, their recorded
    GPU microseconds and their own (`own_times`: what each adds to the GPU's busy time); the GPU's busy time against
    the wall time of a token; the 15 kernels of the most own time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = decode(tokens)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    own = own_times([(e.time_range.start, e.time_range.end) for e in kernels])
    per_category: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    per_kernel: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for e, own_us in zip(kernels, own):
        for table in (per_category[category(e.name)], per_kernel[e.name]):
            table[0] += e.time_range.elapsed_us() / tokens
            table[1] += own_us / tokens
            table[2] += 1 / tokens

    def by_own(item):  # (name, [recorded, own, count]): the most own time first
        return -item[1][1]

    trace.write_text(json.dumps([{"name": n, "us_per_token": us, "own_us_per_token": o, "per_token": c}
                                 for n, (us, o, c) in sorted(per_kernel.items(), key=by_own)], indent=1))
    return {"wall_us_per_token": 1e6 * wall / tokens, "gpu_busy_us_per_token": sum(own) / tokens,
            "kernel_us_per_token": sum(us for us, _, _ in per_category.values()),
            "categories": {k: {"us": us, "own_us": o, "kernels": c}
                           for k, (us, o, c) in sorted(per_category.items(), key=by_own)},
            "top_kernels": [{"name": n[:120], "us": us, "own_us": o, "per_token": c}
                            for n, (us, o, c) in sorted(per_kernel.items(), key=by_own)[:15]]}


def print_profile(variant: str, p: Dict) -> None:
    print(f"{variant}: {p['wall_us_per_token']:.0f} us a token (wall), "
          f"the GPU busy {p['gpu_busy_us_per_token']:.0f} us; the kernels' recorded times add up to "
          f"{p['kernel_us_per_token']:.0f} us (a programmatic dependent's counts its wait for the kernel ahead; "
          f"'own' is what each adds to the busy time)")
    if not p["categories"]:
        print("    the profiler recorded no GPU kernels (if CUDA graphs hid them, try --compile no)")
    for name, c in p["categories"].items():
        print(f"    {name:18} own {c['own_us']:8.1f} us  recorded {c['us']:8.1f} us  "
              f"{c['kernels']:6.1f} kernels a token")
    for k in p["top_kernels"]:
        print(f"      own {k['own_us']:8.1f} us  recorded {k['us']:8.1f} us  x{k['per_token']:5.1f}  {k['name']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Llama-2-7b-hf")
    parser.add_argument("--variants", default="bf16,bnb.nf4,torch,triton,marlin")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--compile", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--out_dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--profile", type=int, default=0, help="then decode this many tokens under torch.profiler")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (the KV cache filled before decoding)")
    parser.add_argument("--cache", type=int, default=0, help="KV cache positions (default: just enough)")
    parser.add_argument("--attention", choices=["sdpa", "flex", "both"], default="sdpa",
                        help="compiled one-token attention: litgpt's SDPA (as generate), or FlexAttention over the "
                             "filled part of the cache (as chat)")
    args = parser.parse_args()
    config = Config.from_name(args.model)
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for variant in args.variants.split(","):
        try:
            model = build(config, variant)
        except Exception as e:  # a kernel unavailable here is reported, not hidden
            print(f"{variant}: skipped ({type(e).__name__}: {e})")
            rows.append({"variant": variant, "error": f"{type(e).__name__}: {e}"})
            continue
        weight_bytes = model_bytes(model) - model.transformer.wte.weight.numel() * 2  # the embedding is gathered, not read
        limit = bandwidth / weight_bytes
        compiles = {"yes": [True], "no": [False], "both": [False, True]}[args.compile]
        attentions = {"flex": [True], "sdpa": [False], "both": [False, True]}[args.attention]
        for compile, flex in [(c, f) for c in compiles for f in (attentions if c else [False])]:
            profile = None
            attention = "flex" if flex else "sdpa"
            try:
                torch._dynamo.reset()
                decode = decoder(model, compile, args.tokens + args.profile, args.prompt, args.cache, flex)
                tps, error = args.tokens / decode(args.tokens), None
                if args.profile:
                    trace = args.out_dir / f"profile_{variant}{f'_compiled_{attention}' if compile else ''}.json"
                    args.out_dir.mkdir(parents=True, exist_ok=True)
                    profile = profile_decode(decode, args.profile, trace)
            except Exception as e:
                tps, error = float("nan"), f"{type(e).__name__}: {e}"
            row = {"variant": variant, "compile": compile, "attention": attention, "prompt": args.prompt,
                   "cache": model.max_seq_length, "tokens_per_s": tps, "weight_gib": weight_bytes / 2**30,
                   "bandwidth_limit_tokens_per_s": limit, "fraction_of_limit": tps / limit, "error": error,
                   "profile": profile}
            rows.append(row)
            print(f"{variant:10} compile={compile!s:5} {attention} {tps:8.1f} tok/s  "
                  f"weights {weight_bytes / 2**30:6.2f} GiB  limit {limit:7.1f} tok/s  ({100 * tps / limit:5.1f}%)"
                  + (f"  {error}" if error else ""))
            if profile:
                print_profile(f"{variant} compile={compile} {attention}", profile)
        del model
        torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "copy_TBps": bandwidth / 1e12, "gpu": torch.cuda.get_device_name(), "rows": rows}
    (args.out_dir / "e2e_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
