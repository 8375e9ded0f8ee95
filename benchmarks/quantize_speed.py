"""GPTQ speed: 4-bit g128 of a Llama-2-7B-shaped litgpt model with random weights, on one GPU.

    python benchmarks/quantize_speed.py --out_dir benchmarks/results/quantize_speed
    python benchmarks/quantize_speed.py --tiny true --device cpu --out_dir /tmp/q   # a two-block smoke run

The model is built on the CPU in bf16 (random normal weights, std 0.02; unit norms) and quantized block by
block as `litquant quantize --method gptq` does, on 128 random calibration sequences of 2048 tokens. The
target (DESIGN.md) is 5 minutes or less on one H200, with GPU memory at about one block plus its
activations. Writes `quantize_speed.json`: the time of each block (quantization alone, and from the start
of one block to the start of the next, which adds the driver's run of the quantized block), the total,
the peak GPU memory and, for comparison, the sizes of one block and of the activations.
"""
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from litgpt.config import Config
from litgpt.model import GPT, Block

from litquant.config import QuantizeConfig
from litquant.formats import QuantizedWeight
from litquant.quantize.blockwise import BlockInputs, quantize_blockwise
from litquant.quantize.gptq import block_quantizer

TINY = dict(name="tiny-llama", block_size=256, vocab_size=256, padded_vocab_size=256, n_layer=2, n_embd=128,
            n_head=4, n_query_groups=2, head_size=32, rotary_percentage=1.0, parallel_residual=False, bias=False,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=352)


def random_model(config: Config, dtype: torch.dtype, seed: int) -> GPT:
    """A GPT with random weights, allocated once on the CPU (no full-precision copy on the way)."""
    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name or "ln_f" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
    model.reset_parameters()  # the rope cache, which to_empty left uninitialized
    return model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(out_dir: Path = Path("benchmarks/results/quantize_speed"), model_name: str = "Llama-2-7b-hf",
         tiny: bool = False, device: Optional[str] = None, num_samples: int = 128, seq_len: int = 2048,
         batch_size: int = 8, bits: int = 4, group_size: int = 128, desc_act: bool = False,
         true_sequential: bool = True, seed: int = 0) -> Dict:
    """Time GPTQ of a random-weight model and write `quantize_speed.json` to `out_dir`.

    Args:
        out_dir: where the JSON goes.
        model_name: a litgpt config name (the shapes quantized).
        tiny: a two-block model with 8 sequences of 128 tokens instead, to check the script on a CPU.
        device: where blocks are quantized (default: cuda if available, else cpu).
        num_samples: calibration sequences.
        seq_len: tokens per sequence.
        batch_size: sequences per forward pass.
        bits: bits per weight.
        group_size: columns per group.
        desc_act: act_order.
        true_sequential: quantize the block's Linears stage by stage.
        seed: seed of the weights and the tokens.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tiny:
        config, num_samples, seq_len = Config(**TINY), 8, 128
    else:
        config = Config.from_name(model_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build_start = time.perf_counter()
    model = random_model(config, torch.bfloat16, seed)
    build_seconds = time.perf_counter() - build_start
    tokens = torch.randint(0, config.vocab_size, (num_samples, seq_len),
                           generator=torch.Generator().manual_seed(seed))
    quant_config = QuantizeConfig(method="gptq", bits=bits, group_size=group_size, sym=True, desc_act=desc_act,
                                  true_sequential=true_sequential)

    quantize_block = block_quantizer(quant_config)
    block_starts: List[float] = []
    gptq_seconds: List[float] = []

    def timed_quantize_block(block: Block, inputs: BlockInputs, prefix: str) -> Dict[str, QuantizedWeight]:
        synchronize(device)
        block_starts.append(time.perf_counter())
        quantized = quantize_block(block, inputs, prefix)
        synchronize(device)
        gptq_seconds.append(time.perf_counter() - block_starts[-1])
        return quantized

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    quantized = quantize_blockwise(model, tokens, timed_quantize_block, device, dtype, batch_size,
                                   description="GPTQ")
    synchronize(device)
    end = time.perf_counter()

    block_bytes = sum(p.numel() * p.element_size() for p in model.transformer.h[0].parameters())
    activation_bytes = num_samples * seq_len * config.n_embd * torch.tensor([], dtype=dtype).element_size()
    result = {
        "model": config.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "quantize_config": quant_config.describe(),
        "num_samples": num_samples,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "quantized_linears": len(quantized),
        "build_model_seconds": build_seconds,
        "total_seconds": end - start,
        "block_seconds": [b - a for a, b in zip(block_starts, block_starts[1:] + [end])],
        "gptq_seconds": gptq_seconds,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "block_parameters_gib": block_bytes / 2**30,
        "block_activations_gib": activation_bytes / 2**30,  # inputs of one block (its outputs take as much)
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quantize_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['model']} {result['quantize_config']} on {result['device']}: {result['total_seconds']:.1f} s, "
          f"{sum(result['block_seconds']) / len(result['block_seconds']):.2f} s per block, "
          f"peak GPU memory {result['peak_gpu_memory_gib']} GiB")
    return result


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
