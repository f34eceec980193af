# Text sources -> tokenized, packed token blocks (train / validation), once per tokenizer. The token budgets
# follow from the experiments (mla.study.budgets); an interrupted job resumes from its last checkpoint on rerun.


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
    threads: 8  # tokenizer processes; capped by --cores locally, set-threads in a cluster profile
    shell:
        "{MLA} data --tokenizer {input.tokenizer} {params.args} --workers {threads} --out {output} > {log} 2>&1"
