"""The MLA model classes, registered with transformers' Auto classes on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_mla import MLAConfig
from .cache_mla import MLACache, MLAQuantizedCache, MLAStaticCache
from .modeling_mla import MLAForCausalLM, MLAModel

AutoConfig.register(MLAConfig.model_type, MLAConfig, exist_ok=True)
AutoModel.register(MLAConfig, MLAModel, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "MLACache", "MLAStaticCache", "MLAQuantizedCache"]
