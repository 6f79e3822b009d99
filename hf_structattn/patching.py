"""Convert pretrained T5 / Chronos-T5 / Chronos-Bolt models to structured (MLR) attention (docs/patching.md).

``patch`` converts, it does not monkey-patch the caller's object: it returns a new model (or pipeline) whose
pretrained weights are kept under the same state-dict names, whose config records the structured-attention
spec, and which saves with the payload code. The original is left untouched so ``patch_report`` can compare.

* ``T5ForConditionalGeneration`` (also a Chronos-T5 inner model) -> ``StructAttnT5ForConditionalGeneration``
  (model_type ``structattn_t5``; reloads with ``trust_remote_code=True`` and through
  ``ChronosPipeline.from_pretrained(dir, trust_remote_code=True)``).
* ``ChronosPipeline`` -> a ``ChronosPipeline`` around the converted inner model.
* Chronos-Bolt (``ChronosBoltPipeline`` or ``ChronosBoltModelForForecasting``) ->
  ``StructAttnChronosBoltModelForForecasting`` (model_type ``structattn_chronos_bolt``), a subclass that Chronos
  finds by name: it reloads as MLR through ``BaseChronosPipeline.from_pretrained(dir, trust_remote_code=True)``
  (see ``modeling/modeling_structattn_chronos_bolt.py``).

Chronos models have a fixed context, so their block sizes can be given in time steps (``mlr_block_steps``;
Bolt's encoder tokens are patches of ``input_patch_stride`` steps) and blocks that cover the whole sequence of
every patched role are refused: such a level is the global level again, and a patch made only of those is the
dense model (``allow_identity=True`` asks for that on purpose).

Level split of pretrained q/k (``init``):
* ``"split"``: the first r_1 dims of each head are level 1, the next r_2 level 2, ...
* ``"svd"``: per head, re-factor ``A_h = W_Q,h W_K,h^T`` (D x D, rank d_kv) through its SVD
  ``A_h = P S Q^T``: ``W_Q,h <- P S^{1/2}``, ``W_K,h <- Q S^{1/2}``. This is ``W_Q,h G`` and ``W_K,h G^{-T}`` for an
  invertible d x d ``G`` (an orthogonal ``G`` when q and k already have matched scales), so every q.k, hence
  dense attention, is unchanged; and the first r_1 coordinates now carry the r_1 strongest singular directions,
  so the global level is the best rank-r_1 approximation of the head's score matrix (Eckart-Young).
"""

import difflib
import inspect
import math
from typing import NamedTuple, Optional, Sequence

import torch

from .modeling.modeling_structattn_chronos_bolt import StructAttnChronosBoltConfig
from .modeling.configuration_structattn_t5 import T5_ATTENTION_ROLES, T5_STRUCTATTN_FIELDS, StructAttnT5Config
from .modeling.modeling_structattn_chronos_bolt import bolt_model_class
from .modeling.modeling_structattn_t5 import StructAttnT5ForConditionalGeneration
from .conversion import convert_model
from .modeling.structattn_attention import mlr_geometry_of

PATCH_TARGETS = tuple(T5_ATTENTION_ROLES)
PATCH_ATTENTIONS = ("mlr",)
INITS = ("split", "svd")
_DROP_KEYS = ("model_type", "transformers_version", "auto_map", "architectures", "_name_or_path")
_PATCHED_MODEL_TYPES = (StructAttnT5Config.model_type, StructAttnChronosBoltConfig.model_type)
_NO_TIME_AXIS = ("mlr_block_steps counts time steps of a Chronos model's context; this model has no time axis: give "
                 "mlr_block_sizes (tokens)")


def _chronos_classes():
    try:
        from chronos import ChronosPipeline
        from chronos.chronos import ChronosModel
        from chronos.chronos_bolt import ChronosBoltModelForForecasting, ChronosBoltPipeline
    except ImportError:
        return None
    return ChronosPipeline, ChronosModel, ChronosBoltPipeline, ChronosBoltModelForForecasting


def _kind(obj) -> str:
    return _kind_and_model(obj)[0]


def _kind_and_model(obj):
    """("t5" | "chronos_t5" | "chronos_bolt_pipeline" | "chronos_bolt", the transformers model inside ``obj``);
    ValueError for anything else, including a model that already has structured attention."""
    kind, model = None, None
    classes = _chronos_classes()
    if classes is not None:
        chronos_pipeline, _, bolt_pipeline, bolt_model = classes
        if isinstance(obj, chronos_pipeline):
            kind, model = "chronos_t5", obj.model.model
        elif isinstance(obj, bolt_pipeline):
            kind, model = "chronos_bolt_pipeline", obj.model
        elif isinstance(obj, bolt_model):
            kind, model = "chronos_bolt", obj
    if kind is None:
        from transformers import T5ForConditionalGeneration

        if not isinstance(obj, T5ForConditionalGeneration):
            raise ValueError(f"patch accepts a transformers.T5ForConditionalGeneration, a chronos.ChronosPipeline, a "
                             f"ChronosBoltPipeline or a ChronosBoltModelForForecasting; got {type(obj).__name__}")
        kind, model = "t5", obj
    if model.config.model_type in _PATCHED_MODEL_TYPES:
        raise ValueError(f"this model already has structured attention (model_type {model.config.model_type!r}); "
                         f"patch the original checkpoint instead")
    return kind, model


def check_keywords(given, known, kind: str) -> None:
    """One-line error for a keyword ``patch`` does not take for this kind of model, with the closest known one:
    among the config fields ``known`` and ``patch``'s own keywords (``targets``, ``init``, ``allow_identity``, ...)."""
    own = [name for name, parameter in inspect.signature(patch).parameters.items()
           if name != "obj" and parameter.kind is not parameter.VAR_KEYWORD]
    known = sorted(set(known) | set(own))
    for name in sorted(set(given) - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"patch: unknown keyword {name!r} for {kind}{hint}; known: {', '.join(sorted(known))}")


def _structattn_fields(attention: str, targets: Sequence[str], variant_fields: dict) -> dict:
    if attention not in PATCH_ATTENTIONS:
        raise ValueError(f"attention={attention!r}: patch supports {PATCH_ATTENTIONS} (the bilinear variants replace "
                         f"W_Q/W_K by new structured parameters, so no pretrained weight could be kept; build a "
                         f"StructAttnT5Config with them and train instead)")
    targets = tuple(targets)
    if not targets:
        raise ValueError("targets must name at least one of " + ", ".join(PATCH_TARGETS))
    for target in targets:
        if target not in PATCH_TARGETS:
            raise ValueError(f"targets: {target!r} is not one of {PATCH_TARGETS}")
    check_keywords(variant_fields, T5_STRUCTATTN_FIELDS, "T5 / Chronos models")
    fields = {T5_ATTENTION_ROLES[target]: attention for target in targets}
    fields.update(variant_fields)
    return fields


def _structattn_config(config_class, t5_config, fields: dict, provenance: dict):
    """``config_class`` (StructAttnT5Config or its Bolt subclass) from a T5Config's values plus the structured
    fields (raises ValueError naming the field on a bad spec, e.g. mlr_ranks that do not sum to d_kv)."""
    values = {k: v for k, v in t5_config.to_dict().items() if k not in _DROP_KEYS}
    # T5Config derives these from feed_forward_proj (the patched config derives them again)
    for derived in ("dense_act_fn", "is_gated_act"):
        values.pop(derived, None)
    values.update(fields)
    values["structattn_patch"] = provenance
    config = config_class.from_dict(values)  # keeps the source's own keys (chronos_config, n_positions, ...)
    # the attention implementation the model was built or loaded with (to_dict drops it): "eager" stays "eager",
    # so output_attentions keeps returning maps
    config._attn_implementation = t5_config._attn_implementation
    return config


@torch.no_grad()
def svd_align_qk(q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, re-factor ``W_Q,h W_K,h^T`` through its SVD (see the module docstring).

    q_weight, k_weight: (H*d, D) nn.Linear weights (rows of head h are ``[h*d, (h+1)*d)``). Returns new weights
    of the same shape and dtype with the same ``W_Q,h^T W_K,h`` products (up to float64 rounding) whose
    coordinates are ordered by singular value.
    """
    dtype = q_weight.dtype
    head_dim = q_weight.shape[0] // num_heads
    new_q, new_k = torch.empty_like(q_weight), torch.empty_like(k_weight)
    for head in range(num_heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        w_q, w_k = q_weight[rows].double().T, k_weight[rows].double().T  # (D, d): q = W_Q^T x
        # A = W_Q W_K^T = Qq (Rq Rk^T) Qk^T: the SVD of the d x d core gives A's SVD without forming A
        basis_q, core_q = torch.linalg.qr(w_q)
        basis_k, core_k = torch.linalg.qr(w_k)
        u, s, vh = torch.linalg.svd(core_q @ core_k.T)
        root = s.sqrt()
        new_q[rows] = ((basis_q @ u) * root).T.to(dtype)
        new_k[rows] = ((basis_k @ vh.T) * root).T.to(dtype)
    return new_q, new_k


def _align_modules(attentions, init: str) -> None:
    if init == "split":
        return
    for module in attentions:
        q, k = svd_align_qk(module.q.weight, module.k.weight, module.n_heads)
        module.q.weight.copy_(q)
        module.k.weight.copy_(k)


def _structured_modules(model):
    """The attention modules that run MLR (their q/k are the ones the SVD init re-factors)."""
    return [module for module in model.modules() if mlr_geometry_of(module) is not None]


def _convert(model, target_class, config, init: str):
    """``target_class(config)`` holding ``model``'s tensors (cloned, same state-dict names), q/k level-aligned."""
    patched = convert_model(model, target_class, config)
    with torch.no_grad():
        _align_modules(_structured_modules(patched), init)
    return patched


class _ChronosGeometry(NamedTuple):
    """What block sizes mean for a Chronos model."""

    steps_per_token: int  # time steps between consecutive encoder tokens (1 for Chronos-T5, the patch stride for Bolt)
    context_tokens: int  # tokens of a full context, without the appended EOS / [REG] token
    role_tokens: dict  # {role: longest sequence that role attends over, in tokens}


def chronos_config_of(obj, kind: str):
    """The Chronos config of a ``ChronosPipeline`` (its ``ChronosConfig``), a ``ChronosBoltPipeline`` or Bolt model
    (its ``ChronosBoltConfig``); None for a plain T5."""
    if kind == "chronos_t5":
        return obj.model.config
    if kind in ("chronos_bolt", "chronos_bolt_pipeline"):
        return (obj.model if kind == "chronos_bolt_pipeline" else obj).chronos_config
    return None


def _chronos_geometry(chronos, kind: str) -> Optional[_ChronosGeometry]:
    """The geometry of a Chronos model from its Chronos config (``chronos_config_of``); None for a plain T5."""
    if kind == "chronos_t5":  # ChronosConfig: one token per time step, EOS appended to the context
        eos = int(chronos.use_eos_token and chronos.model_type == "seq2seq")
        # generate() feeds the start token and prediction_length - 1 sampled tokens to the decoder
        return _ChronosGeometry(1, chronos.context_length, {"encoder_self": chronos.context_length + eos,
                                                           "decoder_self": chronos.prediction_length})
    if kind in ("chronos_bolt", "chronos_bolt_pipeline"):
        size, stride = chronos.input_patch_size, chronos.input_patch_stride
        padded = -(-chronos.context_length // size) * size  # Bolt left-pads the context to whole patches
        patches = (padded - size) // stride + 1
        # Bolt's decoder runs one step: its self-attention sees a single token
        return _ChronosGeometry(stride, patches, {"encoder_self": patches + int(chronos.use_reg_token),
                                                 "decoder_self": 1})
    return None


def _block_fields(geometry: Optional[_ChronosGeometry], fields: dict, block_steps) -> dict:
    """``mlr_block_steps`` (time steps) -> ``mlr_block_sizes`` (tokens); Chronos models without explicit blocks
    get dyadic blocks from their context instead of the generic ``mlr_max_length`` default."""
    fields = dict(fields)
    if block_steps is not None:
        if geometry is None:
            raise ValueError(_NO_TIME_AXIS)
        if "mlr_block_sizes" in fields:
            raise ValueError("give either mlr_block_steps (time steps) or mlr_block_sizes (tokens), not both")
        block_steps, step = list(block_steps), geometry.steps_per_token
        for steps in block_steps:
            if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0 or steps % step:
                raise ValueError(f"mlr_block_steps={block_steps}: each must be a positive multiple of {step} (the "
                                 f"time steps one encoder token covers), got {steps!r}")
        fields["mlr_block_sizes"] = [steps // step for steps in block_steps]
    elif geometry is not None and "mlr_block_sizes" not in fields and "mlr_max_length" not in fields:
        fields["mlr_max_length"] = geometry.context_tokens
    return fields


def _refuse_identity(config, geometry: Optional[_ChronosGeometry], targets: Sequence[str]) -> None:
    """Raise unless every level 2..L splits at least one patched sequence: a block at least as long as every
    sequence it is applied to puts all positions in one block, which makes that level the global level again."""
    block_sizes = config.resolved_mlr_block_sizes
    hint = "pass allow_identity=True (CLI --allow-identity) for a deliberate identity patch"
    if not block_sizes:
        raise ValueError(f"mlr_ranks={list(config.mlr_ranks)} has one level, so the patched model is the dense model "
                         f"again; give two or more levels, or {hint}")
    if geometry is None:
        return
    longest = max(geometry.role_tokens[target] for target in targets)
    idle = [size for size in block_sizes if size >= longest]
    if not idle:
        return
    step = geometry.steps_per_token
    units = "tokens = time steps" if step == 1 else \
        f"tokens = {[size * step for size in block_sizes]} time steps at {step} time steps per token"
    seen = ", ".join(f"{target} {geometry.role_tokens[target]} tokens" for target in targets)
    raise ValueError(f"mlr_block_sizes={block_sizes} ({units}): block(s) {idle} cover the whole sequence of every "
                     f"patched role ({seen}, from the model's context_length), so those levels would change "
                     f"nothing; give smaller blocks (in time steps: mlr_block_steps, CLI --mlr-block-steps), or "
                     f"{hint}")


def patch(obj, attention: str = "mlr", targets: Sequence[str] = ("encoder_self", "decoder_self"),
          init: str = "split", *, mlr_block_steps: Optional[Sequence[int]] = None, allow_identity: bool = False,
          **variant_fields):
    """Convert ``obj`` to structured attention and return the converted copy (``obj`` is not modified).

    Args:
        obj: ``T5ForConditionalGeneration`` (incl. a Chronos-T5 inner model), ``chronos.ChronosPipeline``,
            ``ChronosBoltPipeline`` or ``ChronosBoltModelForForecasting``; or a transformers decoder
            (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...), which ``decoder_patching.patch_decoder`` converts
            (its keywords: ``mlr_ranks``, ``mlr_block_sizes`` / ``mlr_max_length``, ``layers``,
            ``sliding_window_layers``, ``mlr_level_scales``, ``level_order`` (which RoPE pairs form which level:
            "frequency", the default, "index" or "contribution") and ``calibration_ids`` (for "contribution");
            ``targets`` does not apply).
        attention: "mlr".
        targets: roles to convert among "encoder_self", "decoder_self" ("cross" is refused for MLR).
        init: "split" (naive level split of each head's dims) or "svd" (see the module docstring).
        mlr_block_steps: Chronos models only: block sizes of levels 2..L in time steps (multiples of Bolt's
            patch stride), converted to ``mlr_block_sizes`` in tokens. Without any block field, a Chronos model
            gets dyadic blocks from its context (``mlr_max_length`` = context tokens).
        allow_identity: accept a patch that changes nothing (one level, or for Chronos models blocks covering
            the whole sequence of every patched role); refused by default because it is almost always a unit
            mistake (Bolt blocks count patches, not time steps).
        variant_fields: StructAttnT5Config fields, e.g. ``mlr_ranks=[32, 16, 8, 8]``,
            ``mlr_block_sizes=[256, 128, 64]`` (tokens) or ``mlr_max_length=512``, ``mlr_scaling``,
            ``mlr_average_levels``.

    Returns:
        The same kind of object as ``obj``: a ``StructAttnT5ForConditionalGeneration`` for T5, a new
        ``ChronosPipeline`` / ``ChronosBoltPipeline`` or a ``StructAttnChronosBoltModelForForecasting``.
    """
    from .decoder_patching import build_patched_decoder, is_patchable_decoder

    if is_patchable_decoder(obj):  # Llama, Qwen, Mistral, Gemma, Phi-3, GPT-2, ...: docs/patching.md
        new_config = check_decoder_patch(obj, attention, init, mlr_block_steps=mlr_block_steps, **variant_fields)
        return build_patched_decoder(obj, new_config)
    kind, source = _kind_and_model(obj)
    config = check_t5_patch(source.config, kind, attention, targets, init, chronos=chronos_config_of(obj, kind),
                            source=type(obj).__name__, mlr_block_steps=mlr_block_steps,
                            allow_identity=allow_identity, **variant_fields)
    bolt = kind in ("chronos_bolt", "chronos_bolt_pipeline")
    if not bolt:
        inner = _convert(source, StructAttnT5ForConditionalGeneration, config, init)
        if kind == "t5":
            return inner
        chronos_pipeline, chronos_model = _chronos_classes()[:2]
        return chronos_pipeline(tokenizer=obj.tokenizer, model=chronos_model(config=obj.model.config, model=inner))
    patched = _convert(source, bolt_model_class(), config, init)
    return _chronos_classes()[2](model=patched) if kind == "chronos_bolt_pipeline" else patched


def check_decoder_patch(model, attention: str = "mlr", init: str = "split", *,
                        mlr_block_steps: Optional[Sequence[int]] = None, **variant_fields):
    """Every check ``patch`` makes for a transformers decoder, and the ``MLR<Arch>Config`` it builds. Reads no
    weight: ``hf-structattn patch`` calls it on a model built on the meta device from SRC_DIR/config.json."""
    from .decoder_patching import patch_decoder, plan_decoder_patch

    if mlr_block_steps is not None:
        raise ValueError(_NO_TIME_AXIS)
    decoder_keywords = [name for name in inspect.signature(patch_decoder).parameters
                        if name not in ("model", "attention", "init")]
    check_keywords(variant_fields, decoder_keywords, f"decoders ({type(model).__name__})")
    return plan_decoder_patch(model, attention, init=init, **variant_fields)


def check_t5_patch(t5_config, kind: str, attention: str = "mlr",
                   targets: Sequence[str] = ("encoder_self", "decoder_self"), init: str = "split", *, chronos=None,
                   source: str = "T5ForConditionalGeneration", mlr_block_steps: Optional[Sequence[int]] = None,
                   allow_identity: bool = False, **variant_fields):
    """Every check ``patch`` makes for a T5-family model, on its configs alone, and the structured-attention
    config it builds: ``t5_config`` (the model's ``T5Config``), ``kind`` ("t5", "chronos_t5", "chronos_bolt" or
    "chronos_bolt_pipeline"), ``chronos`` (the Chronos config, ``chronos_config_of``; None for a plain T5),
    ``source`` (the class name recorded as provenance). ``hf-structattn patch`` calls it with the configs read from
    SRC_DIR/config.json before loading any weight."""
    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {INITS}")
    fields = _structattn_fields(attention, targets, variant_fields)
    geometry = _chronos_geometry(chronos, kind)
    fields = _block_fields(geometry, fields, mlr_block_steps)
    provenance = {"source": source, "init": init}
    if geometry is not None:
        provenance["time_steps_per_token"] = geometry.steps_per_token
    bolt = kind in ("chronos_bolt", "chronos_bolt_pipeline")
    config_class = StructAttnChronosBoltConfig if bolt else StructAttnT5Config
    config = _structattn_config(config_class, t5_config, fields, provenance)
    if not allow_identity:
        _refuse_identity(config, geometry, tuple(targets))
    return config


def load_patched_chronos_bolt(path, **kwargs):
    """``BaseChronosPipeline.from_pretrained(path, **kwargs)`` for a Chronos-Bolt checkpoint saved after ``patch``,
    refusing any other checkpoint (a dense Bolt would otherwise load without a word).

    Importing ``hf_structattn`` already makes the plain Chronos entry points load such a checkpoint as MLR; this
    helper only adds the check. Returns a ``ChronosBoltPipeline``.
    """
    classes = _chronos_classes()
    if classes is None:
        raise ImportError("load_patched_chronos_bolt needs chronos-forecasting (pip install 'hf-structattn[chronos]')")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "trust_remote_code"})
    if config.model_type != StructAttnChronosBoltConfig.model_type:
        raise ValueError(f"{path}: model_type={config.model_type!r} is not a structured-attention Chronos-Bolt "
                         f"checkpoint ({StructAttnChronosBoltConfig.model_type!r}, written by hf_structattn.patch)")
    return classes[2].from_pretrained(path, **kwargs)


def _relative(diff: torch.Tensor, reference: torch.Tensor) -> float:
    return float(diff.norm() / reference.norm().clamp_min(1e-30))


@torch.no_grad()
def patch_report(original, patched, inputs) -> dict:
    """How far ``patched`` moved from ``original`` before any fine-tuning.

    inputs: for T5 models a dict of model inputs (``input_ids`` (B, T), optional ``attention_mask``,
    ``decoder_input_ids`` (B, T')); for Chronos pipelines what their ``predict`` takes: one 1-D series, a context
    tensor (B, T) or a list of 1-D tensors (optionally ``{"context": ..., "prediction_length": n}``).

    Returns for T5: ``logit_max_abs``, ``logit_rel`` (||dz|| / ||z||), ``top1_agreement``; for Chronos-T5 the
    same for the first decoding step plus ``forecast_rel`` (relative L1 error of the sampled median forecast,
    same seed); for Chronos-Bolt ``forecast_rel`` and ``forecast_max_abs`` of the quantile forecast.
    """
    kind = _kind(original)
    if kind == "t5":
        return _logit_report(original, patched, inputs)
    context = inputs["context"] if isinstance(inputs, dict) else inputs
    prediction_length = inputs.get("prediction_length") if isinstance(inputs, dict) else None
    batch = _context_batch(context)  # checked for both kinds (Chronos itself stops with a bare assert)
    if kind == "chronos_t5":
        token_ids, mask, _ = original.tokenizer.context_input_transform(batch)
        start = original.model.model.config.decoder_start_token_id
        decoder_ids = torch.full((token_ids.shape[0], 1), start, dtype=torch.long)
        report = _logit_report(original.model.model, patched.model.model,
                               dict(input_ids=token_ids, attention_mask=mask, decoder_input_ids=decoder_ids))
        torch.manual_seed(0)
        reference = original.predict(context, prediction_length=prediction_length).median(dim=1).values
        torch.manual_seed(0)
        moved = patched.predict(context, prediction_length=prediction_length).median(dim=1).values
        report["forecast_rel"] = float((moved - reference).abs().mean() / reference.abs().mean().clamp_min(1e-30))
        return report
    original_pipe = original if kind == "chronos_bolt_pipeline" else _chronos_classes()[2](model=original)
    patched_pipe = patched if kind == "chronos_bolt_pipeline" else _chronos_classes()[2](model=patched)
    reference = original_pipe.predict(context, prediction_length=prediction_length)
    moved = patched_pipe.predict(context, prediction_length=prediction_length)
    return {"forecast_rel": float((moved - reference).abs().mean() / reference.abs().mean().clamp_min(1e-30)),
            "forecast_max_abs": float((moved - reference).abs().max())}


def _context_batch(context) -> torch.Tensor:
    """(B, T) float context from what Chronos' ``predict`` accepts: one series (a 1-D tensor), a (B, T) tensor, or a
    list of 1-D series of any lengths (left-padded with NaN, as Chronos pads them)."""
    if torch.is_tensor(context):
        if context.dim() not in (1, 2):
            raise ValueError(f"context must be a 1-D series, a (batch, time) tensor or a list of 1-D series, got a "
                             f"tensor of shape {tuple(context.shape)}")
        return context[None] if context.dim() == 1 else context
    series = list(context)
    if not series or any(not torch.is_tensor(item) or item.dim() != 1 for item in series):
        raise ValueError("context must be a 1-D series, a (batch, time) tensor or a list of 1-D series (tensors)")
    return torch.nn.utils.rnn.pad_sequence([item.flip(0) for item in series], batch_first=True,
                                           padding_value=float("nan")).flip(1)


def _logit_report(original, patched, inputs: dict) -> dict:
    reference = original(**inputs).logits.float()
    moved = patched(**inputs).logits.float()
    diff = moved - reference
    return {"logit_max_abs": float(diff.abs().max()), "logit_rel": _relative(diff, reference),
            "top1_agreement": float((moved.argmax(-1) == reference.argmax(-1)).float().mean())}


def format_report(report: dict) -> str:
    """One line per metric, for the CLI."""
    return "\n".join(f"  {name:<16} {value:.6g}" if isinstance(value, float) and math.isfinite(value)
                     else f"  {name:<16} {value}" for name, value in report.items())


__all__ = ["patch", "patch_report", "load_patched_chronos_bolt", "svd_align_qk", "format_report"]
