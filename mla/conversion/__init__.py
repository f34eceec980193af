"""Conversion, stage by stage: calibration (2-norm scores, covariances), partial RoPE, low-rank
factorisation, the converter itself, and the shape arithmetic that plans it from a config alone."""
