"""Quantization recipes (rtn.py, gptq.py, awq.py), the block-by-block driver and calibration sources."""
