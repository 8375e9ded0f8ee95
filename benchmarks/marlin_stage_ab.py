"""A/B of builds of the marlin kernel in one process: this tree's (`new`, `litquant_marlin`) against other source
folders' (`old0`, `old1`, ...: each built under the op namespace `litquant_marlin_old<i>`), with cuBLAS alongside:

    python3 benchmarks/marlin_stage_ab.py <old litquant/csrc/marlin folder>[,<another>...] [shapes] [ms] [dtypes]

A shape is a name from `kernels.SHAPES` or K x N written as `4096x4096`.

An old folder is a copy of litquant/csrc/marlin at another commit, inside the tree so that it travels to the GPU
machine (before session 75 the folder was csrc/marlin):
    mkdir -p ab/old && for f in $(git ls-tree --name-only REV litquant/csrc/marlin/); do
      git show REV:$f > ab/old/${f##*/}; done

Each cell is checked first: every build's output (NaN-poisoned) against the dequantized weight times x in fp32.
Then all are timed with `kernels.alternate` (all graphs replayed in turn, at one clock; medians in us a call).
That measures cycles at a clock the builds share, not energy: under the power cap, which marlin reaches from M = 16
on, a build that needs less energy a call runs at a higher clock alone. `AB_ALONE=1` also times each build alone,
after 1 s of its own calls, with its SM clock, power and energy a call (benchmarks/power.py;
results/2026-12-05-power-cap.md).
With `LITQUANT_CUDA_ARCH=8.0` every build is the Ampere code (litquant/kernels/build.py), which A/Bs the mma.sync
kernel on a Hopper (old folders from 2141ca5 on: older sources do not take the Ampere paths there)."""
import math
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from kernels import L2_MULTIPLE, SHAPES, alternate, build_litquant, build_peer  # noqa: E402
from power import sample_forever, timed_window  # noqa: E402
from litquant.kernels import build  # noqa: E402

old_folders = [Path(f) for f in sys.argv[1].split(",")]
shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
ms = [int(m) for m in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64, 128, 256, 512, 1024]
dtypes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["bf16", "fp16"]
dev = torch.device("cuda")
alone = os.environ.get("AB_ALONE") == "1"
if alone:
    threading.Thread(target=sample_forever, daemon=True).start()

build.load("marlin")
ops = {"new": torch.ops.litquant_marlin}
for i, folder in enumerate(old_folders):
    name, work = f"litquant_marlin_old{i}", Path(tempfile.mkdtemp())
    for f in folder.iterdir():
        text = f.read_text()
        if f.suffix == ".cpp":  # the same ops under another namespace
            text = text.replace("TORCH_LIBRARY(litquant_marlin,", f"TORCH_LIBRARY({name},")
            text = text.replace("TORCH_LIBRARY_IMPL(litquant_marlin,", f"TORCH_LIBRARY_IMPL({name},")
        (work / f.name).write_text(text)
    load(name=name, sources=[str(f) for f in work.iterdir() if f.suffix in (".cu", ".cpp")],
         build_directory=str(work), extra_cflags=["-O3"],
         extra_cuda_cflags=build.nvcc_flags(torch.cuda.get_device_capability(), build.built_capability()),
         is_python_module=False)
    ops[f"old{i}"] = getattr(torch.ops, name)
print(f"# {torch.cuda.get_device_name()}, 4-bit g128 zero points; "
      + ", ".join(f"old{i} = {f}" for i, f in enumerate(old_folders)), flush=True)


def fused(module, op):
    locks = module.locks_for(max(ms))  # enough for the fused kernel at every M timed

    def call(x, out=None):
        out = torch.empty(x.shape[0], module.out_features, dtype=x.dtype, device=x.device) if out is None else out
        op.gemm_out(x, module.qweight, module.scales, module.zeros, None, locks, module.group_size, out)
        return out
    return call


for dtype_name in dtypes:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    for shape in shapes:
        k, n = SHAPES[shape] if shape in SHAPES else map(int, shape.split("x"))
        copies = max(1, math.ceil(L2_MULTIPLE * torch.cuda.get_device_properties(dev).L2_cache_size / (k * n // 2)))
        modules = [build_litquant("marlin", k, n, 4, 128, dtype, dev, seed=s) for s in range(copies)]
        cublas = [build_peer("cublas", k, n, dtype, dev, seed=s) for s in range(copies)]
        dense = torch.empty(k, n, dtype=dtype, device=dev)
        ops["new"].dequant_out(modules[0].qweight, modules[0].scales, modules[0].zeros, modules[0].group_size, dense)
        for m in ms:
            x = torch.randn(m, k, dtype=dtype, device=dev)
            ref = x.float() @ dense.float()
            errors = []
            for name, op in ops.items():
                out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
                fused(modules[0], op)(x, out)
                errors.append(f"{name} {((out.float() - ref).norm() / ref.norm()).item():.1e}")
            variants = {name: [fused(mod, op) for mod in modules] for name, op in ops.items()}
            variants["cublas"] = cublas
            times = alternate(variants, x)
            print(f"{dtype_name} {shape:8s} M={m:5d}  cublas {times['cublas']:7.1f} us  "
                  + "  ".join(f"{name} {times[name]:7.1f} ({times['cublas'] / times[name]:.2f}x)" for name in ops)
                  + "   new/" + ", new/".join(f"{name} {times['new'] / times[name]:.3f}" for name in ops if name != "new")
                  + f"   err {', '.join(errors)}", flush=True)
            if alone:
                for name, fns in variants.items():
                    print(f"    {name:>6} alone, settled: {timed_window(fns, x, idle_s=0.0, settle_s=1.0)}",
                          flush=True)
