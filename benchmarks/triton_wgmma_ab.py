"""The triton kernel's Gluon wgmma path (`litquant/kernels/triton_wgmma.py`) against its mma path and bf16 cuBLAS
on the GPU, 4-bit g128 with zero points, at the Llama-2 layer shapes.
Per (dtype, shape, M): every wgmma and mma candidate config of the tuner, each checked against the dequant path
(outputs NaN-poisoned first; the largest relative error is printed) and timed once; then 3 interleaved rounds of
cuBLAS / best mma / best wgmma (CUDA-graph replay over weight copies > 4x L2, half a second of settling), medians.
    python3 benchmarks/triton_wgmma_ab.py [shapes] [ms] [dtypes]"""
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from triton_mma_ab import run  # noqa: E402
import litquant.kernels.triton_kernel as tk  # noqa: E402


def paths(m, n, k):
    """The tuner's mma and wgmma candidates."""
    found = tk.candidate_configs(m, n, k, 4, torch.device("cuda"))
    return {path: [c for c in found if c.path == path] for path in ("mma", "wgmma")}


if __name__ == "__main__":
    run(paths, [256, 1024, 4096])
