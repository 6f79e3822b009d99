"""Chronos-Bolt with structured (MLR) attention, loadable through Chronos' own entry points.

Chronos-Bolt is not an Auto class: ``ChronosBoltPipeline.from_pretrained`` reads the config with ``AutoConfig``
and then looks the model class up *by name* (``config.architectures[0]``) in the ``chronos.chronos_bolt`` module,
falling back to the dense ``ChronosBoltModelForForecasting`` with only a log line. A patched Bolt checkpoint
therefore records

* ``model_type = "structattn_chronos_bolt"`` with ``auto_map["AutoConfig"]`` pointing here, so ``AutoConfig``
  refuses to read it without this code (``trust_remote_code=True``, or ``import hf_structattn``), and
* ``architectures = ["StructAttnChronosBoltModelForForecasting"]``, a class registered under that name in
  ``chronos.chronos_bolt`` (that lookup is the whole of Chronos' class resolution). The class subclasses Chronos'
  own, so it is defined (and registered) on first use, not at import: when a ``StructAttnChronosBoltConfig`` is
  built (which ``AutoConfig`` does right before Chronos' lookup) or when the class is looked up as an attribute of
  this module (``auto_map``, ``patch``). Importing this module therefore does not import chronos (nor pandas).

So ``BaseChronosPipeline.from_pretrained(dir, trust_remote_code=True)`` (or, with ``hf_structattn`` imported,
without the flag) returns the MLR model; a load that cannot run this code fails instead of silently returning
dense attention. chronos-forecasting is optional: without it only the config class exists.
"""

import functools

from transformers import AutoModel

from .configuration_structattn_t5 import StructAttnT5Config

BOLT_MODEL_CLASS_NAME = "StructAttnChronosBoltModelForForecasting"
BOLT_AUTO_MAP = {
    "AutoConfig": "modeling_structattn_chronos_bolt.StructAttnChronosBoltConfig",
    "AutoModel": f"modeling_structattn_chronos_bolt.{BOLT_MODEL_CLASS_NAME}",
}
# patching keeps pretrained q/k/v/o: only MLR rearranges them; the bilinear variants would need new parameters
BOLT_ATTENTIONS = ("dense", "mlr")


class StructAttnChronosBoltConfig(StructAttnT5Config):
    r"""``StructAttnT5Config`` of a Chronos-Bolt model (Chronos' ``chronos_config`` and ``chronos_pipeline_class``
    are kept as extra attributes). Block sizes count encoder tokens, i.e. patches of
    ``chronos_config["input_patch_stride"]`` time steps (plus the ``[REG]`` token at the end)."""

    model_type = "structattn_chronos_bolt"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # ChronosBoltPipeline.from_pretrained reads this config and then looks the model class up by name in
        # chronos.chronos_bolt: the class must be registered there by now
        bolt_model_class()


StructAttnChronosBoltConfig.register_for_auto_class()


@functools.cache
def bolt_model_class():
    """``StructAttnChronosBoltModelForForecasting``, defined on the first call and registered under its name in
    ``chronos.chronos_bolt`` and with ``AutoModel``; None when chronos-forecasting is not installed."""
    try:  # optional extra: the payload imports only torch and transformers unconditionally
        from chronos import chronos_bolt
    except ImportError:
        return None

    from .modeling_structattn_t5 import install_t5_structured_attention  # the modeling half, on first use

    class StructAttnChronosBoltModelForForecasting(chronos_bolt.ChronosBoltModelForForecasting):
        """``chronos.chronos_bolt.ChronosBoltModelForForecasting`` whose encoder self-attention (and decoder
        self-attention, which sees one token in Bolt) is MLR as configured. Same forward, outputs and
        state-dict names (MLR is installed on Chronos' own ``T5Attention`` modules).

        context: (batch, time) -> ``quantile_preds`` (batch, num_quantiles, prediction_length), as the base class.
        """

        config_class = StructAttnChronosBoltConfig
        _supports_attention_backend = False  # as every class of this package (structattn_pretrained)

        def __init__(self, config: StructAttnChronosBoltConfig):
            for field in ("encoder_attention", "decoder_attention", "cross_attention"):
                if getattr(config, field) not in BOLT_ATTENTIONS:
                    raise ValueError(f"{field}={getattr(config, field)!r}: a Chronos-Bolt model takes one of "
                                     f"{BOLT_ATTENTIONS}")
            super().__init__(config)
            # MLR keeps T5's parameters: nothing new needs initialising
            install_t5_structured_attention(self, config)
            # remote loading needs the config class in config.json, not only the class being saved
            self.config.auto_map = dict(BOLT_AUTO_MAP)

    model_class = StructAttnChronosBoltModelForForecasting
    model_class.__qualname__ = BOLT_MODEL_CLASS_NAME  # a module-level name, as pickling and save_pretrained expect
    globals()[BOLT_MODEL_CLASS_NAME] = model_class
    model_class.register_for_auto_class("AutoModel")
    AutoModel.register(StructAttnChronosBoltConfig, model_class, exist_ok=True)
    # Chronos resolves config.architectures[0] with globals() of chronos.chronos_bolt: this is its registry
    setattr(chronos_bolt, BOLT_MODEL_CLASS_NAME, model_class)
    return model_class


def __getattr__(name: str):
    """The model class on first attribute access (``auto_map`` loading, ``patch``); see the module docstring."""
    if name == BOLT_MODEL_CLASS_NAME and bolt_model_class() is not None:
        return bolt_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BOLT_AUTO_MAP", "BOLT_MODEL_CLASS_NAME", "StructAttnChronosBoltConfig", "bolt_model_class"]
