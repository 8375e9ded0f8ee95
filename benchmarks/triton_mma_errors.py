"""Per-config relative error of the triton mma path (F = 1, F = 8, F = 8 + x descriptor) against the dequant path,
outputs NaN-poisoned, for every config that benchmarks/triton_mma_ab.py times.
    python3 benchmarks/triton_mma_errors.py [shape:M,...] [dtype]"""
import dataclasses
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from kernels import SHAPES, build_litquant  # noqa: E402
import litquant.kernels.triton_kernel as tk  # noqa: E402
from triton_mma_ab import configs, label, packed  # noqa: E402

dev = torch.device("cuda")
cells = [c.split(":") for c in (sys.argv[1] if len(sys.argv) > 1 else "70B-down:256,7B-up:333,70B-qkv:64").split(",")]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[2] if len(sys.argv) > 2 else "fp16"]
for shape, m in cells:
    m = int(m)
    k, n = SHAPES[shape]
    layer = packed(build_litquant("triton", k, n, 4, 128, dtype, dev, 0))
    x = torch.randn(m, k, device=dev).to(dtype)
    ref = tk.quant_matmul(x, layer, config=tk.KernelConfig("dequant")).double()
    for config in configs(m, n, k):
        errs = []
        for fields, desc in ((1, False), (8, False), (8, True)):
            c = dataclasses.replace(config, fields_per_dot=fields, x_descriptor=desc)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
            tk.quant_matmul(x, layer, out=out, config=c)
            errs.append(((out.double() - ref).norm() / ref.norm()).item())
        print(f"{shape} M={m} {label(config)}: F=1 {errs[0]:.1e}  F=8 {errs[1]:.1e}  F=8+desc {errs[2]:.1e}",
              flush=True)
