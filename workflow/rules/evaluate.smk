# The data the evaluations need (MMLU wheel, the paper's lm-eval tasks, LongBench), fetched on the submitting host.
rule evaluation_data:
    output:
        PREFETCH_MANIFEST,
    params:
        args=prefetch_args(),
    log:
        "logs/evaluation_data/prefetch.log",
    shell:
        "{MLA} prefetch --out results/evaluation-data {params.args} > {log} 2>&1"


# Every fine-tuned checkpoint (and each original model), in two jobs that never rerun each other
# (mla/study/evaluation_jobs.py): quality -> eval.json (KV bytes, held-out perplexity, the local task,
# the paper's tasks, MMLU, pass keys with the full cache) and inference -> inference.json (quantized
# caches, pass keys with them, LongBench, decode speed). Each also logs to the variant's MLflow run.

# The device is a machine choice, kept out of `params:` (the JSON records device and dtype); `gpu`
# asks the scheduler for one GPU, `cpu` for none. `mla evaluate` reads it from the config.
EVALUATE_GPUS = 1 if config["evaluate"]["device"] == "gpu" else 0


rule evaluate:
    input:
        model="results/finetune/{model}/{start}/{recipe}/final",
        run="results/finetune/{model}/{start}/{recipe}/run.json",
        data=lambda wc: data_dir(wc.model),
        **prefetch_inputs("quality"),
    output:
        "results/evaluate/{model}/{start}/{recipe}/eval.json",
    params:
        settings=evaluation_settings("quality"),
    log:
        "logs/evaluate/{model}/{start}/{recipe}.log",
    benchmark:
        "benchmarks/evaluate/{model}/{start}/{recipe}.tsv"
    threads: JOB_THREADS
    priority: LAST
    resources:
        gpu=EVALUATE_GPUS,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {EVALUATE_ENV} {MLA} evaluate --config {CONFIG_FILE} --part quality"
        " --model-name {wildcards.model} --model {input.model} --data {input.data} --out {output}"
        " --variant {wildcards.start} --run-json {input.run} --threads {threads} > {log} 2>&1"


# The original model, once per model whatever the number of experiments: its own MLflow run.
rule evaluate_original:
    input:
        model=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
        **prefetch_inputs("quality"),
    output:
        "results/evaluate/{model}/original/eval.json",
    params:
        settings=evaluation_settings("quality"),
    log:
        "logs/evaluate/{model}/original.log",
    benchmark:
        "benchmarks/evaluate/{model}/original.tsv"
    threads: JOB_THREADS
    priority: LAST
    resources:
        gpu=EVALUATE_GPUS,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {EVALUATE_ENV} {MLA} evaluate --config {CONFIG_FILE} --part quality"
        " --model-name {wildcards.model} --model {input.model} --data {input.data} --out {output}"
        " --variant original --run-name {wildcards.model}/original --threads {threads} > {log} 2>&1"


rule evaluate_inference:
    input:
        model="results/finetune/{model}/{start}/{recipe}/final",
        run="results/finetune/{model}/{start}/{recipe}/run.json",
        data=lambda wc: data_dir(wc.model),
        **prefetch_inputs("inference"),
    output:
        "results/evaluate/{model}/{start}/{recipe}/inference.json",
    params:
        settings=evaluation_settings("inference"),
    log:
        "logs/evaluate_inference/{model}/{start}/{recipe}.log",
    benchmark:
        "benchmarks/evaluate_inference/{model}/{start}/{recipe}.tsv"
    threads: JOB_THREADS
    priority: LAST
    resources:
        gpu=EVALUATE_GPUS,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {EVALUATE_ENV} {MLA} evaluate --config {CONFIG_FILE} --part inference"
        " --model-name {wildcards.model} --model {input.model} --data {input.data} --out {output}"
        " --variant {wildcards.start} --run-json {input.run} --threads {threads} > {log} 2>&1"


rule evaluate_inference_original:
    input:
        model=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
        **prefetch_inputs("inference"),
    output:
        "results/evaluate/{model}/original/inference.json",
    params:
        settings=evaluation_settings("inference"),
    log:
        "logs/evaluate_inference/{model}/original.log",
    benchmark:
        "benchmarks/evaluate_inference/{model}/original.tsv"
    threads: JOB_THREADS
    priority: LAST
    resources:
        gpu=EVALUATE_GPUS,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {EVALUATE_ENV} {MLA} evaluate --config {CONFIG_FILE} --part inference"
        " --model-name {wildcards.model} --model {input.model} --data {input.data} --out {output}"
        " --variant original --run-name {wildcards.model}/original --threads {threads} > {log} 2>&1"
