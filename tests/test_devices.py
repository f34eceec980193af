"""`mla.devices`: --device resolution (and its one-line error), dtype choice, free memory (CUDA, host, cgroup)."""

from __future__ import annotations

import pytest
import torch

from mla import devices
from mla.cli import main
from mla.errors import UserError


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine where torch reports one CUDA device (what cannot exist here: a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_auto_picks_cuda_only_when_present(monkeypatch, fake_cuda):
    assert devices.resolve_device("auto") == torch.device("cuda")
    assert devices.resolve_device("cuda") == torch.device("cuda")
    assert devices.resolve_device("cuda:0") == torch.device("cuda:0")
    assert devices.resolve_device("cpu") == torch.device("cpu")            # an explicit cpu stays cpu
    with pytest.raises(UserError, match="has 1 CUDA device"):
        devices.resolve_device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == torch.device("cpu")


def test_cuda_requested_without_gpu_is_one_line_naming_flag_and_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as err:
        devices.resolve_device("cuda", config_key="evaluate.device")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--device cuda:") and "evaluate.device: gpu" in msg
    with pytest.raises(UserError, match="expected one of auto, cpu, cuda"):
        devices.resolve_device("tpu")


@pytest.mark.parametrize("verb, key", [("calibrate", "calibrate.device"), ("evaluate", "evaluate.device")])
def test_cli_refuses_cuda_before_loading_anything(tmp_path, capsys, monkeypatch, verb, key):
    """The device is checked first: the (missing) model and data are never opened."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [verb, "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--device", "cuda"]
    if verb == "calibrate":
        argv += ["--data", str(tmp_path / "data")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"mla {verb}: error: --device cuda" in err and key in err


def test_dtype_bf16_only_on_cuda_that_supports_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert devices.compute_dtype(torch.device("cuda")) is torch.bfloat16
    assert devices.compute_dtype(torch.device("cpu")) is torch.float32       # bf16 is ~30x slower on CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100
    assert devices.compute_dtype(torch.device("cuda")) is torch.float32


def test_free_memory_cuda_and_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 2 ** 30, 80 * 2 ** 30))
    assert devices.free_memory_bytes(torch.device("cuda")) == 5 * 2 ** 30
    import psutil

    before = psutil.virtual_memory().available
    free = devices.free_memory_bytes(torch.device("cpu"))
    host = max(before, psutil.virtual_memory().available)   # other processes (a second pytest worker) come and go
    assert 0 < free <= host * 1.05                       # never above the host's (the cgroup can only lower it)
    monkeypatch.setattr(devices, "cgroup_free_bytes", lambda: 2 ** 20)
    assert devices.free_memory_bytes(torch.device("cpu")) == 2 ** 20


def test_cgroup_limits_v1_and_v2(tmp_path):
    """A SLURM job's --mem lives in its cgroup: limit - usage of the tightest level counts."""
    v2 = tmp_path / "v2"
    (v2 / "slurm/job_7/step_0").mkdir(parents=True)
    (v2 / "slurm/job_7/memory.max").write_text(f"{64 * 2 ** 30}\n")
    (v2 / "slurm/job_7/memory.current").write_text(f"{4 * 2 ** 30}\n")
    (v2 / "slurm/job_7/step_0/memory.max").write_text("max\n")
    (v2 / "slurm/job_7/step_0/memory.current").write_text(f"{3 * 2 ** 30}\n")
    proc = tmp_path / "cgroup_v2"
    proc.write_text("0::/slurm/job_7/step_0\n")
    assert devices.cgroup_free_bytes(proc, v2) == 60 * 2 ** 30

    v1 = tmp_path / "v1"
    (v1 / "memory/job").mkdir(parents=True)
    (v1 / "memory/job/memory.limit_in_bytes").write_text(str(8 * 2 ** 30))
    (v1 / "memory/job/memory.usage_in_bytes").write_text(str(2 ** 30))
    (v1 / "memory/memory.limit_in_bytes").write_text("9223372036854771712")  # "no limit"
    (v1 / "memory/memory.usage_in_bytes").write_text(str(10 * 2 ** 30))
    proc.write_text("5:cpu:/job\n4:memory:/job\n")
    assert devices.cgroup_free_bytes(proc, v1) == 7 * 2 ** 30
    proc.write_text("4:memory:/\n")
    assert devices.cgroup_free_bytes(proc, v1) is None                    # unlimited: psutil decides
    assert devices.cgroup_free_bytes(tmp_path / "missing", v1) is None


# -- the workflow: a GPU only for the jobs whose config section asks for one ---------------------------

def _dry_run_jobs(tmp_path, *args) -> list[tuple[str, str]]:
    """(rule, text of its job block) of every job in a Snakemake dry run (-p shows the shell command)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "-d", str(tmp_path), "-n", "-p",
           "--cores", "1", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    blocks = re.split(r"^(?=(?:local)?rule \w+:)", r.stdout, flags=re.M)
    return [(re.match(r"(?:local)?rule (\w+):", b).group(1), b) for b in blocks if re.match(r"(?:local)?rule \w+:", b)]


@pytest.mark.timeout(300)
def test_rules_request_a_gpu_only_when_configured(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    import re

    import yaml

    def device(text, folder):
        """calibrate passes --device; `mla evaluate --config` maps the config file's evaluate.device (gpu -> cuda)."""
        if "--device" in text:
            return re.search(r"--device (\w+)", text).group(1)
        config = yaml.safe_load((folder / re.search(r"--config (\S+)", text).group(1)).read_text())
        return {"gpu": "cuda", "cpu": "cpu"}[config["evaluate"]["device"]]

    rules = ("calibrate", "evaluate", "evaluate_inference")
    paper = _dry_run_jobs(tmp_path / "paper", "--profile", str(root / "workflow/profiles/slurm"),
                          "--configfile", str(root / "configs/paper.yaml"))
    jobs = [(rule, text) for rule, text in paper if rule in rules]
    assert {rule for rule, _ in jobs} == set(rules)
    for rule, text in jobs:                             # configs/paper.yaml: calibrate/evaluate.device gpu
        assert device(text, tmp_path / "paper") == "cuda" and ", gpu=1" in text, text
    default = _dry_run_jobs(tmp_path / "default", "--profile", str(root / "workflow/profiles/slurm"),
                            "--configfile", str(root / "configs/smoke.yaml"))
    jobs = [(rule, text) for rule, text in default if rule in rules]
    assert {rule for rule, _ in jobs} == set(rules)
    for rule, text in jobs:                             # device cpu (the default): no GPU held idle
        assert device(text, tmp_path / "default") == "cpu" and "gpu=1" not in text, text


@pytest.mark.timeout(300)
def test_jobs_take_one_core_below_four_and_the_long_chains_go_first(tmp_path):
    """Cores per compute job follow the machine (workflow/rules/common.smk): one below 4 cores, two from 4; fits
    and what they wait for are scheduled before other ready jobs, evaluations after all."""
    import re
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "config.yaml")

    def omp_threads(cores):
        jobs = _dry_run_jobs(tmp_path / str(cores), "--configfile", config, "--cores", str(cores))
        return {int(n) for rule, text in jobs if rule == "fit" for n in re.findall(r"OMP_NUM_THREADS=(\d+)", text)}, jobs

    two_cores, jobs = omp_threads(2)
    assert two_cores == {1}
    assert omp_threads(8)[0] == {2}
    priority = {rule: int(m.group(1)) if (m := re.search(r"priority: (-?\d+)", text)) else 0 for rule, text in jobs}
    assert priority["calibrate"] == priority["convert"] == priority["fit"] > priority["finetune"]
    assert priority["finetune"] > priority["evaluate"] and priority["finetune"] > priority["evaluate_original"]
