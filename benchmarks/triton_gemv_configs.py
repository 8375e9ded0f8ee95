"""Time the triton kernel's gemv path over a grid of configs (BLOCK_N, warps, pipeline stages, split-K), to choose
the candidates that `candidate_configs` offers to the autotuner. One GPU; 4-bit g128 zero-point weights, bf16.

    python benchmarks/triton_gemv_configs.py --shapes 70B-up,7B-qkv --m 1,2
    python benchmarks/triton_gemv_configs.py --shapes 70B-qkv --tiles 256x4,128x4 --stages 2,3 --splits 4,5,6,8

Prints, per shape and M, the eight fastest configs and the two slowest, against bf16 cuBLAS timed the same way
(`kernels.time_calls`: CUDA-graph replay over enough weight copies to defeat the L2), with each config's error
against the float64 product.
"""
import argparse
import itertools
import math
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import SHAPES, log, random_quantized_weight, time_calls  # noqa: E402
from litquant.kernels import triton_kernel as tk  # noqa: E402

def sweep(shape: str, m: int, device: torch.device, tiles: List[Tuple[int, int]], stages: List[int],
          splits: Optional[List[int]]) -> None:
    """Time every (BLOCK_N, warps) tile x pipeline depth x split-K (`splits`, or about 1, 2 and 4 programs an SM)."""
    k, n = SHAPES[shape]
    copies = max(1, math.ceil(240e6 / (k * n / 2)))
    weights = [random_quantized_weight(k, n, 4, 128, device, seed=i) for i in range(copies)]
    packed = [tk.repack(w) for w in weights]
    dense = [w.dequantize(torch.bfloat16) for w in weights[:max(1, copies // 4)]]
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    t_cublas, _ = time_calls([lambda x, w=w: F.linear(x, w) for w in dense], x)
    exact = x.double() @ weights[0].dequantize(torch.float64).t()
    sms, chunks = torch.cuda.get_device_properties(device).multi_processor_count, -(-k // 128)
    results = []
    for (block_n, warps), depth in itertools.product(tiles, stages):
        want = -(-2 * sms // (-(-n // block_n) * m))
        split = min(1 << (want - 1).bit_length(), chunks)
        for split_k in splits or sorted({max(1, split // 2), split, min(2 * split, chunks)}):
            config = tk.KernelConfig("gemv", block_n=block_n, block_m=1, split_k=split_k, num_warps=warps,
                                     num_stages=depth)
            out = tk.quant_matmul(x, packed[0], config=config)
            error = ((out.double() - exact).norm() / exact.norm()).item()
            t, _ = time_calls([lambda x, p=p: tk.quant_matmul(x, p, config=config) for p in packed], x)
            results.append((t, config, error))
    results.sort(key=lambda r: r[0])
    log(f"== {shape} M={m}: cublas {t_cublas * 1e6:.1f} us; weight {k * n / 2 / 1e6:.0f} MB")
    for t, c, error in results[:8] + results[-2:]:
        log(f"  bn={c.block_n:3d} w={c.num_warps} st={c.num_stages} split={c.split_k:3d}: {t * 1e6:7.1f} us "
            f"{t_cublas / t:5.2f}x {k * n / 2 / t / 1e12:5.2f} TB/s err {error:.1e}")
    best = {}
    for t, c, _ in results:
        best.setdefault(c.num_stages, t)
    log("  best per stages: " + ", ".join(f"st{s}={v * 1e6:.1f}" for s, v in sorted(best.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated from {', '.join(SHAPES)}")
    parser.add_argument("--m", default="1", help="comma-separated row counts (the gemv serves M <= 4)")
    parser.add_argument("--tiles", default="128x4,256x4,256x8,512x8", help="comma-separated BLOCK_Nxwarps")
    parser.add_argument("--stages", default="1,2,3,4", help="comma-separated cp.async pipeline depths")
    parser.add_argument("--splits", default="", help="comma-separated split-K factors (default: about 1, 2 and 4 "
                        "programs an SM, in powers of two)")
    args = parser.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    stages = [int(v) for v in args.stages.split(",")]
    splits = [int(v) for v in args.splits.split(",")] if args.splits else None
    for shape in args.shapes.split(","):
        for m in (int(v) for v in args.m.split(",")):
            sweep(shape, m, torch.device("cuda"), tiles, stages, splits)


if __name__ == "__main__":
    main()
