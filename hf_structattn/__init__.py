"""hf_structattn: structured attention (MLR, bilinear MLR, bilinear BTT) for Hugging Face Transformers.

Importing the package registers its configurations and models with the Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .modeling.configuration_structattn_gpt2 import StructAttnGPT2Config
from .modeling.modeling_structattn_gpt2 import (
    StructAttnGPT2ForInContextRegression,
    StructAttnGPT2LMHeadModel,
    StructAttnGPT2Model,
    StructAttnGPT2PreTrainedModel,
)
from .modeling.structattn_cache import MLRKeyCacheLayer, StructAttnCache
from .modeling.structattn_geometry import default_block_sizes, resolve_level_scales, validate_mlr_geometry
from .modeling.structattn_mlr import mlr_attention
from .modeling.structattn_reference import mlr_attention_reference

__version__ = "0.1.0"

AutoConfig.register(StructAttnGPT2Config.model_type, StructAttnGPT2Config, exist_ok=True)
AutoModel.register(StructAttnGPT2Config, StructAttnGPT2Model, exist_ok=True)
AutoModelForCausalLM.register(StructAttnGPT2Config, StructAttnGPT2LMHeadModel, exist_ok=True)

__all__ = [
    "MLRKeyCacheLayer",
    "StructAttnCache",
    "StructAttnGPT2Config",
    "StructAttnGPT2ForInContextRegression",
    "StructAttnGPT2LMHeadModel",
    "StructAttnGPT2Model",
    "StructAttnGPT2PreTrainedModel",
    "default_block_sizes",
    "mlr_attention",
    "mlr_attention_reference",
    "resolve_level_scales",
    "validate_mlr_geometry",
]
