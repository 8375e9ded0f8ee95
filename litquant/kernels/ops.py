"""Helpers to expose a kernel as a `torch.library` custom op, so `torch.compile` and CUDA graphs trace through it.

A quantized Linear kernel is a function `fn(x, <packed tensors...>, ..., out_features: int) -> Tensor` that returns
a new tensor of shape `[*x.shape[:-1], out_features]` in `x.dtype`. `quant_linear_op` registers such a function as
an opaque custom op and gives it the matching fake (meta) implementation, which is all that Dynamo, AOTAutograd and
Inductor need to place it in a graph: the op itself then runs eagerly inside the compiled graph, and inside a CUDA
graph when the op only launches kernels and allocates through PyTorch.
"""
import inspect
from typing import Callable

import torch


def quant_linear_op(qualname: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: register `fn` as the custom op `qualname` ("namespace::name"), with a fake implementation.

    `fn` must be fully type-annotated (the schema is inferred from the annotations), must not mutate its inputs,
    and must take the activation as a parameter named `x` and the output width as an `int` parameter named
    `out_features`.
    """

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        signature = inspect.signature(fn)
        missing = {"x", "out_features"} - set(signature.parameters)
        if missing:
            raise TypeError(f"{qualname}: a quantized-linear op needs parameters named 'x' and 'out_features', "
                            f"{fn.__name__} lacks {sorted(missing)}")
        op = torch.library.custom_op(qualname, mutates_args=())(fn)

        @op.register_fake
        def _fake(*args, **kwargs) -> torch.Tensor:
            bound = signature.bind(*args, **kwargs).arguments
            x = bound["x"]
            return x.new_empty((*x.shape[:-1], bound["out_features"]))

        return op

    return register
