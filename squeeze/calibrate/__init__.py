"""Calibration: token windows from a CalibrationSpec, and the diagonal Fisher sensitivity of target linears."""

from __future__ import annotations

from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.windows import (
    calibration_windows,
    load_calibration_text,
    sample_windows,
    tokenize_text,
)

__all__ = [
    "calibration_windows",
    "load_calibration_text",
    "sample_windows",
    "tokenize_text",
    "fisher_information",
]
