"""hf_structattn: structured attention (MLR, bilinear MLR, bilinear BTT) for Hugging Face Transformers.

Importing the package registers its configurations and models with the Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForTextEncoding

from .modeling.configuration_structattn_gpt2 import StructAttnGPT2Config
from .modeling.modeling_structattn_gpt2 import (
    StructAttnGPT2ForInContextRegression,
    StructAttnGPT2LMHeadModel,
    StructAttnGPT2Model,
    StructAttnGPT2PreTrainedModel,
)
from .modeling.configuration_structattn_t5 import StructAttnT5Config
from .modeling.modeling_structattn_t5 import (
    StructAttnT5EncoderModel,
    StructAttnT5ForConditionalGeneration,
    StructAttnT5Model,
    StructAttnT5PreTrainedModel,
)
from .modeling.modeling_structattn_chronos_bolt import StructAttnChronosBoltConfig
from .modeling.structattn_cache import MLRKeyCacheLayer, StructAttnCache
from .modeling.structattn_geometry import default_block_sizes, resolve_level_scales, validate_mlr_geometry
from .modeling.structattn_mlr import mlr_attention
from .modeling.structattn_reference import mlr_attention_reference

__version__ = "0.1.0"

AutoConfig.register(StructAttnGPT2Config.model_type, StructAttnGPT2Config, exist_ok=True)
AutoModel.register(StructAttnGPT2Config, StructAttnGPT2Model, exist_ok=True)
AutoModelForCausalLM.register(StructAttnGPT2Config, StructAttnGPT2LMHeadModel, exist_ok=True)
AutoConfig.register(StructAttnT5Config.model_type, StructAttnT5Config, exist_ok=True)
AutoModel.register(StructAttnT5Config, StructAttnT5Model, exist_ok=True)
AutoModelForSeq2SeqLM.register(StructAttnT5Config, StructAttnT5ForConditionalGeneration, exist_ok=True)
AutoModelForTextEncoding.register(StructAttnT5Config, StructAttnT5EncoderModel, exist_ok=True)
# the Bolt model class subclasses chronos' own: it is defined and registered (with AutoModel and where Chronos
# looks it up by name) when a StructAttnChronosBoltConfig is first built, so importing the package imports no chronos
AutoConfig.register(StructAttnChronosBoltConfig.model_type, StructAttnChronosBoltConfig, exist_ok=True)

# the patchers live outside the payload (they import chronos when given a Chronos model); imported after
# registration
from .patching import load_patched_chronos_bolt, patch, patch_report  # noqa: E402
from .decoder_patching import register_supported_decoders  # noqa: E402

register_supported_decoders()  # MLR<Arch> checkpoints load by Auto class without trust_remote_code

__all__ = [
    "MLRKeyCacheLayer",
    "StructAttnCache",
    "StructAttnChronosBoltConfig",
    "StructAttnGPT2Config",
    "StructAttnGPT2ForInContextRegression",
    "StructAttnGPT2LMHeadModel",
    "StructAttnGPT2Model",
    "StructAttnGPT2PreTrainedModel",
    "StructAttnT5Config",
    "StructAttnT5EncoderModel",
    "StructAttnT5ForConditionalGeneration",
    "StructAttnT5Model",
    "StructAttnT5PreTrainedModel",
    "default_block_sizes",
    "mlr_attention",
    "mlr_attention_reference",
    "load_patched_chronos_bolt",
    "patch",
    "patch_report",
    "resolve_level_scales",
    "validate_mlr_geometry",
]
