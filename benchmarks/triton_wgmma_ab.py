"""The triton kernel's Gluon wgmma path (`litquant/kernels/triton_wgmma.py`) against its mma path and bf16 cuBLAS
on the GPU, 4-bit g128 with zero points, at the Llama-2 layer shapes.
Per (dtype, shape, M): every wgmma and mma candidate config of the tuner, each checked against the dequant path
(outputs NaN-poisoned first; the largest relative error is printed) and timed once; then 3 interleaved rounds of
cuBLAS / best mma / best wgmma (CUDA-graph replay over weight copies > 4x L2, half a second of settling), medians.
    python3 benchmarks/triton_wgmma_ab.py [shapes] [ms] [dtypes]"""
import math
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from kernels import L2_MULTIPLE, SHAPES, build_litquant, build_peer, time_calls  # noqa: E402
from triton_mma_ab import label, packed  # noqa: E402
import litquant.kernels.triton_kernel as tk  # noqa: E402

dev = torch.device("cuda")
l2 = torch.cuda.get_device_properties(dev).L2_cache_size


def main():
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
    ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [256, 1024, 4096]
    names = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in names.split(",")]
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    for dtype in dtypes:
        for shape in shapes:
            k, n = SHAPES[shape]
            copies = max(2, math.ceil(L2_MULTIPLE * l2 / (k * n // 2)))
            layers = [packed(build_litquant("triton", k, n, 4, 128, dtype, dev, seed)) for seed in range(copies)]
            dense = [build_peer("cublas", k, n, dtype, dev, seed) for seed in range(copies)]
            for m in ms:
                x = torch.randn(m, k, device=dev).to(dtype)
                ref = tk.quant_matmul(x, layers[0], config=tk.KernelConfig("dequant")).double()
                best, notes = {}, []
                for path in ("mma", "wgmma"):
                    tried = {}
                    for config in tk.candidate_configs(m, n, k, 4, dev):
                        if config.path != path:
                            continue
                        out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
                        try:
                            calls = [lambda x, w=w, c=config: tk.quant_matmul(x, w, config=c) for w in layers]
                            tk.quant_matmul(x, layers[0], out=out, config=config)
                            err = ((out.double() - ref).norm() / ref.norm()).item()
                            tried[config] = (time_calls(calls, x)[0] * 1e6, err, calls)
                        except Exception as e:
                            print(f"   {shape} M={m} {path} {label(config)}: {type(e).__name__}: {str(e)[:300]}")
                    if not tried:
                        continue
                    b = min(tried, key=lambda c: tried[c][0])
                    best[path] = (b, tried[b][2], max(v[1] for v in tried.values()))
                    notes.append(f"{path}: " + " ".join(f"{label(c)}{' tma' if c.x_descriptor else ''}:{v[0]:.1f}"
                                                        f"/{v[1]:.1e}" for c, v in
                                                        sorted(tried.items(), key=lambda i: i[1][0])))
                print(f"   {str(dtype)[6:]} {shape} M={m} | " + " | ".join(notes), flush=True)
                times = {name: [] for name in ("cublas",) + tuple(best)}
                for _ in range(3):
                    for name in times:
                        fns = dense if name == "cublas" else best[name][1]
                        times[name].append(time_calls(fns, x, settle_s=0.5)[0] * 1e6)
                med = {name: statistics.median(v) for name, v in times.items()}
                print(f"{str(dtype)[6:]:>5} {shape:>8} M={m:<5} cublas {med['cublas']:8.1f} | "
                      + " | ".join(f"{v} {med[v]:8.1f} us {med['cublas'] / med[v]:.2f}x {label(best[v][0])} "
                                   f"max err {best[v][2]:.1e}" for v in best), flush=True)
            del layers, dense
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
