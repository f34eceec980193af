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


# Every fine-tuned checkpoint (and each original model): held-out perplexity, lm-eval accuracy,
# KV-cache bytes, decode speed. One JSON each, also logged to the variant's MLflow run.

# The device is a machine choice, kept out of `params:` (the JSON records device and dtype); `gpu`
# asks the scheduler for one GPU, `cpu` for none.
EVALUATE_DEVICE = "cuda" if config["evaluate"]["device"] == "gpu" else "cpu"


rule evaluate:
    input:
        model="results/finetune/{model}/{start}/{recipe}/final",
        run="results/finetune/{model}/{start}/{recipe}/run.json",
        data=lambda wc: data_dir(wc.model),
        **prefetch_inputs(None),
    output:
        "results/evaluate/{model}/{start}/{recipe}/eval.json",
    params:
        args=evaluate_args,
    log:
        "logs/evaluate/{model}/{start}/{recipe}.log",
    benchmark:
        "benchmarks/evaluate/{model}/{start}/{recipe}.tsv"
    threads: 2
    resources:
        gpu=1 if EVALUATE_DEVICE == "cuda" else 0,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {EVALUATE_ENV} {MLA} evaluate --model {input.model} --data {input.data} --out {output}"
        " --variant {wildcards.start} {params.args} --tracking-uri {TRACKING_URI:q} --run-json {input.run}"
        " --device {EVALUATE_DEVICE} --threads {threads} > {log} 2>&1"


# The original model, once per model whatever the number of experiments: its own MLflow run.
rule evaluate_original:
    input:
        model=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
        **prefetch_inputs(None),
    output:
        "results/evaluate/{model}/original/eval.json",
    params:
        args=evaluate_args,
    log:
        "logs/evaluate/{model}/original.log",
    benchmark:
        "benchmarks/evaluate/{model}/original.tsv"
    threads: 2
    resources:
        gpu=1 if EVALUATE_DEVICE == "cuda" else 0,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {EVALUATE_ENV} {MLA} evaluate --model {input.model} --data {input.data} --out {output}"
        " --variant original {params.args} --tracking-uri {TRACKING_URI:q} --experiment {MLFLOW_EXPERIMENT:q}"
        " --run-name {wildcards.model}/original --device {EVALUATE_DEVICE} --threads {threads} > {log} 2>&1"
