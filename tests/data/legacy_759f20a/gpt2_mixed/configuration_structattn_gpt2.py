"""Configuration of GPT-2-style models with structured attention."""

from typing import Optional, Union

from transformers import PreTrainedConfig
# transformers' own re-export of huggingface_hub's `strict` keeps the payload's imports to torch/transformers
from transformers.configuration_utils import strict

from .structattn_bilinear import validate_bilinear_fields
from .structattn_geometry import (
    MLR_SCALINGS,
    StructAttnConfigMixin,
    check_int,
    default_block_sizes,
    is_positive_scale,
    resolve_level_scales,
    validate_config_numbers,
    validate_mlr_geometry,
)

ATTENTION_VARIANTS = ("dense", "mlr", "bilinear_mlr", "bilinear_btt", "swa")
PAPER_MLR_RANKS_64 = [32, 8, 6, 4, 4, 4, 4, 2]
QK_NORMS = ("layernorm", "rms")


def check_attention_variant(value, field: str) -> None:
    if value not in ATTENTION_VARIANTS:
        raise ValueError(f"{field}={value!r} is not one of {ATTENTION_VARIANTS}")


@strict
class StructAttnGPT2Config(StructAttnConfigMixin, PreTrainedConfig):
    r"""GPT-2 architecture (same field names) whose attention is dense, MLR, bilinear MLR, bilinear BTT or SWA.

    Structured-attention fields:
        attention: variant of every layer: "dense", "mlr", "bilinear_mlr", "bilinear_btt" or "swa".
        attention_layers: optional per-layer list overriding ``attention`` (e.g. the paper's global + SWA stack
            ``["dense", "swa", "swa", "dense", "swa", "swa"]``).
        mlr_ranks: per-level ranks r_1..r_L summing to the head dim (default for head dim 64: 32|8|6|4|4|4|4|2).
        mlr_block_sizes: block sizes of levels 2..L (default dyadic from ``n_positions``: n/2, n/4, ...).
        mlr_scaling: "standard" (1/sqrt(r) on every level), "mup" (1/r_l, the authors' choice), or explicit
            per-level floats.
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
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    use_cache: bool = True
    bos_token_id: Optional[int] = 50256
    eos_token_id: Optional[Union[int, list[int]]] = 50256
    pad_token_id: Optional[int] = None
    tie_word_embeddings: bool = True

    attention: str = "dense"
    attention_layers: Optional[list[str]] = None
    mlr_ranks: Optional[list[int]] = None
    mlr_block_sizes: Optional[list[int]] = None
    mlr_scaling: Union[str, float, list[float]] = "standard"
    mlr_average_levels: bool = False
    qk_layernorm: bool = False
    qk_norm: str = "layernorm"
    dense_scaling: Union[str, float] = "standard"
    bilinear_mlr_ranks: Optional[list[int]] = None
    bilinear_scaling: str = "standard"
    bilinear_scale_constant: float = 1.0
    bilinear_weight_rms_clamp: bool = False
    btt_rank: int = 1
    btt_factors: Optional[list[int]] = None
    sliding_window: Optional[int] = None
    icl_input_dim: Optional[int] = None

    def __post_init__(self, **kwargs):
        self._validate_structured_attention()  # a plain ValueError at construction
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def layer_attention(self, layer_idx: int) -> str:
        return self.attention_layers[layer_idx] if self.attention_layers is not None else self.attention

    @property
    def resolved_mlr_ranks(self) -> list[int]:
        return list(self.mlr_ranks) if self.mlr_ranks is not None else list(PAPER_MLR_RANKS_64)

    @property
    def resolved_mlr_block_sizes(self) -> list[int]:
        if self.mlr_block_sizes is not None:
            return list(self.mlr_block_sizes)
        return default_block_sizes(self.n_positions, len(self.resolved_mlr_ranks))

    def cache_layer_specs(self) -> list[dict]:
        """Per-layer description for ``StructAttnCache``."""
        specs = []
        for layer_idx in range(self.n_layer):
            variant = self.layer_attention(layer_idx)
            spec = {"attention": variant}
            if variant == "mlr":
                spec.update(ranks=self.resolved_mlr_ranks, block_sizes=self.resolved_mlr_block_sizes)
            elif variant == "swa":
                spec.update(sliding_window=self.sliding_window)
            specs.append(spec)
        return specs

    def _validate_structured_attention(self) -> None:
        validate_config_numbers(self, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
                                ("layer_norm_epsilon", "initializer_range", "resid_pdrop", "embd_pdrop", "attn_pdrop"))
        if self.n_inner is not None:
            validate_config_numbers(self, ("n_inner",))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        check_attention_variant(self.attention, "attention")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not one of {QK_NORMS}")
        if isinstance(self.dense_scaling, str) and self.dense_scaling not in MLR_SCALINGS:
            raise ValueError(f"dense_scaling={self.dense_scaling!r} is not one of {MLR_SCALINGS} or a number")
        if not isinstance(self.dense_scaling, str) and not is_positive_scale(self.dense_scaling):
            raise ValueError(f"dense_scaling={self.dense_scaling!r} must be 'standard', 'mup' or a finite number > 0")
        if not is_positive_scale(self.bilinear_scale_constant):
            raise ValueError(f"bilinear_scale_constant={self.bilinear_scale_constant!r} must be a finite number > 0")
        if self.attention_layers is not None:
            if len(self.attention_layers) != self.n_layer:
                raise ValueError(f"attention_layers has {len(self.attention_layers)} entries but n_layer={self.n_layer}")
            for variant in self.attention_layers:
                check_attention_variant(variant, "attention_layers")
        variants = set(self.attention_layers or [self.attention])
        if "mlr" in variants and self.attn_pdrop:
            raise ValueError(f"attn_pdrop={self.attn_pdrop} is not supported by MLR layers (the exact fused path "
                             f"never forms the attention probabilities); set attn_pdrop=0")
        if "mlr" in variants:
            if self.mlr_ranks is None and self.head_dim != 64:
                raise ValueError(f"mlr_ranks is required for attention='mlr' when the head dim is not 64 "
                                 f"(head dim {self.head_dim})")
            ranks = self.resolved_mlr_ranks
            if self.mlr_block_sizes is None:
                try:
                    default_block_sizes(self.n_positions, len(ranks))
                except ValueError as error:
                    raise ValueError(f"mlr_block_sizes: {error}") from None
            validate_mlr_geometry(ranks, self.resolved_mlr_block_sizes, self.head_dim, "mlr_ranks",
                                  "mlr_block_sizes")
            resolve_level_scales(ranks, self.mlr_scaling, "mlr_scaling")
        validate_bilinear_fields(self, variants, self.n_embd, self.n_head, hidden_field="n_embd")
        if "swa" in variants:
            check_int("sliding_window", self.sliding_window)


__all__ = ["StructAttnGPT2Config"]
