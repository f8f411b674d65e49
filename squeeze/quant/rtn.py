"""Transitional re-export (RTN quantization now lives with its format in squeeze.quant.schemes.rtn)."""

from squeeze.quant.schemes.rtn import rtn_quantize

__all__ = ["rtn_quantize"]
