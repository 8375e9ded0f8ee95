"""End-to-end batch-1 decode speed of a Llama-2-7B-shaped litgpt model: bf16, bnb.nf4 and 4-bit kernels.

Random weights (speed does not depend on them), built on the GPU; every quantized variant is RTN 4-bit
g128 through litquant's own loading path (QuantizedPrecision + the kernel's repack). Decode runs litgpt's
`next_token` with a static KV cache, compiled with CUDA graphs ("reduce-overhead") where the kernel
compiles, so Python overhead does not hide the kernels. The weight-bandwidth limit is the bytes of weights
read per token over the device-to-device copy bandwidth measured in the same run.

    python benchmarks/e2e_decode.py --out_dir benchmarks/results --kernels torch,triton,marlin
"""
import argparse
import json
import time
from pathlib import Path

import torch
from litgpt.config import Config
from litgpt.generate.base import next_token
from litgpt.model import GPT

from litquant.config import QuantizeConfig
from litquant.demo import model_bytes
from litquant.generate import set_kv_cache
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
    return model


@torch.inference_mode()
def decode_tokens_per_second(model: GPT, compile: bool, tokens: int, prompt_len: int = 16) -> float:
    model.eval()
    model.max_seq_length = prompt_len + tokens + 8
    set_kv_cache(model, torch.device("cuda"))
    compiled = torch.compile(next_token, mode="reduce-overhead") if compile else next_token

    def step(*args):  # a new CUDA-graph step per token; copy the output out before the next replay reuses it
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args).clone()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda")
    token = step(model, torch.arange(prompt_len, device="cuda"), prompt)
    for i in range(3):  # warm up (and capture the CUDA graph)
        token = step(model, torch.tensor([prompt_len + i], device="cuda"), token.view(1, -1))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(tokens):
        token = step(model, torch.tensor([prompt_len + 3 + i], device="cuda"), token.view(1, -1))
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Llama-2-7b-hf")
    parser.add_argument("--variants", default="bf16,bnb.nf4,torch,triton,marlin")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--compile", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--out_dir", type=Path, default=Path("benchmarks/results"))
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
        modes = {"yes": [True], "no": [False], "both": [False, True]}[args.compile]
        for compile in modes:
            try:
                tps = decode_tokens_per_second(model, compile, args.tokens)
                error = None
            except Exception as e:
                tps, error = float("nan"), f"{type(e).__name__}: {e}"
            row = {"variant": variant, "compile": compile, "tokens_per_s": tps, "weight_gib": weight_bytes / 2**30,
                   "bandwidth_limit_tokens_per_s": limit, "fraction_of_limit": tps / limit, "error": error}
            rows.append(row)
            print(f"{variant:10} compile={compile!s:5} {tps:8.1f} tok/s  weights {weight_bytes / 2**30:6.2f} GiB  "
                  f"limit {limit:7.1f} tok/s  ({100 * tps / limit:5.1f}%)" + (f"  {error}" if error else ""))
        del model
        torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "copy_TBps": bandwidth / 1e12, "gpu": torch.cuda.get_device_name(), "rows": rows}
    (args.out_dir / "e2e_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
