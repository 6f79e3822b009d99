"""hf_structattn: structured attention (MLR, bilinear MLR, bilinear BTT) for Hugging Face Transformers.

Importing the package registers its configurations with ``AutoConfig`` (the GPT-2 and T5 families, Chronos-Bolt and
the ``MLR<Arch>`` configs of the tested decoder architectures) and nothing else: the model classes are imported and
registered with the ``AutoModel*`` classes when the first config of their family is built (transformers' modeling
code is the expensive import), and every public name below is imported on first access.
"""

import importlib

from transformers import AutoConfig

from .modeling.modeling_structattn_chronos_bolt import StructAttnChronosBoltConfig
from .modeling.configuration_structattn_gpt2 import StructAttnGPT2Config
from .modeling.configuration_structattn_t5 import StructAttnT5Config
from .modeling.structattn_config_rules import FIRST_CONFIG_HOOKS

__version__ = "0.1.0"

# the decoder architectures whose MLR classes load by Auto class without trust_remote_code (others once patched)
TESTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                        "GemmaForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel",
                        "GPTNeoXForCausalLM")
_TESTED_CONFIGS = {  # config class name -> (model_type, model class name): nothing of the architecture is imported here
    "LlamaConfig": ("llama", "LlamaForCausalLM"), "Qwen2Config": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Config": ("qwen3", "Qwen3ForCausalLM"), "MistralConfig": ("mistral", "MistralForCausalLM"),
    "GemmaConfig": ("gemma", "GemmaForCausalLM"), "Gemma3TextConfig": ("gemma3_text", "Gemma3ForCausalLM"),
    "Phi3Config": ("phi3", "Phi3ForCausalLM"), "GPT2Config": ("gpt2", "GPT2LMHeadModel"),
    "GPTNeoXConfig": ("gpt_neox", "GPTNeoXForCausalLM"),
}

_LAZY = {
    "StructAttnGPT2Model": "modeling.modeling_structattn_gpt2",
    "StructAttnGPT2LMHeadModel": "modeling.modeling_structattn_gpt2",
    "StructAttnGPT2ForInContextRegression": "modeling.modeling_structattn_gpt2",
    "StructAttnGPT2PreTrainedModel": "modeling.modeling_structattn_gpt2",
    "StructAttnT5Model": "modeling.modeling_structattn_t5",
    "StructAttnT5ForConditionalGeneration": "modeling.modeling_structattn_t5",
    "StructAttnT5EncoderModel": "modeling.modeling_structattn_t5",
    "StructAttnT5PreTrainedModel": "modeling.modeling_structattn_t5",
    "MLRKeyCacheLayer": "modeling.structattn_cache",
    "MLRStaticKeyCacheLayer": "modeling.structattn_cache",
    "MLRQuantizedCache": "modeling.structattn_cache_quantized",
    "MLRQuantizedKeyCacheLayer": "modeling.structattn_cache_quantized",
    "MLRGeometry": "modeling.structattn_geometry",
    "default_block_sizes": "modeling.structattn_config_rules",
    "resolve_level_scales": "modeling.structattn_config_rules",
    "validate_mlr_geometry": "modeling.structattn_config_rules",
    "mlr_attention": "modeling.structattn_mlr",
    "mlr_exportable_decoder": "modeling.structattn_prepare",
    "mlr_attention_reference": "modeling.structattn_reference",
    "patch": "patching",
    "patch_report": "patching",
    "load_patched_chronos_bolt": "patching",
}
_SUBMODULES = ("flops", "cache_memory", "diagnostics", "mup", "patching", "decoder_patching", "cli", "training", "tokenization")


def __getattr__(name: str):
    """Public names and submodules on first access (``hf_structattn.patch``, ``hf_structattn.flops``, ...)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def _register_models(config_class: type) -> None:
    """Import and register the model classes of ``config_class`` (run when its first config is built)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForTextEncoding

    if issubclass(config_class, StructAttnChronosBoltConfig):
        return  # registered by its own config (Chronos looks the class up by name)
    if issubclass(config_class, StructAttnGPT2Config):
        from .modeling import modeling_structattn_gpt2 as gpt2

        AutoModel.register(StructAttnGPT2Config, gpt2.StructAttnGPT2Model, exist_ok=True)
        AutoModelForCausalLM.register(StructAttnGPT2Config, gpt2.StructAttnGPT2LMHeadModel, exist_ok=True)
    elif issubclass(config_class, StructAttnT5Config):
        from .modeling import modeling_structattn_t5 as t5

        AutoModel.register(StructAttnT5Config, t5.StructAttnT5Model, exist_ok=True)
        AutoModelForSeq2SeqLM.register(StructAttnT5Config, t5.StructAttnT5ForConditionalGeneration, exist_ok=True)
        AutoModelForTextEncoding.register(StructAttnT5Config, t5.StructAttnT5EncoderModel, exist_ok=True)
    elif config_class.__name__.startswith("MLR") and config_class.__name__[3:] in _TESTED_CONFIGS:
        import transformers

        from .modeling.structattn_decoder import mlr_model_class

        model_class = getattr(transformers, _TESTED_CONFIGS[config_class.__name__[3:]][1])
        AutoModelForCausalLM.register(config_class, mlr_model_class(model_class), exist_ok=True)


def register_attention() -> None:
    """Register MLR attention in transformers' ``AttentionInterface`` now (``"mlr"``, ``"mlr_eager"`` and the mask
    functions they take): for a *stock* checkpoint loaded with ``attn_implementation="mlr"``, whose model class is
    transformers' own and so imports none of this package. Every MLR model class registers them itself; importing
    the package does not, as it costs the import of transformers' modeling code."""
    importlib.import_module(".modeling.structattn_attention", __name__)


def register_models() -> None:
    """Register every model class with the ``AutoModel*`` classes now, rather than when the first config of its
    family is built: for code that reads the Auto mappings before building any config (listing supported models,
    test harnesses that copy transformers' name tables). Imports the GPT-2 and T5 modeling code and the tested
    decoder architectures, and registers MLR attention (:func:`register_attention`)."""
    import transformers

    from .modeling.structattn_decoder import mlr_config_class

    register_attention()

    for config_class in (StructAttnGPT2Config, StructAttnT5Config):
        _register_models(config_class)
    for name in _TESTED_CONFIGS:
        _register_models(mlr_config_class(getattr(transformers, name)))


def _deferred_mlr_config(config_name: str, model_type: str) -> type:
    """AutoConfig's entry for the ``MLR<Arch>Config`` of a tested decoder. That class subclasses transformers' own
    config, whose import can cost seconds (``LlamaConfig`` pulls in transformers' type validators), so it is built
    when a config of that type is first read or made; reading one returns an instance of the real class."""

    def real_class():
        import transformers

        from .modeling.structattn_decoder import mlr_config_class

        return mlr_config_class(getattr(transformers, config_name))

    def from_dict(cls, *args, **kwargs):
        return real_class().from_dict(*args, **kwargs)

    def from_pretrained(cls, *args, **kwargs):
        return real_class().from_pretrained(*args, **kwargs)

    def new(cls, *args, **kwargs):
        return real_class()(*args, **kwargs)

    return type(f"MLR{config_name}", (), {"model_type": f"mlr_{model_type}", "__module__": __name__,
                                          "__doc__": _deferred_mlr_config.__doc__, "__new__": new,
                                          "from_dict": classmethod(from_dict),
                                          "from_pretrained": classmethod(from_pretrained)})


def _register_configs() -> None:
    for config_class in (StructAttnGPT2Config, StructAttnT5Config, StructAttnChronosBoltConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for name, (model_type, _) in _TESTED_CONFIGS.items():
        AutoConfig.register(f"mlr_{model_type}", _deferred_mlr_config(name, model_type), exist_ok=True)


FIRST_CONFIG_HOOKS.append(_register_models)
_register_configs()

__all__ = ["StructAttnChronosBoltConfig", "StructAttnGPT2Config", "StructAttnT5Config", "TESTED_ARCHITECTURES",
           "register_attention", "register_models", *sorted(_LAZY)]
