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


# train.nodes > 1: the SLURM cluster must be able to give that many nodes (checked on the submitting
# host before any job; inside a job `mla train --nodes N` checks its own allocation).
def _node_count_errors():
    from mla.training.launch import slurm_node_count_error

    wanted = {}
    for e, exp in config["experiments"].items():
        for v in variants_of(exp):
            nodes = variant_settings(e, v)["train"]["nodes"]
            key = f"experiments.{e}.train.nodes" if "nodes" in exp["train"] else "train.nodes"
            wanted[key] = max(wanted.get(key, 1), nodes)
    errors = [(key, slurm_node_count_error(n)) for key, n in wanted.items() if n > 1]
    return [(key, msg) for key, msg in errors if msg]


if not workflow.remote_exec:
    for _key, _msg in _node_count_errors():
        raise WorkflowError(f"config key '{_key}': {_msg}")


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
    log:
        "logs/finetune/{experiment}/{variant}.log",
    benchmark:
        "benchmarks/finetune/{experiment}/{variant}.tsv"
    threads: 2
    resources:
        # one SLURM job per run with train.nodes nodes; `mla train --nodes N` starts one launcher per node
        nodes=finetune_nodes,
        tasks=finetune_nodes,  # one task per node (sbatch --ntasks for CPU jobs)
        tasks_per_gpu=0,  # else the plugin turns `tasks` into --ntasks-per-gpu for GPU jobs
        gpu=finetune_gpus,  # one node: --gpus=nproc
        gres=finetune_gres,  # several nodes: --gres=gpu:nproc on each
        # torch threads per process (not a param: changing the cores must not retrain anything)
        torch_threads=lambda wc, threads: max(1, threads // variant_settings(wc.experiment, wc.variant)["train"]["nproc"]),
    shell:
        # Trainer/DeepSpeed checkpoints live outside the declared outputs, so a failed or killed job resumes:
        # `mla train` keeps them in ROOT/<key of the trajectory> (model and data contents, recipe, seed; not
        # nproc, nodes, micro batch, ZeRO stage or save interval), deletes that folder after success and
        # lists (never deletes) other folders under ROOT. See mla/training/resume.py.
        "MLA_SNAKEMAKE_RULE={rule} {MLA} train --model {input.model} --data {input.data}"
        " --out {params.out} --checkpoint-root {params.ckpt_root} {params.args}"
        " --threads {resources.torch_threads} > {log} 2>&1"
