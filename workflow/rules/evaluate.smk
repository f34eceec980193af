# Every fine-tuned checkpoint (and each original model): held-out perplexity, lm-eval accuracy,
# KV-cache bytes, decode speed. One JSON each, also logged to the variant's MLflow run.


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
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} evaluate --model {input.model} --data {input.data}"
        " --out {output} {params.args} {params.run} --threads {threads} > {log} 2>&1"
