"""Evaluation of a checkpoint: held-out perplexity, lm-eval benchmarks, KV-cache bytes, decode speed.

Modules: `perplexity` (mean loss on token blocks), `harness` (lm-eval: our offline task and the paper's
six Hub tasks), `kv_bytes` (bytes held by the cache after generation vs the formula), `decode`
(tokens/s of original vs MLA over a batch x context grid, beside the predicted S(B,T)), `report`
(one JSON per checkpoint, MLflow logging).
"""
