"""A/B of the triton mma path's variants on the GPU: one dot a field (F = 1, sm_80's default), one dot a chunk
(F = 8 at 4 bits, the Hopper default), F = 8 with x through a TMA descriptor above M = 64
(`KernelConfig.x_descriptor`), and bf16 cuBLAS, 4-bit g128 with zero points.
Per (dtype, shape, M): every mma candidate config of the tuner (plus deeper pipelines above M = 64, and 256-row
tiles from M = 256) at both F, each checked
against the dequant path (outputs NaN-poisoned first) and timed once; then 3 interleaved rounds of cublas and the
best of each (CUDA-graph replay over weight copies > 4x L2; half a second of settling first at M >= 256), medians;
the last column is the time against F = 1's.
    python3 benchmarks/triton_mma_ab.py [shapes] [ms] [dtypes]"""
import dataclasses
import math
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from kernels import L2_MULTIPLE, SHAPES, build_litquant, build_peer, time_calls  # noqa: E402
import litquant.kernels.triton_kernel as tk  # noqa: E402

dev = torch.device("cuda")
l2 = torch.cuda.get_device_properties(dev).L2_cache_size
sms = torch.cuda.get_device_properties(dev).multi_processor_count


def configs(m, n, k):
    found = [c for c in tk.candidate_configs(m, n, k, 4, dev) if c.path == "mma"]
    if m > 64:
        deeper = [dataclasses.replace(c, num_stages=c.num_stages + 1) for c in found if c.num_warps == 8]
        found += [c for c in deeper if c not in found]
    if m > 64:  # 2 stages: with TMA (fewer registers) two 128 x 128 blocks fit an SM
        found += [dataclasses.replace(c, num_stages=2) for c in found if c.num_warps == 8 and c.block_m == 128]
    if m >= 256:  # 256 token columns a tile: m64n256k16 wgmmas, half the dequantization a MAC (250 registers at F=8)
        split = 1 if -(-m // 256) * -(-n // 128) >= sms else 2
        found += [tk.KernelConfig("mma", block_n=128, block_m=256, split_k=split, num_warps=8, num_stages=stages)
                  for stages in (2, 3)]
    return found


def packed(layer):
    return tk.PackedWeight(layer.qweight, layer.scale_zero, layer.perm, layer.locks, 4, 128)


def label(c):
    return f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}k{c.split_k}"


def compare(shape, m, dtype, layers, dense, x, ref, candidates, settle_s):
    """Time each config of each named group of `candidates` once (output NaN-poisoned first, checked against
    `ref`), then 3 interleaved rounds of cuBLAS and each group's fastest; prints both, returns the medians (us)
    and each group's (fastest config, largest relative error)."""
    n = ref.shape[1]
    best, notes = {}, []
    for name, configs in candidates.items():
        tried = {}
        for config in configs:
            out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
            try:
                calls = [lambda x, w=w, c=config: tk.quant_matmul(x, w, config=c) for w in layers]
                tk.quant_matmul(x, layers[0], out=out, config=config)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                tried[config] = (time_calls(calls, x)[0] * 1e6, err, calls)
            except Exception as e:
                print(f"   {shape} M={m} {name} {label(config)}: {type(e).__name__}: {str(e)[:300]}")
        if tried:
            fastest = min(tried, key=lambda c: tried[c][0])
            best[name] = (fastest, tried[fastest][2], max(v[1] for v in tried.values()))
            notes.append(f"{name}: " + " ".join(f"{label(c)}{' tma' if c.x_descriptor else ''}:{v[0]:.1f}/{v[1]:.1e}"
                                                for c, v in sorted(tried.items(), key=lambda i: i[1][0])))
    print(f"   {str(dtype)[6:]} {shape} M={m} | " + " | ".join(notes), flush=True)
    times = {name: [] for name in ("cublas",) + tuple(best)}
    for _ in range(3):
        for name in times:
            fns = dense if name == "cublas" else best[name][1]
            times[name].append(time_calls(fns, x, settle_s=settle_s)[0] * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}, {k: (v[0], v[2]) for k, v in best.items()}


def run(candidates, default_ms):
    """For argv's shapes, M values and dtypes (4-bit g128 layers with zero points): `compare` the config groups
    that candidates(m, n, k) names."""
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
    ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else default_ms
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
                groups = candidates(m, n, k)
                med, best = compare(shape, m, dtype, layers, dense, x, ref, groups, 0.5 if m >= 256 else 0.0)
                first = next(iter(best))
                print(f"{str(dtype)[6:]:>5} {shape:>8} M={m:<5} cublas {med['cublas']:8.1f} | "
                      + " | ".join(f"{v} {med[v]:8.1f} us {med['cublas'] / med[v]:.2f}x {label(best[v][0])} "
                                   f"max err {best[v][1]:.1e} {med[v] / med[first] - 1:+.1%}" for v in best),
                      flush=True)
            del layers, dense
            torch.cuda.empty_cache()


def mma_variants(m, n, k):
    """F = 1, F = 8 and (above M = 64) F = 8 with x through TMA, over the mma configs."""
    variants = {"1": dict(fields_per_dot=1), "8": dict(fields_per_dot=8)}
    if m > 64:
        variants["tma"] = dict(fields_per_dot=8, x_descriptor=True)
    return {name: [dataclasses.replace(c, **changes) for c in configs(m, n, k)] for name, changes in variants.items()}


if __name__ == "__main__":
    run(mma_variants, [16, 64, 128, 256, 1024])
