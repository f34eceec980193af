# The paper's loss-vs-step figure (one panel per experiment) and one table per experiment, both
# also logged as artifacts to an experiment-level MLflow summary run. The verbs read what to draw from
# the config (mla/study/reports.py); `params:` holds the same specs, so a new label redraws only these.


rule plot:
    input:
        lambda wc: reports.figure_inputs(config),
    output:
        png=report("results/figures/loss.png", caption="../report/loss.rst", category="Figures"),
        pdf="results/figures/loss.pdf",
    params:
        panels=lambda wc: reports.figure_panels(config),
    log:
        "logs/plot/loss.log",
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} plot --config {CONFIG_FILE} --out results/figures/loss > {log} 2>&1"


rule table:
    input:
        unpack(lambda wc: reports.table_inputs(config, wc.experiment)),
    output:
        csv=report("results/tables/{experiment}.csv", caption="../report/table.rst", category="Tables",
                   labels={"experiment": "{experiment}"}),
        md="results/tables/{experiment}.md",
    params:
        spec=lambda wc: reports.table_spec(config, wc.experiment),
    log:
        "logs/table/{experiment}.log",
    shell:
        "MLA_SNAKEMAKE_RULE={rule} {MLA} table --config {CONFIG_FILE} --study {wildcards.experiment}"
        " --out results/tables/{wildcards.experiment} > {log} 2>&1"
