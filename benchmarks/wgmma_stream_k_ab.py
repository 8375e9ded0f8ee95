"""A/B of the wgmma path's stream-K schedule against the former kernel (d0acc39: one program a tile, the last
partial wave's tiles split over K in a second launch) and bf16 cuBLAS, in one process, bf16 by default. The former
module is read from benchmarks/_main_wgmma.py; make it first with

    git show d0acc39:litquant/kernels/triton_wgmma.py > benchmarks/_main_wgmma.py
    python3 benchmarks/wgmma_stream_k_ab.py [shapes] [ms] [dtype]

Per (shape, M): each config checked against the dequantized reference (output NaN-poisoned); then a CUDA graph per
config (calls over weight copies > 4x L2, about a millisecond), all replayed in turn for 0.5 s, then 40 more turns
each replay timed by events: every config runs at the same (power-capped) clock, which is fair between the
quantized configs; cuBLAS then runs at a clock that its own calls would lower (compare it in a settled table).
Medians in us a call. Results: benchmarks/results/2026-12-02-wgmma-stream-k.md."""
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import _main_wgmma  # noqa: E402
from kernels import L2_MULTIPLE, SHAPES, alternate, build_litquant, build_peer  # noqa: E402
import litquant.kernels.triton_kernel as tk  # noqa: E402

dev = torch.device("cuda")
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
ms = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [256, 1024]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[3] if len(sys.argv) > 3 else "bf16"]
sms = torch.cuda.get_device_properties(dev).multi_processor_count
print(f"# {torch.cuda.get_device_name()}, {dtype}, 4-bit g128 zero points", flush=True)


def main_call(w, block_m, split):
    """main's wgmma launch (its tail split where split > 1)."""
    def call(x, out=None):
        m, n = x.shape[0], w.qweight.shape[1]
        out = torch.empty(m, n, dtype=x.dtype, device=dev) if out is None else out
        partials = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=dev)
        _main_wgmma.launch(x, w.qweight, w.scale_zero, None, out, partials, w.locks, split, 4, 128, block_m, 128, 8,
                           3 if block_m == 256 else 4)
        return out
    return call


for shape in shapes:
    k, n = SHAPES[shape]
    copies = max(1, math.ceil(L2_MULTIPLE * torch.cuda.get_device_properties(dev).L2_cache_size / (k * n // 2)))
    modules = [build_litquant("triton", k, n, 4, 128, dtype, dev, seed=s) for s in range(copies)]
    weights = [tk.PackedWeight(w.qweight, w.scale_zero, w.perm, w.locks, 4, 128) for w in modules]
    dense = [build_peer("cublas", k, n, dtype, dev, seed=s) for s in range(copies)]
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = x.double() @ tk.quant_matmul(torch.eye(k, device=dev, dtype=dtype), weights[0],
                                           config=tk.KernelConfig("dequant")).double()
        variants = {"cublas": dense}
        for block_m in (128, 256):
            stages = 3 if block_m == 256 else 4
            tiles = -(-m // block_m) * -(-n // 128)
            split = _main_wgmma.tail_split(tiles, sms, sms)
            for s in sorted({1, split}):
                variants[f"main {block_m} k{s}"] = [main_call(w, block_m, s) for w in weights]
            for stream_k in (False, True):
                config = tk.KernelConfig("wgmma", block_n=128, block_m=block_m, num_warps=8, num_stages=stages,
                                         stream_k=stream_k)
                variants[f"new {block_m}{' sk' if stream_k else ''}"] = [
                    lambda x, out=None, w=w, c=config: tk.quant_matmul(x, w, out=out, config=c) for w in weights]
        for name, fns in variants.items():
            if name == "cublas":
                continue
            for w, fn in zip(weights[:2], fns[:2]):
                out = fn(x, torch.full((m, n), float("nan"), dtype=dtype, device=dev))
                err = ((out.double() - ref).norm() / ref.norm()).item() if w is weights[0] else 0.0
                assert torch.isfinite(out).all() and err < 1e-2, (name, err)
                assert not w.locks.any(), name
            print(f"   {shape} M={m} {name}: rel err {err:.1e}", flush=True)
        print(f"{shape:>8} M={m:<5} " + "  ".join(f"{name} {t:6.1f}" for name, t in alternate(variants, x).items()),
              flush=True)
