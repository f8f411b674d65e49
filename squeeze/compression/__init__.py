"""The compress pipeline: preflight checks, then calibration -> Fisher -> quantization -> sealed artifact."""
