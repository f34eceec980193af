# Every fine-tuned checkpoint (and each original model): held-out perplexity, lm-eval accuracy,
# KV-cache bytes, decode speed. One JSON each, also logged to the variant's MLflow run.

# The device is a machine choice, kept out of `params:` (the JSON records device and dtype); `gpu`
# asks the scheduler for one GPU, `cpu` for none.
EVALUATE_DEVICE = "cuda" if config["evaluate"]["device"] == "gpu" else "cpu"


rule evaluate:
    input:
        unpack(evaluate_inputs),
    output:
        "results/evaluate/{experiment}/{variant}/eval.json",
    params:
        args=evaluate_args,
        run=lambda wc: "" if wc.variant == "original" else f"--run-json {finetune_dir(wc.experiment, wc.variant)}/run.json",
    wildcard_constraints:
        variant=_alternatives(["original", *(v for e in config["experiments"].values() for v in variants_of(e))]),
    log:
        "logs/evaluate/{experiment}/{variant}.log",
    benchmark:
        "benchmarks/evaluate/{experiment}/{variant}.tsv"
    threads: 2
    resources:
        gpu=1 if EVALUATE_DEVICE == "cuda" else 0,
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} evaluate --model {input.model} --data {input.data}"
        " --out {output} {params.args} {params.run} --device {EVALUATE_DEVICE} --threads {threads} > {log} 2>&1"
