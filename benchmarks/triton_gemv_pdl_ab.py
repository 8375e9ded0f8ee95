"""The triton kernel's gemv path launched plainly and as a programmatic dependent (`KernelConfig.dependent`: the
first chunks' weights are asked of L2 and the launch of the next kernel allowed before it waits for the kernel
ahead), against bf16 cuBLAS, 4-bit g128 with zero points, at the Llama-2 layer shapes.
Per (dtype, shape, M): every gemv candidate config of the tuner both ways, each checked against the dequant path
(outputs NaN-poisoned first) and timed once; then 3 interleaved rounds of cuBLAS and the best of each (CUDA-graph
replay of back-to-back calls over weight copies > 4x L2), medians.
    python3 benchmarks/triton_gemv_pdl_ab.py [shapes] [ms] [dtypes]"""
import dataclasses
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from triton_mma_ab import run  # noqa: E402
import litquant.kernels.triton_kernel as tk  # noqa: E402


def launches(m, n, k):
    """The tuner's gemv candidates, plain and dependent."""
    gemv = [c for c in tk.candidate_configs(m, n, k, 4, torch.device("cuda")) if c.path == "gemv" and not c.dependent]
    return {"plain": gemv, "dependent": [dataclasses.replace(c, dependent=True) for c in gemv]}


if __name__ == "__main__":
    run(launches, [1, 2, 4])
