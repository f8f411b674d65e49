"""Transitional re-exports of the weight formats (now in :mod:`squeeze.quant.schemes`)."""

from squeeze.quant.schemes import LutWeight, QuantizedWeight, RtnWeight
from squeeze.quant.schemes.base import HALF as SCALE_DTYPE
from squeeze.quant.schemes.lut import LUT_DTYPE, Lut8Weight
from squeeze.quant.schemes.rtn import rtn_groups

__all__ = ["LutWeight", "Lut8Weight", "RtnWeight", "QuantizedWeight", "rtn_groups", "LUT_DTYPE", "SCALE_DTYPE"]
