# 2-norm partial-RoPE scores, once per source model, from token blocks of the training data.


rule calibrate:
    input:
        model=lambda wc: model_dir(wc.model),
        data=lambda wc: data_dir(wc.model),
    output:
        "results/calibrate/{model}/scores.pt",
    params:
        samples=config["calibrate"]["samples"],
    log:
        "logs/calibrate/{model}.log",
    benchmark:
        "benchmarks/calibrate/{model}.tsv"
    threads: 2
    shell:
        "OMP_NUM_THREADS={threads} {MLA} calibrate --model {input.model} --data {input.data}"
        " --samples {params.samples} --out {output} > {log} 2>&1"
