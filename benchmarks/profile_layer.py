"""Calls one quantized layer a few times, for a profiler to watch (ncu, nsys).

    ncu --kernel-name regex:wgmma --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python3 benchmarks/profile_layer.py --kernel marlin --shape 70B-up --m 64

The layer is the one `benchmarks/kernels.py` times (random 4-bit g128 codes with zero points), so the
profile and the benchmark's table describe the same launch.
"""
import argparse

import torch

from kernels import SHAPES, build_litquant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="marlin")
    parser.add_argument("--shape", default="70B-up", choices=sorted(SHAPES))
    parser.add_argument("--m", type=int, default=64, help="activation rows")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    k, n = SHAPES[args.shape]
    device = torch.device("cuda")
    layer = build_litquant(args.kernel, k, n, args.bits, args.group_size, dtype, device, seed=0)
    x = torch.randn(args.m, k, device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(args.calls):
            layer(x)
    torch.cuda.synchronize()
    print(f"{args.kernel} {args.shape} M={args.m} {args.dtype}: {args.calls} calls done")


if __name__ == "__main__":
    main()
