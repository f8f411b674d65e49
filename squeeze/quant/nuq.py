"""Transitional re-export (SqueezeLLM quantization now lives with its format in squeeze.quant.schemes.lut)."""

from squeeze.quant.schemes.lut import affine_lut8, quantize_lut

__all__ = ["quantize_lut", "affine_lut8"]
