"""Times marlin's two ways to run a layer at each M, fused kernel against dequantize + cuBLAS, beside bf16 cuBLAS:
the measurement behind `MarlinQuantLinear`'s `dense_from_m` thresholds.

    python3 benchmarks/dense_threshold.py --bits 8 --m 128,256,512,1024 --settle 0.5

The layers are the ones `benchmarks/kernels.py` times (random codes, g128, zero points), timed the same way
(CUDA-graph replay over weight copies larger than 4x the L2); from M = 256 the H200 runs at its power cap, so
`--settle 0.5` times each path at its own steady clock.
"""
import argparse
import math

import torch

from kernels import L2_MULTIPLE, SHAPES, build_litquant, build_peer, time_calls, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[128, 256, 512, 1024])
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds of untimed replays before each timing (as benchmarks/kernels.py --settle)")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device("cuda")
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    print(f"marlin {args.bits}-bit g128 {args.dtype}: us per call (fused / dequantize + cuBLAS / bf16 cuBLAS)")
    for shape in args.shapes:
        k, n = SHAPES[shape]
        copies = max(2, math.ceil(L2_MULTIPLE * l2_bytes / weight_bytes("marlin", k, n, args.bits, 128, dtype)))
        layers = [build_litquant("marlin", k, n, args.bits, 128, dtype, device, seed) for seed in range(copies)]
        dense_copies = max(2, math.ceil(L2_MULTIPLE * l2_bytes / weight_bytes("cublas", k, n, 16, 128, dtype)))
        cublas = [build_peer("cublas", k, n, dtype, device, seed) for seed in range(dense_copies)]
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=dtype)
            times = {}
            for path, threshold in (("fused", m + 1), ("dense", 1)):
                for layer in layers:
                    layer.dense_from_m = threshold
                    layer.locks = layer.locks_for(m)  # (the fused kernel past the module's own threshold)
                times[path] = time_calls(layers, x, settle_s=args.settle)[0] * 1e6
            times["cublas"] = time_calls(cublas, x, settle_s=args.settle)[0] * 1e6
            faster = "fused" if times["fused"] <= times["dense"] else "dense"
            print(f"{shape:9} M={m:5d}: fused {times['fused']:8.1f}  dense {times['dense']:8.1f}  "
                  f"cublas {times['cublas']:8.1f}  ({faster} faster)", flush=True)


if __name__ == "__main__":
    main()
