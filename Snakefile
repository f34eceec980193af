# MHA2MLA reproduction workflow -- table of contents.
#
#   snakemake --cores all                                   # the embedded default (CPU, offline)
#   snakemake --profile workflow/profiles/slurm --configfile configs/paper.yaml   # the paper, on SLURM
#
#   snakemake --cores all inference                         # + the inference measurements (evaluate.inference: all)
#
# Stages (one rule file each): download -> data -> calibrate -> convert [-> fit] -> finetune -> evaluate [-> serve]
# -> figures.
# Rules only call `mla <verb>`; the science is in the `mla` package. Paths (mla/study/experiments.py):
#   results/convert/<model>/<conversion>, results/fit/<model>/<conversion>/<fit>,
#   results/finetune/<model>/<start>/<recipe>/...,
#   results/evaluate/<model>/{original,<start>/<recipe>}/{eval,inference}.json, results/tables/<experiment>.*,
#   with evaluate.serve: results/export/<model>/<start>/<recipe>, results/evaluate/.../serve.json,
#   logs/<rule>/<wildcards>.log, benchmarks/<rule>/<wildcards>.tsv

from snakemake.utils import min_version

min_version("9.0")

# config.yaml is the default; a --configfile on the command line replaces it entirely. Several
# --configfile files merge in order, dictionaries key by key (lists are replaced), so an overlay such as
# configs/paper-rehearsal.yaml changes only what it names. --config key=value overrides single keys.
# (Snakemake 9's --replace-workflow-config is not enough: under a bare --config key=value it drops
# config.yaml too, so the workflow asks `workflow.overwrite_configfiles`, the --configfile list.)
if not workflow.overwrite_configfiles:

    configfile: os.path.join(workflow.basedir, "config.yaml")


include: "workflow/rules/common.smk"


# a Hub token, where one is set, reaches cluster jobs; offline runs have none (Snakemake refuses unset envvars)
if "HF_TOKEN" in os.environ:

    envvars:
        "HF_TOKEN",


check_config(config)  # schema (with defaults and descriptions) + cross-references; stops before any job
# The validated config as the verbs read it (`mla evaluate|table|plot --config {CONFIG_FILE}`): named after its
# content and written once, it is neither an input nor a param, so it reruns nothing (mla/study/config_file.py).
CONFIG_FILE = config_file.write(config)
# Every variant and the jobs it needs, keyed by what they compute (mla/study/experiments.py): a conversion or a
# training run that several variants or experiments share is one job.
STUDY = experiments.Study(config)

wildcard_constraints:
    model=_alternatives(config["models"]),
    experiment=_alternatives(config["experiments"]),
    conversion=_alternatives(c for _, c in STUDY.conversions()),
    start=_alternatives(["baseline", *(c for _, c in STUDY.conversions()), *(s for _, s in STUDY.starts())]),
    fit=_alternatives(f for _, _, f in STUDY.fits()),
    recipe=_alternatives(r for _, _, r in STUDY.runs()),


include: "workflow/rules/download.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/convert.smk"
include: "workflow/rules/fit.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/figures.smk"


report: "workflow/report/workflow.rst"


# small bookkeeping rules run on the submitting host, never as cluster jobs
localrules:
    all,
    inference,
    plot,
    table,
    evaluation_data,


rule all:
    input:
        STUDY.targets(),
    default_target: True


# the inference measurements of every checkpoint (decode speed, quantized caches, LongBench; with evaluate.serve
# vLLM on each ladder variant's export), on request; `all` includes them, and the tables show them, when
# evaluate.inference is true
rule inference:
    input:
        STUDY.inference_targets(),
