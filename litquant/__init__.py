"""litquant: GPTQ, AWQ and RTN weight quantization and fast quantized-inference kernels for LitGPT."""

__version__ = "0.1.0"
