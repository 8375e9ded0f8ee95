#!/usr/bin/env bash
# Compile-only (CPU machine): the triton mma kernel for sm_90a at one field a dot (F=1) and one chunk a dot (F=8),
# per config: main-loop SASS instructions a thread a chunk, registers, HGMMAs followed by a full wait, and ptxas's
# C7515 serialization advisory. TRITON36=<dir with triton 3.6 installed> selects the device's triton.
#   bash scripts/triton_mma_sass.sh
cd "$(dirname "$0")/.."
py=${TRITON36:+$TRITON36:}.
printf "| config (BMxBN warps stages) | dtype | F | loop instr | registers | waits for all | C7515 |\n|---|---|---|---:|---:|---:|---|\n"
for cfg in "16 128 4 3" "16 64 4 3" "64 128 4 3" "128 128 8 3" "128 256 8 3" "128 128 8 4"; do
  for dtype in bf16 fp16; do
    for f in 1 8; do
      line=$(CONST=FIELDS_PER_DOT=$f DUMP=/tmp/sass_fpd PYTHONPATH=$py python scripts/inspect_triton_mma.py litquant.kernels.triton_programs mma_kernel $cfg $dtype 2>/dev/null | grep "loop instr" | sed 's/loop instr: \([0-9]*\).*/\1/')
      report=$(ptxas -arch=sm_90a -v /tmp/sass_fpd.ptx -o /tmp/sass_fpd.cubin 2>&1)
      regs=$(echo "$report" | sed -n 's/.*Used \([0-9]*\) registers.*/\1/p')
      c7515=$(echo "$report" | grep -q C7515 && echo yes || echo no)
      waits=$(grep -c "WARPGROUP.DEPBAR.LE gsb0, 0x0" /tmp/sass_fpd.sass)
      echo "| $cfg | $dtype | $f | $line | $regs | $waits | $c7515 |"
    done
  done
done
