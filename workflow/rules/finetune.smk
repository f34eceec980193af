# Continued pre-training of every variant (converted models and the unconverted baseline), identically.


# train.nodes > 1: the SLURM cluster must be able to give that many nodes (checked on the submitting
# host before any job; inside a job `mla train --nodes N` checks its own allocation).
def _node_count_errors():
    from mla.training.launch import slurm_node_count_error

    wanted = {}
    for v in STUDY.runs().values():
        key = f"experiments.{v.experiment}.train.nodes" if "nodes" in config["experiments"][v.experiment]["train"] else "train.nodes"
        wanted[key] = max(wanted.get(key, 1), v.train["nodes"])
    errors = [(key, slurm_node_count_error(n)) for key, n in wanted.items() if n > 1]
    return [(key, msg) for key, msg in errors if msg]


if not workflow.remote_exec:
    for _key, _msg in _node_count_errors():
        raise WorkflowError(f"config key '{_key}': {_msg}")


# One job per (model, start, recipe): variants and experiments with the same start checkpoint and recipe
# share it (mla/study/experiments.py). The MLflow run is named after the job, not after any variant; the table rule
# tags it with the experiments and labels it appears under.
rule finetune:
    input:
        model=start_checkpoint,
        data=lambda wc: data_dir(wc.model),
        teacher=finetune_teacher,  # distillation only (its --teacher is in params.args)
    output:
        final=directory("results/finetune/{model}/{start}/{recipe}/final"),
        metrics="results/finetune/{model}/{start}/{recipe}/metrics.csv",
        run="results/finetune/{model}/{start}/{recipe}/run.json",
    params:
        out=lambda wc: experiments.run_dir(wc.model, wc.start, wc.recipe),
        args=finetune_args,  # the recipe only: launch settings are a resource (below)
        ckpt_root=lambda wc: f"results/checkpoints/{wc.model}/{wc.start}/{wc.recipe}",
    log:
        "logs/finetune/{model}/{start}/{recipe}.log",
    benchmark:
        "benchmarks/finetune/{model}/{start}/{recipe}.tsv"
    threads: lambda wc: max(JOB_THREADS, _run(wc).train["nproc"])   # a core per process at least
    resources:
        # one SLURM job per run with train.nodes nodes; `mla train --nodes N` starts one launcher per node
        nodes=finetune_nodes,
        tasks=finetune_nodes,  # one task per node (sbatch --ntasks for CPU jobs)
        tasks_per_gpu=0,  # else the plugin turns `tasks` into --ntasks-per-gpu for GPU jobs
        gpu=finetune_gpus,  # one node: --gpus=nproc
        gres=finetune_gres,  # several nodes: --gres=gpu:nproc on each
        # torch threads per process (not a param: changing the cores must not retrain anything)
        torch_threads=lambda wc, threads: max(1, threads // STUDY.run(wc.model, wc.start, wc.recipe).train["nproc"]),
        # nproc, nodes, micro batch, ZeRO stage, offload, checkpointing, device, save interval: read when the
        # job starts, like the threads (a param would rerun a finished run when only its launch changes)
        launch=finetune_launch_args,
        # SLURM time of this submission from the plan (train.gpu_tokens_per_second, train.max_job_hours); a run
        # longer than one job stops with a checkpoint before the limit and the next submission resumes
        runtime=finetune_runtime,
    retries: finetune_retries()
    shell:
        # Trainer/DeepSpeed checkpoints live outside the declared outputs, so a failed or killed job resumes:
        # `mla train` keeps them in ROOT/<key of the trajectory> (model and data contents, recipe, seed; not
        # nproc, nodes, micro batch, ZeRO stage or save interval), deletes that folder after success and
        # lists (never deletes) other folders under ROOT. See mla/training/resume.py.
        "MLA_SNAKEMAKE_RULE={rule} {MLA} train --model {input.model} --data {input.data}"
        " --out {params.out} --checkpoint-root {params.ckpt_root} {params.args} {resources.launch}"
        " --tracking-uri {TRACKING_URI:q} --experiment {MLFLOW_EXPERIMENT:q}"
        " --run-name {wildcards.model}/{wildcards.start}/{wildcards.recipe} --variant {wildcards.start}"
        " --model-name {wildcards.model} --tag recipe={wildcards.recipe}"
        " --threads {resources.torch_threads} > {log} 2>&1"
