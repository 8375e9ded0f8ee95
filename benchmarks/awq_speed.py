"""How fast AWQ quantizes a Llama-2-7B-shaped litgpt model, and how much GPU memory it takes.

The weights are random (speed does not depend on them) and so are the calibration tokens: 128 samples
of 512 tokens by default, AutoAWQ's calibration size. Prints one JSON object (and writes it to --out).

    python benchmarks/awq_speed.py                       # Llama-2-7B shapes on CUDA
    python benchmarks/awq_speed.py --model Meta-Llama-3-8B
    python benchmarks/awq_speed.py --tiny                # a two-block model on the CPU, in seconds
"""
import argparse
import json
import logging
import platform
import time
from pathlib import Path
from typing import List, Optional

import torch
from litgpt.config import Config
from litgpt.model import GPT

from litquant.config import QuantizeConfig
from litquant.quantize.awq import quantize_model

TINY = dict(name="tiny-llama", block_size=512, vocab_size=256, padded_vocab_size=256, n_layer=2, n_embd=128, n_head=4,
            n_query_groups=2, head_size=32, rotary_percentage=1.0, parallel_residual=False, bias=False,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=384)


def random_model(config: Config, dtype: torch.dtype, init_device: torch.device, seed: int) -> GPT:
    """A GPT with N(0, 0.02) weights and unit norms, on the CPU in `dtype`; tensors are drawn on
    `init_device` (the GPU draws 7B random numbers much faster than the CPU)."""
    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model.to_empty(device="cpu")
    generator = torch.Generator(init_device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                values = torch.randn(p.shape, generator=generator, device=init_device, dtype=torch.float32)
                p.copy_(values.mul_(0.02))
    model.reset_parameters()  # the rope cache
    return model.eval()


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Llama-2-7b-hf", help="a litgpt config name")
    parser.add_argument("--tiny", action="store_true", help="a tiny two-block model on the CPU (for tests)")
    parser.add_argument("--num_samples", type=int, default=128)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--group_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--no_clip", action="store_true", help="skip the clip search")
    parser.add_argument("--no_duo_scaling", action="store_true", help="scales from activations only")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--offload", action="store_true", help="keep activations on the CPU between blocks")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if args.tiny:
        config = Config(**TINY)
        device = torch.device(args.device or "cpu")
        num_samples, seq_len, group_size, dtype = min(args.num_samples, 4), min(args.seq_len, 64), 64, torch.float32
    else:
        config = Config.from_name(args.model)
        device = torch.device(args.device or "cuda")
        num_samples, seq_len, group_size = args.num_samples, args.seq_len, args.group_size
        dtype = getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny (CPU) or on a GPU machine")

    model = random_model(config, dtype, device, seed=0)
    tokens = torch.randint(0, config.vocab_size, (num_samples, seq_len), generator=torch.Generator().manual_seed(0))
    quantize_config = QuantizeConfig(method="awq", bits=4, group_size=group_size, sym=False,
                                     checkpoint_format="awq_gemm")

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    quantized = quantize_model(model, tokens, quantize_config, device, batch_size=args.batch_size, offload=args.offload,
                               duo_scaling=not args.no_duo_scaling, apply_clip=not args.no_clip, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start

    result = {
        "benchmark": "awq_speed",
        "model": config.name,
        "n_layer": config.n_layer,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "num_samples": num_samples,
        "seq_len": seq_len,
        "group_size": group_size,
        "duo_scaling": not args.no_duo_scaling,
        "apply_clip": not args.no_clip,
        "offload": args.offload,
        "quantized_linears": len(quantized),
        "seconds": round(seconds, 2),
        "seconds_per_block": round(seconds / config.n_layer, 3),
        "peak_gpu_memory_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                                if device.type == "cuda" else None),
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
