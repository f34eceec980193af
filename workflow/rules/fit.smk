# Layer-wise fitting (`mla fit`, mla/conversion/fit.py): each converted attention layer trained to reproduce
# the original layer's outputs, once per (model, conversion, fit settings); the variants that ask for it
# fine-tune from its output (mla/study/experiments.py).

# The device is a machine choice (calibrate.device, as for the calibration pass), kept out of `params:` so
# that switching it never reruns the science downstream; `gpu` asks the scheduler for one GPU.
FIT_DEVICE = "cuda" if config["calibrate"]["device"] == "gpu" else "cpu"


rule fit:
    input:
        model="results/convert/{model}/{conversion}",
        source=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
    output:
        directory("results/fit/{model}/{conversion}/{fit}"),
    params:
        args=fit_args,
    log:
        "logs/fit/{model}/{conversion}/{fit}.log",
    benchmark:
        "benchmarks/fit/{model}/{conversion}/{fit}.tsv"
    threads: JOB_THREADS
    priority: FIRST
    resources:
        gpu=1 if FIT_DEVICE == "cuda" else 0,
    shell:
        # finished layers wait in a work folder beside the output (mla.conversion.fit.work_folder): a killed
        # job resumes from them
        "OMP_NUM_THREADS={threads} {MLA} fit --model {input.model} --source {input.source} --data {input.data}"
        " --out {output} {params.args} --device {FIT_DEVICE} > {log} 2>&1"
