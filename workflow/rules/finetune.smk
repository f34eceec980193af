# Continued pre-training of every variant (converted models and the unconverted baseline), identically.


# MLflow's first use of a new sqlite store migrates its schema; parallel jobs doing that at once
# collide ("table _alembic_tmp_... already exists"), so the store is created once, before them.
rule tracking_store:
    output:
        "results/mlflow.ready",
    params:
        uri=config["mlflow"]["tracking_uri"],
    log:
        "logs/tracking_store/store.log",
    shell:
        "{PYTHON} -c 'import sys; from mla import tracking;"
        " tracking.client_for(sys.argv[1]).search_experiments(max_results=1)' {params.uri:q} > {log} 2>&1"
        " && echo {params.uri:q} > {output}"


rule finetune:
    input:
        model=lambda wc: start_checkpoint(wc.experiment, wc.variant),
        data=lambda wc: data_dir(experiment_model(wc.experiment)),
        store="results/mlflow.ready",
    output:
        final=directory("results/finetune/{experiment}/{variant}/final"),
        metrics="results/finetune/{experiment}/{variant}/metrics.csv",
        run="results/finetune/{experiment}/{variant}/run.json",
    params:
        out=lambda wc: finetune_dir(wc.experiment, wc.variant),
        args=finetune_args,
        ckpt_root=lambda wc: f"results/checkpoints/{wc.experiment}/{wc.variant}",
        settings=lambda wc: settings_hash(wc.experiment, wc.variant),
    log:
        "logs/finetune/{experiment}/{variant}.log",
    benchmark:
        "benchmarks/finetune/{experiment}/{variant}.tsv"
    threads: 2
    resources:
        gpu=finetune_gpus,
        # torch threads per process (not a param: changing the cores must not retrain anything)
        torch_threads=lambda wc, threads: max(1, threads // variant_settings(wc.experiment, wc.variant)["train"]["nproc"]),
    shell:
        # Trainer/DeepSpeed checkpoints live outside the declared outputs, so a failed or killed job
        # resumes. Their folder is keyed by the settings' hash and by the time the starting checkpoint
        # was written: a changed setting or a re-made input starts afresh (older folders are removed).
        # After success they are deleted (GBs each: fp32 weights + Adam states).
        "ckpt={params.ckpt_root}/{params.settings}-$(stat -c %Y {input.model}/config.json);"
        " mkdir -p {params.ckpt_root};"
        " find {params.ckpt_root} -mindepth 1 -maxdepth 1 ! -path \"$ckpt\" -exec rm -rf {{}} + ;"
        " MLA_SNAKEMAKE_RULE={rule} {MLA} train --model {input.model} --data {input.data}"
        " --out {params.out} --checkpoint-dir \"$ckpt\" {params.args} --threads {resources.torch_threads} > {log} 2>&1;"
        " rm -rf \"$ckpt\""
