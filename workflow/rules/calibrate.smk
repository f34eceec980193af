# One pass per source model over training blocks: the 2-norm partial-RoPE scores and the attention
# inputs' covariances (activation-aware SVD; the output error that every conversion reports, on
# held-out validation blocks).

# The device is a machine choice, kept out of `params:` so that switching it never reruns the science
# downstream; `gpu` asks the scheduler for one GPU, `cpu` for none.
CALIBRATE_DEVICE = "cuda" if config["calibrate"]["device"] == "gpu" else "cpu"


rule calibrate:
    input:
        model=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
    output:
        **experiments.calibration_files("{model}"),
    params:
        samples=config["calibrate"]["samples"],
        heldout=config["calibrate"]["heldout_samples"],
    log:
        "logs/calibrate/{model}.log",
    benchmark:
        "benchmarks/calibrate/{model}.tsv"
    threads: JOB_THREADS
    priority: FIRST
    resources:
        gpu=1 if CALIBRATE_DEVICE == "cuda" else 0,
    shell:
        "OMP_NUM_THREADS={threads} {MLA} calibrate --model {input.model} --data {input.data}"
        " --samples {params.samples} --device {CALIBRATE_DEVICE} --out {output.scores}"
        " --covariance-out {output.covariance} --heldout-samples {params.heldout} > {log} 2>&1"
