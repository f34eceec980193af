# Original checkpoint -> MLA checkpoint, once per (model, partial-RoPE + SVD settings): partial RoPE +
# low-rank init. Variants of any experiment with the same settings share it (mla/study/experiments.py).


rule convert:
    input:
        unpack(convert_inputs),
    output:
        directory("results/convert/{model}/{conversion}"),
    params:
        args=convert_args,
    log:
        "logs/convert/{model}/{conversion}.log",
    benchmark:
        "benchmarks/convert/{model}/{conversion}.tsv"
    threads: JOB_THREADS
    priority: FIRST
    shell:
        "OMP_NUM_THREADS={threads} {MLA} convert --model {input.model} --out {output} {params.args} > {log} 2>&1"
