"""Compile a triton mma-path kernel for sm_90 on the CPU machine (real-launch divisibility hints) and report:
wgmma count and wait pendings in the TTGIR, layout conversions, registers, and the SASS instruction mix of the
main loop. Usage: python scripts/inspect_triton_mma.py MODULE KERNEL BLOCK_M BLOCK_N WARPS STAGES [DTYPE]"""
import collections
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

mod = importlib.import_module(sys.argv[1])
kernel = getattr(mod, sys.argv[2])
bm, bn, warps, stages = map(int, sys.argv[3:7])
dtype = sys.argv[7] if len(sys.argv) > 7 else "bf16"
ptr = {"scale_zero_ptr": "*i32", "x_ptr": f"*{dtype}", "qweight_ptr": "*i32", "perm_ptr": "*i32",
       "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "partials_ptr": "*fp32", "locks_ptr": "*i32"}
extra = dict(kv.split("=") for kv in os.environ.get("CONST", "").split(",") if kv)
signature, constexprs, attrs = {}, {}, {}
tld = {"bf16": tl.bfloat16, "fp16": tl.float16}[dtype]
defaults = dict(GROUP_SIZE=128, BITS=4, GROUP_PER_CHUNK=True, HAS_PERM=False, HAS_BIAS=False,
                FINAL=True, DOT_DTYPE=tld, DOT_PRECISION="tf32", PAIRS=True, EVEN=True, X_DESCRIPTOR=False,
                WAIT_FOR_WGMMAS=True, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, WORDS=16)
for i, name in enumerate(kernel.arg_names):
    p = kernel.params[i]
    if p.is_constexpr:
        v = extra.get(name, defaults.get(name))
        if isinstance(v, str):
            v = int(v) if v.lstrip("-").isdigit() else (v == "True" if v in ("True", "False") else v)
        signature[name], constexprs[name] = "constexpr", v
    elif (name == "perm_ptr" and extra.get("HAS_PERM") != "True") or name == "bias_ptr":
        signature[name], constexprs[name] = "constexpr", None
    elif name == "x_desc" or (name == "x_ptr" and extra.get("X_DESCRIPTOR") == "True"):
        signature[name] = f"tensordesc<{dtype}[{bm}, {os.environ.get('DESC_K', '16')}]>"
    elif name in ptr:
        signature[name] = ptr[name]
        attrs[(i,)] = [["tt.divisibility", 16]]
    else:
        signature[name] = "i32"
        if name != "M":
            attrs[(i,)] = [["tt.divisibility", 16]]
src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", int(os.environ.get("ARCH", "90")), 32),
                  options={"num_warps": warps, "num_stages": stages})
ttgir = k.asm["ttgir"]
print("wgmma:", ttgir.count("warp_group_dot "), "waits:", re.findall(r"warp_group_dot_wait.*pendings = (\d+)", ttgir),
      "convert_layout:", ttgir.count("convert_layout"), "local_alloc:", ttgir.count("local_alloc"),
      "smem:", k.metadata.shared)
out = os.environ.get("DUMP")
if out:
    for ext in ("ttgir", "ptx"):
        open(f"{out}.{ext}", "w").write(k.asm[ext])
nvdisasm = shutil.which("nvdisasm") or os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(k.asm["cubin"]); f.flush()
    sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
if out:
    open(f"{out}.sass", "w").write(sass)
# main loop: the backward branch whose body holds the most HGMMA
lines = sass.splitlines()
labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", l.strip()))}
best = None
for i, l in enumerate(lines):
    m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        body = [x for x in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
        n = sum("HGMMA" in x for x in body)
        if best is None or n > best[0]:
            best = (n, body)
if best:
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", x).group(1) for x in best[1]
                              if re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", x))
    print("loop instr:", len(best[1]), dict(ops.most_common(14)))
