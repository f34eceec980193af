# Text sources -> tokenized, packed token blocks (train / validation), once per tokenizer.


rule data:
    input:
        tokenizer=lambda wc: model_dir(wc.model),
    output:
        directory("results/data/{model}"),
    params:
        args=data_args,
    wildcard_constraints:
        model=_alternatives(root_model(e["model"]) for e in config["experiments"].values()),
    log:
        "logs/data/{model}.log",
    benchmark:
        "benchmarks/data/{model}.tsv"
    threads: 1
    shell:
        "{MLA} data --tokenizer {input.tokenizer} {params.args} --out {output} > {log} 2>&1"
