# Original checkpoint -> MLA checkpoint, one per (experiment, d_kv): partial RoPE + low-rank init.


rule convert:
    input:
        unpack(convert_inputs),
    output:
        directory("results/convert/{experiment}/dkv{d_kv}"),
    params:
        args=convert_args,
    log:
        "logs/convert/{experiment}/dkv{d_kv}.log",
    benchmark:
        "benchmarks/convert/{experiment}/dkv{d_kv}.tsv"
    threads: 2
    shell:
        "OMP_NUM_THREADS={threads} {MLA} convert --model {input.model} --out {output}"
        " --d-kv {wildcards.d_kv} {params.args} > {log} 2>&1"
