#!/usr/bin/env bash
# ncu of triton's Gluon wgmma kernel against cuBLAS on 7B-up at M = 256, bf16, 4-bit g128 zero points (on the GPU
# machine, after the wheels are installed and PYTHONPATH set; writes $OUT/ncu.log). ncu locks the SM clock (~1.3 GHz),
# so durations are longer than the benchmark's; what matters is the tensor pipe's share and the L2 and shared-memory
# throughput. The triton layer runs one fixed config (128 x 128 tiles, 4 stages, no split: the tuner's pick), so no
# tuning launch is profiled.
#   bash benchmarks/ncu_triton_m256.sh
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats"
TRITON="
import sys; sys.path.insert(0, 'benchmarks')
import torch, litquant.kernels.triton_kernel as tk
from kernels import SHAPES, build_litquant
k, n = SHAPES['7B-up']
layer = build_litquant('triton', k, n, 4, 128, torch.bfloat16, torch.device('cuda'), seed=0)
w = tk.PackedWeight(layer.qweight, layer.scale_zero, layer.perm, layer.locks, 4, 128)
config = tk.KernelConfig('wgmma', block_n=128, block_m=128, split_k=1, num_warps=8, num_stages=4)
x = torch.randn(256, k, device='cuda', dtype=torch.bfloat16)
for _ in range(4): tk.quant_matmul(x, w, config=config)
torch.cuda.synchronize()"
CUBLAS="
import torch, torch.nn.functional as F
x = torch.randn(256, 4096, device='cuda', dtype=torch.bfloat16); w = torch.randn(22016, 4096, device='cuda', dtype=torch.bfloat16)
for _ in range(6): F.linear(x, w)
torch.cuda.synchronize()"
{
  echo "######## triton wgmma 7B-up M=256 bf16 (128 x 128, 4 stages)"
  timeout 100 ncu --kernel-name regex:_wgmma_kernel --launch-skip 2 --launch-count 1 $S python3 -c "$TRITON" 2>&1
  echo "######## cublas 7B-up M=256 bf16"
  timeout 80 ncu --kernel-name regex:'nvjet|sm90|cutlass|gemm' --launch-skip 3 --launch-count 1 $S python3 -c "$CUBLAS" 2>&1
} | grep -v "^==PROF==\|WARNING" > "$OUT/ncu.log"
grep -n "########\|Duration\|Tensor\|L2 Cache Throughput\|L1/TEX Cache Throughput\|DRAM Throughput\|Shared\|Registers Per\|Stall\|Warp Cycles Per Issued\|Issue Slots\|Memory Throughput\|Compute (SM)\|lts__\|Mem Pipes\|Max Bandwidth" "$OUT/ncu.log" | head -90
