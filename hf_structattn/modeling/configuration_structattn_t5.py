"""Configuration of T5-style encoder-decoder models with structured attention (T5's field names)."""

from typing import Optional, Union

from transformers import T5Config
# transformers' own re-export of huggingface_hub's `strict` keeps the payload's imports to torch/transformers
from transformers.configuration_utils import strict

from .configuration_structattn_keywords import ConfigKeywordsMixin, refuse_unknown_keywords
from .structattn_bilinear import validate_bilinear_fields
from .structattn_config_rules import (
    StructAttnConfigMixin,
    announce_config,
    check_ranks,
    default_block_sizes,
    one_line_field_errors,
    validate_config_numbers,
)
from .structattn_geometry import MLRGeometry

T5_ATTENTION_VARIANTS = ("dense", "mlr", "bilinear_mlr", "bilinear_btt")
T5_ATTENTION_ROLES = {"encoder_self": "encoder_attention", "decoder_self": "decoder_attention",
                      "cross": "cross_attention"}
# fields that describe the structured attention (recorded by the patcher, re-applied to Chronos-Bolt on reload)
T5_STRUCTATTN_FIELDS = ("encoder_attention", "decoder_attention", "cross_attention", "mlr_ranks", "mlr_block_sizes",
                        "mlr_max_length", "mlr_scaling", "mlr_average_levels", "bilinear_mlr_ranks",
                        "bilinear_scaling", "btt_rank", "btt_factors")


@one_line_field_errors
@strict
class StructAttnT5Config(ConfigKeywordsMixin, StructAttnConfigMixin, T5Config):
    r"""T5 architecture (same fields as ``transformers.T5Config``) whose attention is chosen per role.

    Structured-attention fields:
        encoder_attention, decoder_attention, cross_attention: "dense", "mlr", "bilinear_mlr" or "bilinear_btt"
            for encoder self-attention, decoder self-attention and decoder->encoder cross-attention. MLR is
            refused for cross-attention: its blocks are distances within one sequence, and a decoder and an
            encoder position have no common axis.
        mlr_ranks: per-level ranks r_1..r_L summing to ``d_kv`` (required for any MLR role).
        mlr_block_sizes: block sizes of levels 2..L (default dyadic from ``mlr_max_length``: n/2, n/4, ...).
        mlr_max_length: the training length the default blocks are derived from (never the current input's length).
        mlr_scaling: per-level logit multipliers; default 1.0 because T5 has no 1/sqrt(d) (it is folded into the
            init), "standard" (1/sqrt(d_kv)), "mup" (1/r_l) or a list of floats are accepted too.
        mlr_average_levels: divide each logit by the number of levels the pair shares.
        bilinear_mlr_ranks: per-level ranks of bilinear MLR (level l splits d_model into 2^(l-1) chunks).
        bilinear_scaling: "standard" (1/sqrt(width)) or "mup" (1/width) for the bilinear variants.
        btt_rank, btt_factors: BTT rank s and factors (a, b, c, d) with a*b = c*d = d_model (default balanced).
        structattn_patch: provenance written by ``hf_structattn.patch`` (source class, level-split init).

    A keyword that is not a field (nor a key transformers itself reads, nor Chronos' ``chronos_config`` /
    ``chronos_pipeline_class``) is refused with the field it resembles (``mlr_rnaks`` -> did you mean 'mlr_ranks');
    a config.json read by ``from_pretrained`` (or another T5 checkpoint's config converted by ``patch``) keeps its
    other keys as attributes, and they survive save/load (``configuration_structattn_keywords``).
    """

    model_type = "structattn_t5"

    # T5Config's float fields, taking ints too (a hand-written config.json says 1 for 1.0)
    layer_norm_epsilon: Union[float, int] = 1e-6
    initializer_factor: Union[float, int] = 1.0
    encoder_attention: str = "dense"
    decoder_attention: str = "dense"
    cross_attention: str = "dense"
    mlr_ranks: Optional[list[int]] = None
    mlr_block_sizes: Optional[list[int]] = None
    mlr_max_length: int = 512
    mlr_scaling: Union[str, float, int, list[Union[float, int]]] = 1.0
    mlr_average_levels: bool = False
    bilinear_mlr_ranks: Optional[list[int]] = None
    bilinear_scaling: str = "standard"
    btt_rank: int = 1
    btt_factors: Optional[list[int]] = None
    structattn_patch: Optional[dict] = None

    # T5Config reads tie_word_embeddings and writes the derived three; Chronos checkpoints carry the last two
    accepted_keywords = ("tie_word_embeddings", "dense_act_fn", "is_gated_act", "scale_decoder_outputs",
                         "chronos_config", "chronos_pipeline_class")

    def __post_init__(self, **kwargs):
        refuse_unknown_keywords(self, kwargs)
        super().__post_init__(**kwargs)
        self._validate_structured_attention()  # a plain ValueError at construction
        announce_config(self)

    def get_text_config(self, decoder=None, encoder=None):
        """transformers' view of one side of this flat encoder-decoder config. For one side it copies the config and
        renames the ``decoder_*`` (or ``encoder_*``) fields without their prefix, which would turn
        ``decoder_attention`` into an unknown ``attention`` and leave this class's default in its place: the
        structured-attention fields are kept as they are."""
        text = super().get_text_config(decoder=decoder, encoder=encoder)
        if text is not self:
            text.__dict__.pop("attention", None)
            for name in T5_ATTENTION_ROLES.values():
                setattr(text, name, getattr(self, name))
        return text

    def role_attention(self, role: str) -> str:
        """Variant of ``role`` ("encoder_self", "decoder_self" or "cross")."""
        return getattr(self, T5_ATTENTION_ROLES[role])

    @property
    def resolved_mlr_block_sizes(self) -> list[int]:
        if self.mlr_block_sizes is not None:
            return list(self.mlr_block_sizes)
        return default_block_sizes(self.mlr_max_length, len(self.mlr_ranks))

    def mlr_geometry(self) -> MLRGeometry:
        """The ``MLRGeometry`` of this config's MLR roles."""
        return MLRGeometry.build(self.mlr_ranks, self.resolved_mlr_block_sizes, self.mlr_scaling, head_dim=self.d_kv,
                                 average_levels=self.mlr_average_levels)

    def attention_spec(self, role: str) -> dict:
        """What a bilinear attention module of ``role`` needs (a plain dict: no config class travels with it)."""
        variant = self.role_attention(role)
        spec = {"attention": variant, "causal": role == "decoder_self"}
        if variant == "bilinear_mlr":
            spec.update(ranks=list(self.bilinear_mlr_ranks), scaling=self.bilinear_scaling)
        elif variant == "bilinear_btt":
            spec.update(rank=self.btt_rank, factors=list(self.btt_factors) if self.btt_factors else None,
                        scaling=self.bilinear_scaling)
        return spec

    def mlr_layer_geometries(self) -> dict:
        """{decoder layer index: MLRGeometry} of MLR decoder self-attention (whose cache is hierarchical)."""
        if self.decoder_attention != "mlr":
            return {}
        geometry = self.mlr_geometry()
        layers = self.num_decoder_layers if self.num_decoder_layers is not None else self.num_layers
        return {index: geometry for index in range(layers)}

    def _validate_structured_attention(self) -> None:
        validate_config_numbers(self, ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                                       "relative_attention_num_buckets", "relative_attention_max_distance"),
                                ("layer_norm_epsilon", "dropout_rate", "initializer_factor"))
        if self.num_decoder_layers is not None:
            validate_config_numbers(self, ("num_decoder_layers",))
        for role, field in T5_ATTENTION_ROLES.items():
            value = getattr(self, field)
            if value not in T5_ATTENTION_VARIANTS:
                raise ValueError(f"{field}={value!r} is not one of {T5_ATTENTION_VARIANTS}")
        if self.cross_attention == "mlr":
            raise ValueError("cross_attention='mlr' is not supported: MLR blocks group positions of one sequence, "
                             "and a decoder position and an encoder position share no block; use 'dense', "
                             "'bilinear_mlr' or 'bilinear_btt' for cross_attention")
        variants = {self.encoder_attention, self.decoder_attention, self.cross_attention}
        if "mlr" in variants:
            if self.mlr_ranks is None:
                raise ValueError(f"mlr_ranks is required when an attention role is 'mlr' (ranks summing to "
                                 f"d_kv={self.d_kv})")
            ranks = check_ranks(self.mlr_ranks, "mlr_ranks")
            if self.mlr_block_sizes is None:
                try:
                    default_block_sizes(self.mlr_max_length, len(ranks), "mlr_max_length")
                except ValueError as error:
                    raise ValueError(f"mlr_block_sizes / mlr_max_length: {error}") from None
            self.mlr_geometry()
        validate_bilinear_fields(self, variants, self.d_model, self.num_heads, hidden_field="d_model")


__all__ = ["StructAttnT5Config"]
