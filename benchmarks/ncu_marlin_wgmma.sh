#!/usr/bin/env bash
# ncu of marlin's wgmma kernel against triton's Gluon wgmma kernel on the same 256 x 128 tiles, one a block:
# 7B-down (K 11008, N 4096) at M = 1024, bf16, 4-bit g128 zero points, 128 tiles on an H200's 132 SMs (marlin's
# plan runs them whole, one round). On the GPU machine, after the wheels are installed and PYTHONPATH set; writes
# $OUT/ncu.log. ncu locks the SM clock (~1.3 GHz).
#   bash benchmarks/ncu_marlin_wgmma.sh
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section SchedulerStats --section LaunchStats --section Occupancy"
COMMON="
import sys; sys.path.insert(0, 'benchmarks')
import torch, litquant.kernels.triton_kernel as tk
from kernels import SHAPES, build_litquant
k, n = SHAPES['7B-down']
x = torch.randn(1024, k, device='cuda', dtype=torch.bfloat16)"
MARLIN="$COMMON
layer = build_litquant('marlin', k, n, 4, 128, torch.bfloat16, torch.device('cuda'), seed=0)
for _ in range(4): torch.ops.litquant_marlin.gemm(x, layer.qweight, layer.scales, layer.zeros, None, layer.locks, 128)
torch.cuda.synchronize()"
TRITON="$COMMON
layer = build_litquant('triton', k, n, 4, 128, torch.bfloat16, torch.device('cuda'), seed=0)
w = tk.PackedWeight(layer.qweight, layer.scale_zero, layer.perm, layer.locks, 4, 128)
config = tk.KernelConfig('wgmma', block_n=128, block_m=256, split_k=1, num_warps=8, num_stages=3)
for _ in range(4): tk.quant_matmul(x, w, config=config)
torch.cuda.synchronize()"
{
  echo "######## marlin wgmma 7B-down M=1024 bf16 (256 x 128 tiles, whole)"
  timeout 100 ncu --kernel-name regex:marlin_wgmma --launch-skip 2 --launch-count 1 $S python3 -c "$MARLIN" 2>&1
  echo "######## triton wgmma 7B-down M=1024 bf16 (256 x 128 tiles, 3 stages)"
  timeout 100 ncu --kernel-name regex:_wgmma_kernel --launch-skip 2 --launch-count 1 $S python3 -c "$TRITON" 2>&1
} | grep -v "^==PROF==\|WARNING" > "$OUT/ncu.log"
grep -n "########\|Duration\|Executed Ipc\|Issue Slots\|Warp Cycles Per Issued\|Executed Instructions  \|Registers Per\|No Eligible\|Compute (SM)" "$OUT/ncu.log" | head -60
