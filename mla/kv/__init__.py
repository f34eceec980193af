"""The KV cache, counted and measured: elements and bytes predicted from a config (`accounting`), bytes
held by a real cache after `generate` (`measure_bytes`), and held-out loss decoded against a quantized
cache (`quantized`). The MLA cache classes live in mla/modeling/cache_mla.py, copied into every
checkpoint; the original models' quantized cache (optimum-quanto's procedure in torch) in `quanto_torch`."""
