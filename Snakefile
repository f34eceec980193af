# MHA2MLA reproduction workflow -- table of contents.
#
#   snakemake --cores all                                   # the embedded default (CPU, offline)
#   snakemake --profile workflow/profiles/slurm --configfile configs/paper.yaml   # the paper, on SLURM
#
# Stages (one rule file each): download -> data -> calibrate -> convert -> finetune -> evaluate -> figures.
# Rules only call `mla <verb>`; the science is in the `mla` package. Paths:
#   results/<stage>/<experiment>/<variant>/..., logs/<rule>/<wildcards>.log, benchmarks/<rule>/<wildcards>.tsv

from snakemake.utils import min_version

min_version("9.0")

# config.yaml is the default; a --configfile on the command line replaces it entirely. Several
# --configfile files merge in order, dictionaries key by key (lists are replaced), so an overlay such as
# configs/paper-rehearsal.yaml changes only what it names. --config key=value overrides single keys.
if not workflow.overwrite_configfiles:

    configfile: os.path.join(workflow.basedir, "config.yaml")


include: "workflow/rules/common.smk"


check_config(config)  # schema (with defaults and descriptions) + cross-references; stops before any job

wildcard_constraints:
    model=_alternatives(config["models"]),
    experiment=_alternatives(config["experiments"]),
    variant=_alternatives(v for exp in config["experiments"].values() for v in variants_of(exp)),
    d_kv=_alternatives(d for exp in config["experiments"].values() for d in exp["d_kv"]),


include: "workflow/rules/download.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/convert.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/figures.smk"


report: "workflow/report/workflow.rst"


localrules:
    all,


rule all:
    input:
        all_targets(),
    default_target: True
