# The paper's loss-vs-step figure (one panel per experiment) and one table per experiment, both
# also logged as artifacts to an experiment-level MLflow summary run.


rule plot:
    input:
        [f"{finetune_dir(e, v)}/metrics.csv" for e, exp in config["experiments"].items() for v in variants_of(exp)],
    output:
        png=report("results/figures/loss.png", caption="../report/loss.rst", category="Figures"),
        pdf="results/figures/loss.pdf",
    params:
        args=plot_args,
        mlflow=mlflow_summary_args(),
    log:
        "logs/plot/loss.log",
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} plot --out results/figures/loss {params.args} {params.mlflow} > {log} 2>&1"


rule table:
    input:
        unpack(table_inputs),
    output:
        csv=report("results/tables/{experiment}.csv", caption="../report/table.rst", category="Tables",
                   labels={"experiment": "{experiment}"}),
        md="results/tables/{experiment}.md",
    params:
        args=table_args,
        mlflow=mlflow_summary_args(),
    log:
        "logs/table/{experiment}.log",
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} table --out results/tables/{wildcards.experiment} {params.args}"
        " {params.mlflow} > {log} 2>&1"
