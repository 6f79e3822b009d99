"""How a layer gets this package's attention functions: ``install_mlr_attention(module, geometry)`` and
``install_bilinear_attention(module)`` replace the attention module's ``config`` by a view of the model's config
(``MLRLayerConfig``, ``BilinearLayerConfig``) whose ``_attn_implementation`` names the function of the same kind that
``structattn_attention`` registers in transformers' ``AttentionInterface``; the module's own forward then dispatches
through ``ALL_ATTENTION_FUNCTIONS`` exactly as it would for SDPA. Part of the checkpoint payload."""

from typing import Optional

import torch

from .structattn_geometry import MLRGeometry

MLR_ATTENTION = "mlr"
MLR_EAGER_ATTENTION = "mlr_eager"
BILINEAR_ATTENTION = "bilinear"
BILINEAR_EAGER_ATTENTION = "bilinear_eager"


def mlr_implementation(implementation: Optional[str]) -> str:
    """The MLR attention function standing in for a transformers attention implementation name."""
    return MLR_EAGER_ATTENTION if implementation in ("eager", MLR_EAGER_ATTENTION) else MLR_ATTENTION


class _LayerConfigView:
    """The config a layer's attention module reads: every attribute is the model's (stack's) config's, read live,
    except ``_attn_implementation``, which names this package's function of the same kind (``implementation``).
    Writes go to the model's config."""

    def __init__(self, config):
        self.__dict__["_structattn_base"] = config  # past __setattr__, which writes through to the base

    @staticmethod
    def implementation(name: Optional[str]) -> str:
        raise NotImplementedError

    @property
    def base_config(self):
        return self._structattn_base

    @property
    def _attn_implementation(self) -> str:
        name = self._structattn_base._attn_implementation
        mapped = self.__dict__.get("_structattn_mapped")  # (the model's name, this package's): every step asks
        if mapped is None or mapped[0] != name:
            mapped = self.__dict__["_structattn_mapped"] = (name, self.implementation(name))
        return mapped[1]

    def __getattr__(self, name: str):
        # only called for names not found on the view itself
        if name.startswith("__") or name == "_structattn_base":  # copy/pickle protocol: never the base's
            raise AttributeError(name)
        return getattr(self._structattn_base, name)

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


class MLRLayerConfig(_LayerConfigView):
    """The config an MLR layer's attention module reads (``_LayerConfigView``): ``_attn_implementation`` names the MLR
    function of the same kind (``mlr_implementation``), and ``mlr_geometry`` is the layer's ``MLRGeometry``."""

    implementation = staticmethod(mlr_implementation)

    def __init__(self, config, geometry: MLRGeometry):
        super().__init__(config)
        self.__dict__["mlr_geometry"] = geometry

    def _extra(self) -> tuple:
        return (self.mlr_geometry,)


def bilinear_implementation(implementation: Optional[str]) -> str:
    """The bilinear attention function standing in for a transformers attention implementation name."""
    return BILINEAR_EAGER_ATTENTION if implementation in ("eager", BILINEAR_EAGER_ATTENTION) else BILINEAR_ATTENTION


class BilinearLayerConfig(_LayerConfigView):
    """The config a bilinear MLR / BTT layer's attention module reads (``_LayerConfigView``): ``_attn_implementation``
    names the bilinear function of the same kind (their query/key width differs from the value width, which
    transformers' functions do not take)."""

    implementation = staticmethod(bilinear_implementation)


def install_bilinear_attention(module: torch.nn.Module) -> None:
    """Make ``module`` (an attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS``, whose structured
    queries carry the logit scales) run the bilinear attention functions."""
    config = module.config
    if isinstance(config, _LayerConfigView):
        config = config.base_config
    module.config = BilinearLayerConfig(config)


_INSTALLATIONS = [0]


def installations() -> int:
    """How many times MLR attention was installed in this process (models memoise what they find installed)."""
    return _INSTALLATIONS[0]


def install_mlr_attention(module: torch.nn.Module, geometry: MLRGeometry) -> None:
    """Make ``module`` (any attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS`` with
    ``self.config._attn_implementation``) run MLR attention of ``geometry``. Its parameters are untouched."""
    config = module.config
    if isinstance(config, _LayerConfigView):
        config = config.base_config
    module.config = MLRLayerConfig(config, geometry)
    _INSTALLATIONS[0] += 1


def mlr_geometry_of(module: torch.nn.Module) -> Optional[MLRGeometry]:
    config = getattr(module, "config", None)
    return config.mlr_geometry if isinstance(config, MLRLayerConfig) else None


__all__ = ["BILINEAR_ATTENTION", "BILINEAR_EAGER_ATTENTION", "BilinearLayerConfig", "MLRLayerConfig", "MLR_ATTENTION",
           "MLR_EAGER_ATTENTION", "bilinear_implementation", "install_bilinear_attention", "install_mlr_attention",
           "installations", "mlr_geometry_of", "mlr_implementation"]
