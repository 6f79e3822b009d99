"""Configuration of GPT-2-style models with structured attention."""

from typing import Optional, Union

from transformers import PreTrainedConfig
# transformers' own re-export of huggingface_hub's `strict` keeps the payload's imports to torch/transformers
from transformers.configuration_utils import strict

from .configuration_structattn_keywords import ConfigKeywordsMixin, refuse_unknown_keywords
from .structattn_bilinear import validate_bilinear_fields
from .structattn_config_rules import (
    ATTENTION_KINDS,
    KIND_VARIANTS,
    MLR_ATTENTION,
    MLR_SCALINGS,
    StructAttnConfigMixin,
    VARIANT_KINDS,
    announce_config,
    check_int,
    default_block_sizes,
    is_positive_scale,
    one_line_field_errors,
    validate_config_numbers,
)
from .structattn_geometry import MLRGeometry

ATTENTION_VARIANTS = ("dense", "mlr", "bilinear_mlr", "bilinear_btt", "swa")
GPT2_SPECIAL_TOKEN_ID = 50256
PAPER_MLR_RANKS_64 = [32, 8, 6, 4, 4, 4, 4, 2]
QK_NORMS = ("layernorm", "rms")


def check_attention_variant(value, field: str) -> None:
    if value not in ATTENTION_VARIANTS:
        raise ValueError(f"{field}={value!r} is not one of {ATTENTION_VARIANTS}")


@one_line_field_errors
@strict
class StructAttnGPT2Config(ConfigKeywordsMixin, StructAttnConfigMixin, PreTrainedConfig):
    r"""GPT-2 architecture (same field names) whose attention is dense, MLR, bilinear MLR, bilinear BTT or SWA.

    Structured-attention fields:
        attention: variant of the layers ``layer_types`` does not name: "dense", "mlr", "bilinear_mlr",
            "bilinear_btt" or "swa".
        layer_types: per-layer attention in transformers' vocabulary: "full_attention" (dense), "mlr_attention",
            "sliding_attention" (SWA), "bilinear_mlr_attention", "bilinear_btt_attention" (e.g. the paper's global +
            SWA stack ``["full_attention", "sliding_attention", "sliding_attention", ...]``). Filled from
            ``attention`` when not given; ``DynamicCache(config=...)`` and ``StaticCache`` build an MLR key-cache
            layer for every "mlr_attention" entry. Configs saved with the older ``attention_layers`` (short variant
            names) are read into ``layer_types``.
        mlr_ranks: per-level ranks r_1..r_L summing to the head dim (default for head dim 64: 32|8|6|4|4|4|4|2).
        mlr_block_sizes: block sizes of levels 2..L (default dyadic from ``n_positions``: n/2, n/4, ...).
        mlr_scaling: "standard" (1/sqrt(r) on every level), "mup" (1/r_l, the authors' choice), or explicit
            per-level numbers (ints are numbers too).
        mlr_average_levels: divide each logit by the number of levels the pair shares (the authors' LM runs).
        qk_layernorm: normalise queries and keys (the kind is ``qk_norm``).
        qk_norm: "layernorm" (default, and what every config saved before this field existed used: LayerNorm
            per head for dense/MLR/SWA, per level for bilinear MLR, on x and on M_h x for BTT) or "rms" (RMSNorm
            with a learned gain over the whole head: width r for dense/MLR/SWA, all levels together for bilinear
            MLR, D for BTT). LayerNorm removes the mean direction of each normalised slice and a width-1 or
            width-2 slice collapses to a constant or a sign, so per-level LayerNorm loses rank; RMSNorm over the
            whole head keeps the rank of the score form (``hf_structattn.diagnostics.effective_rank``).
        dense_scaling: logit multiplier of dense and SWA layers: "standard" (1/sqrt(r)), "mup" (1/r, paper App. E)
            or an explicit number (the authors' code uses 8/r). Ignored when ``scale_attn_weights`` is false.
        bilinear_mlr_ranks: per-level ranks of bilinear MLR (level l splits the features into 2^(l-1) chunks).
        bilinear_scaling: "standard" (1/sqrt(width) of each level / of D) or "mup" (1/width).
        bilinear_scale_constant: the tunable constant C (C*) of App. E multiplying every bilinear logit scale.
        bilinear_weight_rms_clamp: the authors' RMS weight normalisation of the bilinear factors (App. E, "for
            training stability"): a factor W of fan-in n and fan-out m is used as ``W / max(1, rms(W) / tau)``
            with ``tau = sqrt(min(n, m)) / n``. Part of muP (``mup_config_overrides``); off by default.
        btt_rank, btt_factors: BTT rank s and factors (a, b, c, d) with a*b = c*d = n_embd (default: balanced).
        sliding_window: window w of "swa" layers: query i sees the w keys j with 0 <= i - j < w (itself and the
            w - 1 before it; transformers' convention). The paper's T' and the authors' code (keys i - T' .. i)
            see T' + 1 keys, so their window T' is ``sliding_window = T' + 1``.
        attn_pdrop: attention-probability dropout (default 0; must be 0 when a layer is MLR).
        icl_input_dim: input dimension of the in-context regression head.

    A keyword that is not a field (nor a key transformers itself reads) is refused with the field it resembles
    (``mlr_rnaks`` -> did you mean 'mlr_ranks'); a config.json read by ``from_pretrained`` keeps such keys as
    attributes, as transformers does (``configuration_structattn_keywords``).
    """

    model_type = "structattn_gpt2"
    keys_to_ignore_at_inference = ["cache"]
    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    resid_pdrop: Union[float, int] = 0.1
    embd_pdrop: Union[float, int] = 0.1
    attn_pdrop: Union[float, int] = 0.0
    layer_norm_epsilon: Union[float, int] = 1e-5
    initializer_range: Union[float, int] = 0.02
    scale_attn_weights: bool = True
    use_cache: bool = True
    bos_token_id: Optional[int] = 50256
    eos_token_id: Optional[Union[int, list[int]]] = 50256
    pad_token_id: Optional[int] = None
    tie_word_embeddings: bool = True

    attention: str = "dense"
    layer_types: Optional[list[str]] = None
    mlr_ranks: Optional[list[int]] = None
    mlr_block_sizes: Optional[list[int]] = None
    mlr_scaling: Union[str, float, int, list[Union[float, int]]] = "standard"
    mlr_average_levels: bool = False
    qk_layernorm: bool = False
    qk_norm: str = "layernorm"
    dense_scaling: Union[str, float, int] = "standard"
    bilinear_mlr_ranks: Optional[list[int]] = None
    bilinear_scaling: str = "standard"
    bilinear_scale_constant: Union[float, int] = 1.0
    bilinear_weight_rms_clamp: bool = False
    btt_rank: int = 1
    btt_factors: Optional[list[int]] = None
    sliding_window: Optional[int] = None
    icl_input_dim: Optional[int] = None

    accepted_keywords = ("attention_layers",)  # the older name of layer_types, migrated below

    def __post_init__(self, **kwargs):
        refuse_unknown_keywords(self, kwargs)
        legacy = kwargs.pop("attention_layers", None)  # configs saved before layer_types: short variant names
        if legacy is not None and self.layer_types is None:
            for variant in legacy:
                check_attention_variant(variant, "attention_layers")
            if len(legacy) != self.n_layer:
                raise ValueError(f"attention_layers has {len(legacy)} entries but n_layer={self.n_layer}")
            self.layer_types = [VARIANT_KINDS[variant] for variant in legacy]
        if self.layer_types is None and self.attention in VARIANT_KINDS:
            self.layer_types = [VARIANT_KINDS[self.attention]] * self.n_layer
        # GPT-2's special tokens do not exist in a smaller vocabulary (a byte-level model, say)
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(self, name) == GPT2_SPECIAL_TOKEN_ID and self.vocab_size <= GPT2_SPECIAL_TOKEN_ID:
                setattr(self, name, None)
        self._validate_structured_attention()  # a plain ValueError at construction
        super().__post_init__(**kwargs)
        announce_config(self)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def layer_attention(self, layer_idx: int) -> str:
        """Short variant name of a layer ("dense", "mlr", "swa", "bilinear_mlr", "bilinear_btt")."""
        return KIND_VARIANTS[self.layer_types[layer_idx]]

    @property
    def resolved_mlr_ranks(self) -> list[int]:
        return list(self.mlr_ranks) if self.mlr_ranks is not None else list(PAPER_MLR_RANKS_64)

    @property
    def resolved_mlr_block_sizes(self) -> list[int]:
        if self.mlr_block_sizes is not None:
            return list(self.mlr_block_sizes)
        return default_block_sizes(self.n_positions, len(self.resolved_mlr_ranks))

    def mlr_geometry(self) -> MLRGeometry:
        """The ``MLRGeometry`` of this config's MLR layers (ranks, blocks, level scales, averaging)."""
        scaling = self.mlr_scaling
        if scaling == "standard" and not self.scale_attn_weights:
            scaling = 1.0
        return MLRGeometry.build(self.resolved_mlr_ranks, self.resolved_mlr_block_sizes, scaling,
                                 head_dim=self.head_dim, average_levels=self.mlr_average_levels)

    def mlr_layer_geometries(self) -> dict:
        """{layer index: MLRGeometry} of the MLR layers."""
        kinds = self.layer_types or []
        if MLR_ATTENTION not in kinds:
            return {}
        geometry = self.mlr_geometry()
        return {index: geometry for index, kind in enumerate(kinds) if kind == MLR_ATTENTION}

    def validate_layer_type(self):
        """``layer_types`` holds one of this family's attention kinds per layer."""
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.n_layer:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but n_layer={self.n_layer}")
        for kind in self.layer_types:
            if kind not in ATTENTION_KINDS:
                raise ValueError(f"layer_types entry {kind!r} is not one of {ATTENTION_KINDS}")

    def _validate_structured_attention(self) -> None:
        validate_config_numbers(self, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
                                ("layer_norm_epsilon", "initializer_range", "resid_pdrop", "embd_pdrop", "attn_pdrop"))
        if self.n_inner is not None:
            validate_config_numbers(self, ("n_inner",))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        check_attention_variant(self.attention, "attention")
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a dropout probability in [0, 1]")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not one of {QK_NORMS}")
        if isinstance(self.dense_scaling, str) and self.dense_scaling not in MLR_SCALINGS:
            raise ValueError(f"dense_scaling={self.dense_scaling!r} is not one of {MLR_SCALINGS} or a number")
        if not isinstance(self.dense_scaling, str) and not is_positive_scale(self.dense_scaling):
            raise ValueError(f"dense_scaling={self.dense_scaling!r} must be 'standard', 'mup' or a finite number > 0")
        if not is_positive_scale(self.bilinear_scale_constant):
            raise ValueError(f"bilinear_scale_constant={self.bilinear_scale_constant!r} must be a finite number > 0")
        self.validate_layer_type()
        variants = {KIND_VARIANTS[kind] for kind in self.layer_types or []}
        if "mlr" in variants and self.attn_pdrop:
            raise ValueError(f"attn_pdrop={self.attn_pdrop} is not supported by MLR layers (the exact fused path "
                             f"never forms the attention probabilities); set attn_pdrop=0")
        if "mlr" in variants:
            if self.mlr_ranks is None and self.head_dim != 64:
                raise ValueError(f"mlr_ranks is required for attention='mlr' when the head dim is not 64 "
                                 f"(head dim {self.head_dim})")
            if self.mlr_block_sizes is None:
                try:
                    default_block_sizes(self.n_positions, len(self.resolved_mlr_ranks))
                except ValueError as error:
                    raise ValueError(f"mlr_block_sizes: {error}") from None
            self.mlr_geometry()
        validate_bilinear_fields(self, variants, self.n_embd, self.n_head, hidden_field="n_embd")
        if "swa" in variants:
            check_int("sliding_window", self.sliding_window)


__all__ = ["StructAttnGPT2Config"]
