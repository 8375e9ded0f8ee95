"""Kernels inside torch.compile: the custom-op helper, the triton op's registration, and compiled == eager.

On the CPU the compile tests use backend="aot_eager" (Dynamo + AOTAutograd with the fake implementations, without
Inductor's slow C++ build), with the triton kernel in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported). The GPU test compiles as `litquant generate --compile` does
(`compile_options`: Inductor, CUDA graphs and, on Hopper, Inductor's kernels as programmatic dependents).
"""
import pytest
import torch
from torch import nn

from litquant.generate import compile_options
from litquant.kernels import kernel_class
from litquant.kernels.base import LayerSpec
from litquant.kernels.ops import quant_linear_op
from litquant.quantize.quantizer import rtn_quantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TwoLayerMLP(nn.Module):
    """down(silu(up(x))) with both Linears quantized (RTN 4-bit) and served by one kernel; with `act_order`, each
    weight's input rows in a shuffled order, as GPTQ's desc_act leaves them (the kernels then permute x)."""

    def __init__(self, kernel: str, dtype: torch.dtype, k: int = 128, hidden: int = 96, group_size: int = 32,
                 device: torch.device = DEVICE, act_order: bool = False) -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(0)
        layers = []
        for n_in, n_out in ((k, hidden), (hidden, k)):
            qw = rtn_quantize(torch.randn(n_out, n_in, generator=gen, device=device) * 0.1, 4, group_size, sym=False,
                              bias=torch.randn(n_out, generator=gen, device=device))
            if act_order:
                order = torch.randperm(n_in, generator=gen, device=device)
                qw.codes, qw.g_idx = qw.codes[order], qw.g_idx[order]
                assert qw.act_order
            spec = LayerSpec(n_in, n_out, 4, group_size, qw.sym, qw.act_order)
            layer = kernel_class(kernel)(n_in, n_out, True, spec, dtype)
            layer.load_quantized(qw)
            layers.append(layer)
        self.up, self.down = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


def test_quant_linear_op_needs_x_and_out_features():
    def no_width(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    with pytest.raises(TypeError, match=r"litquant_test::no_width: .* no_width lacks \['out_features'\]"):
        quant_linear_op("litquant_test::no_width")(no_width)


def test_triton_op_is_registered_with_a_fake():
    from litquant.kernels import triton_kernel

    model = TwoLayerMLP("triton", torch.float16)
    up = model.up
    x = torch.randn(3, 5, 128, device=DEVICE, dtype=torch.float16)
    args = (x, up.qweight, up.scale_zero, up.perm, up.bias, up.locks, 4, 32, up.out_features)
    torch.library.opcheck(triton_kernel.triton_quant_linear, args)  # schema, fake tensor and AOT dispatch checks
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.ops.litquant.triton_quant_linear(*meta)
    assert out.shape == (3, 5, 96) and out.dtype == torch.float16 and out.device.type == "meta"


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("dtype, act_order", [(torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16", "fp16-act-order"])
def test_compiled_matches_eager(kernel, dtype, act_order):
    model = TwoLayerMLP(kernel, dtype, act_order=act_order)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break at the op
    for shape in ((1, 1, 128), (2, 7, 128)):
        x = torch.randn(shape, device=DEVICE, dtype=dtype)
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton", "marlin"])
def test_reduce_overhead_compile_gpu(kernel):
    """Inductor + CUDA graphs: decode-shaped calls replay a captured graph and match eager. Each call has new
    inputs, so a kernel launched early (a programmatic dependent) that read its input before the kernel ahead had
    written it would miss by far more than the bound."""
    model = TwoLayerMLP(kernel, torch.bfloat16, k=4096, hidden=11008, group_size=128)
    compiled = torch.compile(model, options=compile_options(), fullgraph=True)
    for _ in range(8):  # warm-up, record, then replays
        x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
        out = compiled(x).float()
        ref = model(x).float()  # Inductor fuses the torch kernel's dequantization: bf16 rounding differs
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2
