"""On-disk formats of quantized Linear weights, and the format-neutral `QuantizedWeight`.

Every recipe (RTN, GPTQ, AWQ) produces a `QuantizedWeight`; every format packs one into the
tensors of its public spec and unpacks them back; every kernel repacks one into its own layout.
Pure, vectorized torch: these functions run on the CPU or on the GPU, wherever the tensors are.
"""
from litquant.formats.common import QuantizedWeight, pack_along_rows, unpack_along_rows
from litquant.formats import awq, gptq

__all__ = ["QuantizedWeight", "pack_along_rows", "unpack_along_rows", "gptq", "awq"]
