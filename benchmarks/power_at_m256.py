"""The H200's SM clock and power draw while triton (its tuned config) and bf16 cuBLAS run, to see whether a layer
where triton trails cuBLAS at M = 256 is held back by the 700 W cap.
Per shape: two rounds of cuBLAS then triton, each timed as benchmarks/kernels.py does (CUDA-graph replay over
weight copies > 4x L2) after `SETTLE_S` seconds of the same calls, while a thread samples nvidia-smi; prints the
time per call, the median clock and power over the timed call's window, and the energy per call.
    python3 benchmarks/power_at_m256.py [shapes] [m] [dtype]"""
import math
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from kernels import L2_MULTIPLE, SHAPES, build_litquant, build_peer, time_calls  # noqa: E402

SETTLE_S = 1.0
samples = []  # (time, SM MHz, W)


def sample_forever():
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    while True:
        clock, power = subprocess.run(query, capture_output=True, text=True).stdout.split(",")
        samples.append((time.perf_counter(), float(clock), float(power)))


def main():
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["7B-up", "70B-qkv", "70B-up"]
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[3] if len(sys.argv) > 3 else "bf16"]
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, M={m}, {dtype}, {SETTLE_S} s of settling a cell", flush=True)
    threading.Thread(target=sample_forever, daemon=True).start()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    for shape in shapes:
        k, n = SHAPES[shape]
        copies = max(2, math.ceil(L2_MULTIPLE * l2 / (k * n // 2)))
        kernels = {"cublas": [build_peer("cublas", k, n, dtype, dev, seed) for seed in range(copies)],
                   "triton": [build_litquant("triton", k, n, 4, 128, dtype, dev, seed) for seed in range(copies)]}
        x = torch.randn(m, k, device=dev).to(dtype)
        for fns in kernels.values():  # triton tunes here, outside the sampled windows
            fns[0](x)
        for _ in range(2):
            for name, fns in kernels.items():
                start = time.perf_counter()
                seconds = time_calls(fns, x, settle_s=SETTLE_S)[0]
                window = [s for s in samples if s[0] >= start + SETTLE_S / 2]
                clock = statistics.median(s[1] for s in window) if window else float("nan")
                power = statistics.median(s[2] for s in window) if window else float("nan")
                print(f"{shape:>8} {name:>6}  {seconds * 1e6:7.1f} us  SM {clock:6.0f} MHz  {power:5.0f} W  "
                      f"{power * seconds * 1e3:6.1f} mJ a call  ({len(window)} samples)", flush=True)
        del kernels
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
