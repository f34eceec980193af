# Model sources -> ordinary Hugging Face checkpoint folders (config, safetensors, tokenizer).


rule download:
    input:
        download_inputs,
    output:
        directory("results/models/{model}"),
    params:
        args=download_args,
    log:
        "logs/download/{model}.log",
    benchmark:
        "benchmarks/download/{model}.tsv"
    threads: 1
    shell:
        "{MLA} download {params.args} --out {output} > {log} 2>&1"
