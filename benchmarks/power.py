"""The GPU's SM clock and power draw while each kernel runs a layer, to see which cells the power cap holds back.

Each cell (shape, M, kernel) is timed twice as benchmarks/kernels.py times it (CUDA-graph replay over weight copies
larger than 4x the L2): first after `--idle_s` seconds with the GPU idle (the clock at its boost), then after
`--settle_s` seconds of the cell's own calls (its steady state under the cap, as the kernel tables time it). A
thread samples nvidia-smi meanwhile; each line gives the time per call, the median SM clock and power draw over the
second half of the settling and the timed replays, and the energy per call (power x time). From idle, that window
holds few samples or none: its time is what counts there.

    python3 benchmarks/power.py --shapes 70B-up --m 64 --kernels marlin,cublas
"""
import math
import statistics
import subprocess
import sys
import threading
import time

import torch
from jsonargparse import CLI

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from kernels import L2_MULTIPLE, PEERS, SHAPES, build_litquant, build_peer, time_calls  # noqa: E402

samples = []  # (time, SM MHz, W)


def sample_forever() -> None:
    # power.draw is a 1 s average on recent drivers; power.draw.instant (driver 530 on) is the latest reading
    fields = "clocks.sm,power.draw.instant"
    if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True).returncode:
        fields = "clocks.sm,power.draw"
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    while True:
        clock, power = subprocess.run(query, capture_output=True, text=True).stdout.split(",")
        samples.append((time.perf_counter(), float(clock), float(power)))


def timed_window(fns, x, idle_s: float, settle_s: float) -> str:
    """Time the calls after `idle_s` idle seconds and `settle_s` of their own; report clock, power and energy."""
    time.sleep(idle_s)
    start = time.perf_counter()
    seconds = time_calls(fns, x, settle_s=settle_s)[0]
    window = [s for s in samples if s[0] >= start + settle_s / 2]  # the settled half and the timed replays
    clock = statistics.median(s[1] for s in window) if window else float("nan")
    power = statistics.median(s[2] for s in window) if window else float("nan")
    return (f"{seconds * 1e6:8.1f} us  SM {clock:5.0f} MHz  {power:4.0f} W  {power * seconds * 1e3:6.2f} mJ a call "
            f"({len(window)} samples)")


def main(shapes: str = "70B-qkv,70B-up,70B-down", m: str = "1,16,64", kernels: str = "marlin,cublas",
         dtype: str = "bf16", idle_s: float = 1.0, settle_s: float = 1.0) -> None:
    """Clock, power and energy per call of each kernel on each layer, from idle and settled.

    Args:
        shapes: layer shapes of benchmarks/kernels.py, comma-separated.
        m: token counts, comma-separated.
        kernels: litquant kernels (4-bit g128, zero points) and peers (cublas, tinygemm, bnb-nf4), comma-separated.
        dtype: bf16 or fp16.
        idle_s: seconds of idle GPU before the first timing of a cell.
        settle_s: seconds of the cell's own calls before its second timing.
    """
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, {dtype}; each cell from {idle_s} s idle, then after {settle_s} s "
          f"of its own calls", flush=True)
    threading.Thread(target=sample_forever, daemon=True).start()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    for shape in shapes.split(","):
        k, n = SHAPES[shape]
        copies = max(2, math.ceil(L2_MULTIPLE * l2 / (k * n // 2)))
        built = {name: [build_peer(name, k, n, torch_dtype, dev, seed) if name in PEERS
                        else build_litquant(name, k, n, 4, 128, torch_dtype, dev, seed) for seed in range(copies)]
                 for name in kernels.split(",")}
        for rows in map(int, m.split(",")):
            x = torch.randn(rows, k, device=dev).to(torch_dtype)
            for fns in built.values():  # a tuner runs here, outside the sampled windows
                fns[0](x)
            for name, fns in built.items():
                for label, idle, settle in (("idle", idle_s, 0.0), ("settled", 0.0, settle_s)):
                    print(f"{shape:>8} M={rows:<4} {name:>7} {label:>7}  {timed_window(fns, x, idle, settle)}",
                          flush=True)
        del built
        torch.cuda.empty_cache()


if __name__ == "__main__":
    CLI(main, as_positional=False)
