"""The MLA model classes, registered with transformers' Auto classes on import."""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_mla import MLAConfig
from .cache_mla import MLACache, MLAQuantizedCache
from .modeling_mla import MLAForCausalLM

AutoConfig.register(MLAConfig.model_type, MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)

__all__ = ["MLAConfig", "MLAForCausalLM", "MLACache", "MLAQuantizedCache"]
