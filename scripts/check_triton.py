"""Compile-check litquant's Triton kernels for sm_80 and sm_90, and the Gluon wgmma kernel for sm_90, on a machine
without a GPU.

CI runs the kernels under Triton's interpreter, which does not compile them: a kernel that the interpreter runs may
still fail to compile for a GPU (a type the compiler rejects, a layout it cannot lower). This script records the
kernel launches that `litquant.kernels.triton_kernel.launch` makes for every path (gemv, mma, dequant), bit width,
activation dtype, zero points or not, act_order or not and every candidate config of a few M, without running them,
and compiles a covering subset of them (`covering`) for both GPUs with Triton's own compiler. The Gluon kernel of the
wgmma path (`litquant.kernels.triton_wgmma`, sm_90 only, which the interpreter cannot run) is compiled at each of its
tile shapes, bit widths, dtypes, with runs shared out or not, with and without a bias (`wgmma_variants`).

    python scripts/check_triton.py
"""
import os
import sys
import time
from dataclasses import replace

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("check_triton.py compiles the kernels: run it without TRITON_INTERPRET=1")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

import litquant.kernels.triton_kernel as tk
import litquant.kernels.triton_programs as programs
from litquant.formats.common import default_g_idx
from litquant.quantize.quantizer import rtn_quantize

TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))
POINTER_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
                 torch.int64: "*i64", torch.uint8: "*u8"}
KERNELS = ("gemv_kernel", "mma_kernel", "dequant_kernel")


def record_launches():
    """Every distinct (kernel, signature, constexprs, options) that `launch` asks for, without running one."""
    launches = {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def record(*args, num_warps=4, num_stages=3, **kwargs):
                params = self.kernel.params
                values = dict(zip((p.name for p in params), args), **kwargs)
                signature, constexprs = {}, {}
                for p in params:
                    value = values[p.name]
                    if p.is_constexpr or value is None:
                        signature[p.name], constexprs[p.name] = "constexpr", value
                    elif isinstance(value, torch.Tensor):
                        signature[p.name] = POINTER_TYPES[value.dtype]
                    elif isinstance(value, TensorDescriptor):
                        signature[p.name] = (f"tensordesc<{POINTER_TYPES[value.base.dtype][1:]}"
                                             f"{list(value.block_shape)}>")
                    else:
                        signature[p.name] = "i32" if isinstance(value, int) and abs(value) < 2**31 else "fp32"
                key = (self.kernel.fn.__name__, tuple(signature.items()), tuple(map(str, constexprs.items())),
                       num_warps, num_stages)
                launches[key] = (self.kernel, signature, constexprs, num_warps, num_stages)
            return record

    originals = {name: getattr(programs, name) for name in KERNELS}
    for name, kernel in originals.items():
        setattr(programs, name, Recorder(kernel))
    try:
        torch.manual_seed(0)
        k, n = 512, 256
        for bits in tk.SUPPORTED_BITS:
            for dtype in (torch.float16, torch.bfloat16):
                for sym, act_order, group_size in ((True, False, 128), (False, True, 64), (False, False, -1)):
                    qw = rtn_quantize(torch.randn(n, k), bits, group_size, sym)
                    if act_order:
                        qw.g_idx = default_g_idx(k, group_size)[torch.randperm(k)]
                    packed = tk.repack(qw)
                    bias = torch.randn(n, dtype=dtype) if act_order else None
                    for m in (1, 3, 32, 256):
                        x, out = torch.randn(m, k, dtype=dtype), torch.empty(m, n, dtype=dtype)
                        configs = tk.candidate_configs(m, n, k, bits, torch.device("cpu"))
                        # the mma path at one field a dot too (sm_80's default; the CPU device takes sm_90's),
                        # and with x through a TMA descriptor
                        configs += [replace(c, fields_per_dot=1) for c in configs if c.path == "mma"]
                        configs += [replace(c, x_descriptor=True) for c in configs if c.path == "mma"]
                        # the gemv as a programmatic dependent (sm_90 on; the CPU device offers it not)
                        configs += [replace(c, dependent=True) for c in configs if c.path == "gemv"]
                        for config in configs:
                            if config.path != "dequant":  # the dequant path multiplies by cuBLAS: not recorded
                                tk.launch(config, x, packed.qweight, packed.scale_zero, packed.perm, bias,
                                          packed.locks, bits, group_size, out)
                        tk.launch(tk.KernelConfig("dequant"), x, packed.qweight, packed.scale_zero, packed.perm,
                                  bias, packed.locks, bits, group_size, out)
    finally:
        for name, kernel in originals.items():
            setattr(programs, name, kernel)
    return list(launches.values())


def covering(launches):
    """A few of `launches` that still show every kernel at every bit width and activation dtype, and each
    constexpr of a kernel at every value it took (tile sizes, warps and stages included): some 60 compilations
    in place of 700 (the full product took over 20 minutes on two cores)."""
    chosen, seen = [], set()
    for launch in launches:
        kernel, signature, constexprs, num_warps, num_stages = launch
        name = kernel.fn.__name__
        dtype = signature.get("x_ptr", signature.get("w_ptr"))
        features = {(name, "BITS+dtype", constexprs["BITS"], dtype), (name, "warps", num_warps),
                    (name, "stages", num_stages)}
        features |= {(name, key, str(value)) for key, value in constexprs.items()}
        if not features <= seen:
            chosen.append(launch)
            seen |= features
    return chosen


def wgmma_variants():
    """(source, num_warps) of the Gluon wgmma kernel for every tile shape the tuner offers, at 2 and 4 bits, both
    dtypes; runs shared out (split-K and stream-K), a bias and no groups on some, so that each choice is compiled
    at least once."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from litquant.kernels import triton_wgmma

    kernel = triton_wgmma._wgmma_kernel
    pointers = ("scale_zero_ptr", "out_ptr", "partials_ptr", "locks_ptr")
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in pointers + ("N", "K", "stride_om")}
    variants = []
    for bits, dtype, block_m, stages, shared_out, bias, group in (
            (4, "bf16", 128, 4, False, False, 128), (4, "fp16", 64, 4, True, True, -1),
            (4, "bf16", 256, 3, True, False, 256), (4, "fp16", 256, 3, False, True, 128),
            (2, "fp16", 128, 3, True, True, 256), (2, "bf16", 64, 4, False, False, -1)):
        rows = 32 // bits * tk.WORDS_PER_CHUNK
        element = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
        x_layout = gl.NVMMASharedLayout.get_default_for([block_m, rows], element)
        words_layout = gl.NVMMASharedLayout.get_default_for([128, tk.WORDS_PER_CHUNK], gl.int32)
        signature = dict.fromkeys(kernel.arg_names, "i32")  # the sizes, strides and tile numbers
        signature.update({"x_desc": f"tensordesc<{dtype}[{block_m}, {rows}],{x_layout!r}>",
                          "words_desc": f"tensordesc<i32[128, {tk.WORDS_PER_CHUNK}],{words_layout!r}>",
                          "scale_zero_ptr": "*i32", "bias_ptr": f"*{dtype}" if bias else "constexpr",
                          "out_ptr": f"*{dtype}", "partials_ptr": "*fp32", "locks_ptr": "*i32"})
        constexprs = dict(GROUP_SIZE=tk.NO_GROUP if group == -1 else group, BITS=bits, HAS_BIAS=bias,
                          DOT_DTYPE=element, BLOCK_M=block_m, BLOCK_N=128, GROUP_M=8, STAGES=stages,
                          SHARED_OUT=shared_out)
        signature.update({name: "constexpr" for name in constexprs})
        if not bias:
            constexprs["bias_ptr"] = None
        variants.append((GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), 8,
                         f"bits={bits} {dtype} {block_m}x128 stages={stages} shared_out={shared_out} bias={bias} "
                         f"group={group}"))
    return variants


def main() -> int:
    start = time.time()
    recorded = record_launches()
    launches = covering(recorded)
    failures = 0
    for kernel, signature, constexprs, num_warps, num_stages in launches:
        for target in TARGETS:
            if constexprs.get("DEPENDENT") and target.arch < 90:  # griddepcontrol is sm_90 on
                continue
            source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            try:
                triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
            except Exception as e:  # report every failure, then fail
                failures += 1
                shown = {name: value for name, value in constexprs.items() if value is not None}
                print(f"FAILED {kernel.fn.__name__} sm_{target.arch} warps={num_warps} stages={num_stages} "
                      f"{shown}: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
    wgmma = wgmma_variants()
    for source, num_warps, description in wgmma:
        try:
            triton.compile(source, target=TARGETS[1], options={"num_warps": num_warps})
        except Exception as e:
            failures += 1
            print(f"FAILED _wgmma_kernel sm_90 {description}: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
    print(f"check_triton.py: {len(launches)} of {len(recorded)} kernel variants x {len(TARGETS)} GPUs and "
          f"{len(wgmma)} Gluon wgmma variants (sm_90) compiled, {failures} failed ({time.time() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
