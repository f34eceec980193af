"""Conversion, stage by stage: calibration (2-norm scores, covariances), partial RoPE, low-rank
factorisation, the converter itself, what a converted layer caches (`layout`) and layer-wise fitting
(`fit`). The shape arithmetic on a config alone is mla.shapes, shared with the other stages."""
