"""How a layer gets this package's MLR attention: ``install_mlr_attention(module, geometry)`` replaces the attention
module's ``config`` by a view of the model's config (``MLRLayerConfig``, a ``LayerConfigView``) whose
``_attn_implementation`` names the function of the same kind that ``structattn_attention`` registers in transformers'
``AttentionInterface``; the module's own forward then dispatches through ``ALL_ATTENTION_FUNCTIONS`` exactly as it
would for SDPA (the GPT-2 family's bilinear layers get theirs the same way: ``structattn_bilinear_attention``). Part of
the checkpoint payload."""

from typing import Optional

import torch

from .structattn_geometry import MLRGeometry

MLR_ATTENTION = "mlr"
MLR_EAGER_ATTENTION = "mlr_eager"


def mlr_implementation(implementation: Optional[str]) -> str:
    """The MLR attention function standing in for a transformers attention implementation name."""
    return MLR_EAGER_ATTENTION if implementation in ("eager", MLR_EAGER_ATTENTION) else MLR_ATTENTION


class LayerConfigView:
    """The config a layer's attention module reads: every attribute is the model's (stack's) config's, read live,
    except ``_attn_implementation``, which names this package's function of the same kind (``implementation``).
    Writes go to the model's config."""

    def __init__(self, config):
        # ``base_config``: the model's (stack's) config, a plain attribute (every forward's plan reads it), set past
        # __setattr__, which writes through to the base
        self.__dict__["base_config"] = config

    @staticmethod
    def implementation(name: Optional[str]) -> str:
        raise NotImplementedError

    @property
    def _attn_implementation(self) -> str:
        name = self.base_config._attn_implementation
        mapped = self.__dict__.get("_structattn_mapped")  # (the model's name, this package's): every step asks
        if mapped is None or mapped[0] != name:
            mapped = self.__dict__["_structattn_mapped"] = (name, self.implementation(name))
        return mapped[1]

    def __getattr__(self, name: str):
        # only called for names not found on the view itself
        if name.startswith("__") or name == "base_config":  # copy/pickle protocol: never the base's
            raise AttributeError(name)
        return getattr(self.base_config, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.base_config, name, value)

    def __deepcopy__(self, memo):
        import copy

        return type(self)(copy.deepcopy(self.base_config, memo), *self._extra())

    def __reduce__(self):
        return type(self), (self.base_config, *self._extra())

    def _extra(self) -> tuple:
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.base_config).__name__}{''.join(f', {e}' for e in self._extra())})"


class MLRLayerConfig(LayerConfigView):
    """The config an MLR layer's attention module reads (``LayerConfigView``): ``_attn_implementation`` names the MLR
    function of the same kind (``mlr_implementation``); ``mlr_geometry`` is the layer's ``MLRGeometry``,
    ``mlr_scaling`` the module's ``scaling`` (what it hands the attention function; None: 1/sqrt(r)) and
    ``mlr_query_groups`` its query heads per key-value head, which the forward's plan reads before the layers run."""

    implementation = staticmethod(mlr_implementation)

    def __init__(self, config, geometry: MLRGeometry, scaling: Optional[float] = None, query_groups: int = 1):
        super().__init__(config)
        self.__dict__.update(mlr_geometry=geometry, mlr_scaling=scaling, mlr_query_groups=query_groups)

    def _extra(self) -> tuple:
        return (self.mlr_geometry, self.mlr_scaling, self.mlr_query_groups)


def install_mlr_attention(module: torch.nn.Module, geometry: MLRGeometry) -> None:
    """Make ``module`` (any attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS`` with
    ``self.config._attn_implementation``) run MLR attention of ``geometry``. Its parameters are untouched. Its
    ``scaling`` and query groups (``num_key_value_groups``) are read now: the model's layers are installed when it is
    built (``post_init``), and the model keeps what it installed (``StructAttnPreTrainedMixin``)."""
    config = module.config
    if isinstance(config, LayerConfigView):
        config = config.base_config
    scaling = getattr(module, "scaling", None)
    module.config = MLRLayerConfig(config, geometry, None if scaling is None else float(scaling),
                                   int(getattr(module, "num_key_value_groups", 1)))


def mlr_geometry_of(module: torch.nn.Module) -> Optional[MLRGeometry]:
    config = getattr(module, "config", None)
    return config.mlr_geometry if isinstance(config, MLRLayerConfig) else None


# How an attention module of a stock model whose config carries MLR fields (a stock checkpoint loaded with
# ``attn_implementation="mlr"``) gets its geometry on its first call: the resolvers ``structattn_decoder_spec``
# registers when it is imported. A registry, like transformers' attention interface: a checkpoint whose layers are
# installed when it is built (GPT-2, T5) runs no stock module and ships without the decoder spec.
STOCK_GEOMETRY_RESOLVERS: list = []


__all__ = ["LayerConfigView", "MLRLayerConfig", "MLR_ATTENTION", "MLR_EAGER_ATTENTION", "STOCK_GEOMETRY_RESOLVERS",
           "install_mlr_attention", "mlr_geometry_of", "mlr_implementation"]
