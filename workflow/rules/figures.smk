# The paper's loss-vs-step figure (one panel per experiment) and one table per experiment, both
# also logged as artifacts to an experiment-level MLflow summary run.


rule plot:
    input:
        plot_inputs,
    output:
        png=report("results/figures/loss.png", caption="../report/loss.rst", category="Figures"),
        pdf="results/figures/loss.pdf",
    params:
        args=plot_args,
    log:
        "logs/plot/loss.log",
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} plot --out results/figures/loss {params.args}"
        " --tracking-uri {TRACKING_URI:q} --experiment {MLFLOW_EXPERIMENT:q} > {log} 2>&1"


rule table:
    input:
        unpack(table_inputs),
    output:
        csv=report("results/tables/{experiment}.csv", caption="../report/table.rst", category="Tables",
                   labels={"experiment": "{experiment}"}),
        md="results/tables/{experiment}.md",
    params:
        args=table_args,
    log:
        "logs/table/{experiment}.log",
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} table --out results/tables/{wildcards.experiment} {params.args}"
        " --tracking-uri {TRACKING_URI:q} --experiment {MLFLOW_EXPERIMENT:q} --study {wildcards.experiment} > {log} 2>&1"
