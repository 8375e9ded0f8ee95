"""A/B for this branch (remove exp/ before merging): the triton gemv of main (exp/tk_main.py, a copy) against this
branch's (constexpr group size, unmasked loads on even shapes), interleaved in one process, each module tuning its
own configs. Run on the GPU from the repository root:
    python3 exp/ab_triton_even.py [shapes] [ms] [dtypes]
"""
import importlib.util
import math
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
from kernels import L2_MULTIPLE, SHAPES, random_quantized_weight, time_calls  # noqa: E402

import litquant.kernels.triton_kernel as new  # noqa: E402

# main's module under another op name (the custom op of this branch's module is registered already); the source
# file is kept as it is on main so that triton finds the kernels' source lines
source = open("exp/tk_main.py").read().replace('"litquant::triton_quant_linear"', '"litquant::triton_quant_linear_main"')
old = importlib.util.module_from_spec(importlib.util.spec_from_loader("tk_main", loader=None))
old.__file__ = "exp/tk_main.py"
exec(compile(source, "exp/tk_main.py", "exec"), old.__dict__)

dev = torch.device("cuda")
l2 = torch.cuda.get_device_properties(dev).L2_cache_size
shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4]
dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in (sys.argv[3] if len(sys.argv) > 3 else "bf16").split(",")]
for dtype in dtypes:
    for shape in shapes:
        k, n = SHAPES[shape]
        copies = max(2, math.ceil(L2_MULTIPLE * l2 / (k * n // 2)))
        qws = [random_quantized_weight(k, n, 4, 128, dev, seed) for seed in range(copies)]
        packed = {"main": [old.repack(q) for q in qws], "branch": [new.repack(q) for q in qws]}
        matmul = {"main": old.quant_matmul, "branch": new.quant_matmul}
        exact_weight = qws[0].dequantize(torch.float64)
        for m in ms:
            x = torch.randn(m, k, device=dev).to(dtype)
            exact = x.double() @ exact_weight.t()
            errors = {name: ((matmul[name](x, packed[name][0]).double() - exact).norm() / exact.norm()).item()
                      for name in packed}
            times = {name: [] for name in packed}
            for _ in range(3):
                for name in packed:
                    t, _ = time_calls([lambda x, p=p, f=matmul[name]: f(x, p) for p in packed[name]], x)
                    times[name].append(t * 1e6)
            a, b = statistics.median(times["main"]), statistics.median(times["branch"])
            print(f"{str(dtype)[6:]:>8} {shape:>8} M={m:<3} main {a:7.1f}  branch {b:7.1f}  ({(b / a - 1) * 100:+5.1f}%)  "
                  f"runs {['%.1f' % v for v in times['main']]} {['%.1f' % v for v in times['branch']]}  "
                  f"errors vs fp64 {errors['main']:.1e} / {errors['branch']:.1e}", flush=True)
        del qws, packed
        torch.cuda.empty_cache()
