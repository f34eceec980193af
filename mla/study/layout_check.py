"""The parse-time check of every variant's cache budget against its model's shape (mla/conversion/layout.py):
more RoPE pairs or rotated components than the model has, a width with no room for a latent beside its RoPE
share, a share that gives no whole number of dims, a latent beyond full rank. Arithmetic only (torch-free);
a model whose shape is unknown before its download is checked by its conversion job instead."""

from __future__ import annotations

from mla.conversion.layout import LayoutError, resolve
from mla.errors import UserError
from mla.study import experiments
from mla.study.model_configs import model_config


def setting_key(config: dict, experiment: str, variant: str, option: str) -> str:
    """The config key that holds `option` for a variant: its own entry, its override, or the experiment's."""
    exp = config["experiments"][experiment]
    where = f"experiments.{experiment}"
    for section in ("overrides", "variants"):
        if option in ((exp.get(section) or {}).get(variant) or {}):
            return f"{where}.{section}.{variant}.{option}"
    if variant in (exp.get("variants") or {}):
        return f"{where}.variants.{variant}.{option}"
    return f"{where}.{option}"


def layout_errors(config: dict, results: str = "results") -> list[tuple[str, str]]:
    """(config key, message) for each variant whose budget its model cannot hold."""
    errors, shapes_of = [], {}
    for v in experiments.all_variants(config):
        if v.is_baseline:
            continue
        if v.model not in shapes_of:
            shapes_of[v.model] = model_config(config, v.model, results)
        cfg = shapes_of[v.model]
        if cfg is None:
            continue
        try:
            resolve(cfg, **v.budget())
        except LayoutError as exc:
            errors.append((setting_key(config, v.experiment, v.name, exc.option), f"{exc} ({v.experiment}/{v.name})"))
        except UserError as exc:   # the model itself: a family the conversion refuses
            errors.append((f"experiments.{v.experiment}.model", str(exc)))
    return list(dict.fromkeys(errors))
