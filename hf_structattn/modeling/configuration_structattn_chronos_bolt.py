"""Configuration of a Chronos-Bolt model with structured (MLR) attention (see ``modeling_structattn_chronos_bolt``)."""

from .configuration_structattn_t5 import StructAttnT5Config

BOLT_MODEL_CLASS_NAME = "StructAttnChronosBoltModelForForecasting"
BOLT_AUTO_MAP = {
    "AutoConfig": "configuration_structattn_chronos_bolt.StructAttnChronosBoltConfig",
    "AutoModel": f"modeling_structattn_chronos_bolt.{BOLT_MODEL_CLASS_NAME}",
}


class StructAttnChronosBoltConfig(StructAttnT5Config):
    r"""``StructAttnT5Config`` of a Chronos-Bolt model (Chronos' ``chronos_config`` and ``chronos_pipeline_class``
    are kept as extra attributes). Block sizes count encoder tokens, i.e. patches of
    ``chronos_config["input_patch_stride"]`` time steps (plus the ``[REG]`` token at the end)."""

    model_type = "structattn_chronos_bolt"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # ChronosBoltPipeline.from_pretrained reads this config and then looks the model class up by name in
        # chronos.chronos_bolt: the class must be registered there by now
        from .modeling_structattn_chronos_bolt import bolt_model_class

        bolt_model_class()


StructAttnChronosBoltConfig.register_for_auto_class()

__all__ = ["BOLT_AUTO_MAP", "BOLT_MODEL_CLASS_NAME", "StructAttnChronosBoltConfig"]
