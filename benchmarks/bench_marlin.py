"""Per-layer timing of the marlin kernel against bf16 cuBLAS (F.linear), on one GPU.

    python benchmarks/bench_marlin.py --out results.json

Weights are random 4-bit g128 (symmetric); each timed function rotates over enough copies of its
weights that they never fit in L2. Times are medians of triton's do_bench, in microseconds.
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from litquant.formats import QuantizedWeight
from litquant.formats.common import default_g_idx, num_groups
from litquant.kernels.base import LayerSpec
from litquant.kernels.marlin import MarlinQuantLinear

L2_ROTATION_BYTES = 512 * 2**20


def median_us(fn) -> float:
    return 1000 * do_bench(fn, warmup=50, rep=200, return_mode="median")


def rotating(fns):
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_us(lambda: dst.copy_(src)) * 1e-6)


def marlin_layers(k: int, n: int, dtype: torch.dtype, copies: int):
    layers = []
    for _ in range(copies):
        g = num_groups(k, 128)
        qw = QuantizedWeight(torch.randint(0, 16, (k, n), dtype=torch.uint8, device="cuda"),
                             (torch.rand(g, n, device="cuda") * 0.01 + 0.001).half(),
                             torch.full((g, n), 8, dtype=torch.uint8, device="cuda"),
                             default_g_idx(k, 128, "cuda"), 4, 128)
        layer = MarlinQuantLinear(k, n, False, LayerSpec(k, n, 4, 128, True, False), dtype)
        layer.load_quantized(qw)
        layers.append(layer)
    return layers


def weight_bytes(layer: MarlinQuantLinear) -> int:
    return layer.qweight.numel() * 4 + layer.scales.numel() * layer.scales.element_size()


def main(out: str, shapes, rows, dtype: torch.dtype) -> None:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = {"device": torch.cuda.get_device_name(), "copy_TBps": bandwidth / 1e12, "dtype": str(dtype), "rows": []}
    for k, n in shapes:
        dense = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(max(2, -(-L2_ROTATION_BYTES // (2 * n * k))))]
        layers = marlin_layers(k, n, dtype, max(2, -(-L2_ROTATION_BYTES // (n * k // 2))))
        ops = torch.ops.litquant_marlin
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            locks = torch.zeros(-(-m // 16) * (n // 64), dtype=torch.int32, device="cuda")
            bf16_us = median_us(rotating([lambda w=w: F.linear(x, w) for w in dense]))
            fused_us = median_us(rotating([lambda l=l: ops.gemm(x, l.qweight, l.scales, l.zeros, None, locks, 128)
                                           for l in layers]))
            module_us = median_us(rotating([lambda l=l: l(x) for l in layers]))
            row = {"shape": f"{k}x{n}", "M": m, "bf16_us": bf16_us, "marlin_fused_us": fused_us,
                   "marlin_module_us": module_us, "speedup_fused": bf16_us / fused_us,
                   "speedup_module": bf16_us / module_us,
                   "fused_bandwidth_fraction": weight_bytes(layers[0]) / (fused_us * 1e-6) / bandwidth}
            results["rows"].append(row)
            print(f"{k:>6}x{n:<6} M={m:<5} bf16 {bf16_us:8.1f} us  fused {fused_us:8.1f} us ({row['speedup_fused']:.2f}x, "
                  f"{100 * row['fused_bandwidth_fraction']:.0f}% of copy BW)  module {module_us:8.1f} us "
                  f"({row['speedup_module']:.2f}x)", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_marlin.json")
    parser.add_argument("--rows", default="1,16,64,128,256,1024")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    main(args.out, [(8192, 28672), (28672, 8192)], [int(r) for r in args.rows.split(",")], getattr(torch, args.dtype))
