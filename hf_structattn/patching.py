"""Convert pretrained T5 / Chronos-T5 / Chronos-Bolt models to structured (MLR) attention (DESIGN.md §4).

``patch`` converts, it does not monkey-patch the caller's object: it returns a new model (or pipeline) whose
pretrained weights are kept under the same state-dict names, whose config records the structured-attention
spec, and which saves with the payload code. The original is left untouched so ``patch_report`` can compare.

* ``T5ForConditionalGeneration`` (also a Chronos-T5 inner model) -> ``StructAttnT5ForConditionalGeneration``
  (model_type ``structattn_t5``; reloads with ``trust_remote_code=True`` and through
  ``ChronosPipeline.from_pretrained(dir, trust_remote_code=True)``).
* ``ChronosPipeline`` -> a ``ChronosPipeline`` around the converted inner model.
* Chronos-Bolt (``ChronosBoltPipeline`` or ``ChronosBoltModelForForecasting``): Chronos resolves the Bolt class
  by name, so the attention modules are replaced in place on a copy and the spec is stored in
  ``config.structattn_t5``; ``load_patched_chronos_bolt(dir)`` re-applies it after loading.

Level split of pretrained q/k (``init``):
* ``"split"``: the first r_1 dims of each head are level 1, the next r_2 level 2, ...
* ``"svd"``: per head, re-factor ``A_h = W_Q,h W_K,h^T`` (D x D, rank d_kv) through its SVD
  ``A_h = P S Q^T``: ``W_Q,h <- P S^{1/2}``, ``W_K,h <- Q S^{1/2}``. This is ``W_Q,h G`` and ``W_K,h G^{-T}`` for an
  invertible d x d ``G`` (an orthogonal ``G`` when q and k already have matched scales), so every q.k, hence
  dense attention, is unchanged; and the first r_1 coordinates now carry the r_1 strongest singular directions,
  so the global level is the best rank-r_1 approximation of the head's score matrix (Eckart-Young).
"""

import copy
import math
from typing import Optional, Sequence

import torch

from .modeling.configuration_structattn_t5 import T5_ATTENTION_ROLES, T5_STRUCTATTN_FIELDS, StructAttnT5Config
from .modeling.modeling_structattn_t5 import (
    StructAttnT5Attention,
    StructAttnT5ForConditionalGeneration,
    install_structured_attention,
)

PATCH_TARGETS = tuple(T5_ATTENTION_ROLES)
PATCH_ATTENTIONS = ("mlr",)
INITS = ("split", "svd")
_DROP_KEYS = ("model_type", "transformers_version", "auto_map", "architectures", "_name_or_path")
BOLT_SPEC_KEY = "structattn_t5"


def _chronos_classes():
    try:
        from chronos import ChronosPipeline
        from chronos.chronos import ChronosModel
        from chronos.chronos_bolt import ChronosBoltModelForForecasting, ChronosBoltPipeline
    except ImportError:
        return None
    return ChronosPipeline, ChronosModel, ChronosBoltPipeline, ChronosBoltModelForForecasting


def _kind(obj) -> str:
    classes = _chronos_classes()
    if classes is not None:
        chronos_pipeline, _, bolt_pipeline, bolt_model = classes
        if isinstance(obj, chronos_pipeline):
            return "chronos_t5"
        if isinstance(obj, bolt_pipeline):
            return "chronos_bolt_pipeline"
        if isinstance(obj, bolt_model):
            return "chronos_bolt"
    from transformers import T5ForConditionalGeneration

    if isinstance(obj, StructAttnT5ForConditionalGeneration) or getattr(getattr(obj, "config", None), "model_type",
                                                                          None) == "structattn_t5":
        raise ValueError("this model already has structured attention (model_type 'structattn_t5'); patch the "
                         "original T5 checkpoint instead")
    if isinstance(obj, T5ForConditionalGeneration):
        return "t5"
    raise ValueError(f"patch accepts a transformers.T5ForConditionalGeneration, a chronos.ChronosPipeline, a "
                     f"ChronosBoltPipeline or a ChronosBoltModelForForecasting; got {type(obj).__name__}")


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
    unknown = set(variant_fields) - set(T5_STRUCTATTN_FIELDS)
    if unknown:
        raise ValueError(f"unknown structured-attention field(s) {sorted(unknown)}; known: {T5_STRUCTATTN_FIELDS}")
    fields = {T5_ATTENTION_ROLES[target]: attention for target in targets}
    fields.update(variant_fields)
    return fields


def _structattn_config(t5_config, fields: dict, provenance: Optional[dict] = None) -> StructAttnT5Config:
    """StructAttnT5Config from a T5Config's values plus the structured fields (raises ValueError naming the
    field on a bad spec, e.g. mlr_ranks that do not sum to d_kv or cross_attention='mlr')."""
    values = {k: v for k, v in t5_config.to_dict().items() if k not in _DROP_KEYS}
    # T5Config derives these from feed_forward_proj; passing them back would be rejected as unknown
    for derived in ("dense_act_fn", "is_gated_act"):
        values.pop(derived, None)
    values.update(fields)
    if provenance is not None:
        values["structattn_patch"] = provenance
    return StructAttnT5Config(**values)


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
    return [m for m in model.modules() if isinstance(m, StructAttnT5Attention) and m.variant == "mlr"]


def _patch_t5(model, fields: dict, init: str, source: str):
    config = _structattn_config(model.config, fields, {"source": source, "init": init})
    with torch.device("meta"):
        patched = StructAttnT5ForConditionalGeneration(config)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    patched.load_state_dict(state, strict=True, assign=True)
    patched.tie_weights()
    patched.generation_config = copy.deepcopy(model.generation_config)
    with torch.no_grad():
        _align_modules(_structured_modules(patched), init)
    return patched.train(model.training)


def _bolt_specs(config: StructAttnT5Config) -> tuple[dict, dict]:
    return ({"self": config.attention_spec("encoder_self")},
            {"self": config.attention_spec("decoder_self"), "cross": config.attention_spec("cross")})


def _patch_bolt_in_place(model, fields: dict) -> StructAttnT5Config:
    """Install the structured attention described by ``fields`` into a Chronos-Bolt model (in place)."""
    config = _structattn_config(model.config, fields)
    encoder_specs, decoder_specs = _bolt_specs(config)
    install_structured_attention(model.encoder, model.encoder.config, encoder_specs)
    install_structured_attention(model.decoder, model.decoder.config, decoder_specs)
    return config


def _patch_bolt(model, fields: dict, init: str):
    _structattn_config(model.config, fields)  # validate before copying anything
    patched = copy.deepcopy(model)
    _patch_bolt_in_place(patched, fields)
    with torch.no_grad():
        _align_modules(_structured_modules(patched), init)
    # the spec is re-applied on load; the weights are already aligned, so the init is provenance only
    patched.config.structattn_t5 = {"fields": dict(fields), "init": init}
    return patched


def patch(obj, attention: str = "mlr", targets: Sequence[str] = ("encoder_self", "decoder_self"),
          init: str = "split", **variant_fields):
    """Convert ``obj`` to structured attention and return the converted copy (``obj`` is not modified).

    Args:
        obj: ``T5ForConditionalGeneration`` (incl. a Chronos-T5 inner model), ``chronos.ChronosPipeline``,
            ``ChronosBoltPipeline`` or ``ChronosBoltModelForForecasting``; or a transformers decoder
            (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...), which ``decoder_patching.patch_decoder`` converts
            (its keywords: ``mlr_ranks``, ``mlr_block_sizes`` / ``mlr_max_length``, ``layers``,
            ``sliding_window_layers``, ``mlr_level_scales``; ``targets`` does not apply).
        attention: "mlr".
        targets: roles to convert among "encoder_self", "decoder_self" ("cross" is refused for MLR).
        init: "split" (naive level split of each head's dims) or "svd" (see the module docstring).
        variant_fields: StructAttnT5Config fields, e.g. ``mlr_ranks=[32, 16, 8, 8]``,
            ``mlr_block_sizes=[256, 128, 64]`` or ``mlr_max_length=512``, ``mlr_scaling``, ``mlr_average_levels``.

    Returns:
        The same kind of object as ``obj``: a ``StructAttnT5ForConditionalGeneration`` for T5, a new
        ``ChronosPipeline`` / ``ChronosBoltPipeline`` or a Bolt model.
    """
    from .decoder_patching import is_patchable_decoder, patch_decoder

    if is_patchable_decoder(obj):  # Llama, Qwen, Mistral, Gemma, Phi-3, GPT-2, ...: docs/patching.md
        return patch_decoder(obj, attention, init=init, **variant_fields)
    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {INITS}")
    fields = _structattn_fields(attention, targets, variant_fields)
    kind = _kind(obj)
    if kind == "t5":
        return _patch_t5(obj, fields, init, type(obj).__name__)
    chronos_pipeline, chronos_model, bolt_pipeline, _ = _chronos_classes()
    if kind == "chronos_t5":
        inner = _patch_t5(obj.model.model, fields, init, "ChronosPipeline")
        return chronos_pipeline(tokenizer=obj.tokenizer, model=chronos_model(config=obj.model.config, model=inner))
    if kind == "chronos_bolt_pipeline":
        return bolt_pipeline(model=_patch_bolt(obj.model, fields, init))
    return _patch_bolt(obj, fields, init)


def load_patched_chronos_bolt(path, **kwargs):
    """Load a Chronos-Bolt checkpoint saved after ``patch`` and re-apply its recorded structured attention.

    Returns a ``ChronosBoltPipeline``. Chronos resolves the Bolt class by name (``config.architectures``), so
    the spec in ``config.structattn_t5`` is installed after loading; the saved q/k are already level-aligned.
    """
    classes = _chronos_classes()
    if classes is None:
        raise ImportError("load_patched_chronos_bolt needs chronos-forecasting (pip install 'hf-structattn[chronos]')")
    bolt_pipeline = classes[2]
    pipeline = bolt_pipeline.from_pretrained(path, **kwargs)
    record = getattr(pipeline.model.config, BOLT_SPEC_KEY, None)
    if not record:
        raise ValueError(f"{path}: config.json has no {BOLT_SPEC_KEY!r} entry; this Bolt checkpoint was not saved "
                         f"by hf_structattn.patch")
    _patch_bolt_in_place(pipeline.model, dict(record["fields"]))
    return pipeline


def _relative(diff: torch.Tensor, reference: torch.Tensor) -> float:
    return float(diff.norm() / reference.norm().clamp_min(1e-30))


@torch.no_grad()
def patch_report(original, patched, inputs) -> dict:
    """How far ``patched`` moved from ``original`` before any fine-tuning.

    inputs: for T5 models a dict of model inputs (``input_ids`` (B, T), optional ``attention_mask``,
    ``decoder_input_ids`` (B, T')); for Chronos pipelines a context tensor (B, T) or list of 1-D tensors
    (optionally ``{"context": ..., "prediction_length": n}``).

    Returns for T5: ``logit_max_abs``, ``logit_rel`` (||dz|| / ||z||), ``top1_agreement``; for Chronos-T5 the
    same for the first decoding step plus ``forecast_rel`` (relative L1 error of the sampled median forecast,
    same seed); for Chronos-Bolt ``forecast_rel`` and ``forecast_max_abs`` of the quantile forecast.
    """
    kind = _kind(original)
    if kind == "t5":
        return _logit_report(original, patched, inputs)
    context = inputs["context"] if isinstance(inputs, dict) else inputs
    prediction_length = inputs.get("prediction_length") if isinstance(inputs, dict) else None
    if kind == "chronos_t5":
        token_ids, mask, _ = original.tokenizer.context_input_transform(
            context if torch.is_tensor(context) else torch.nn.utils.rnn.pad_sequence(
                [c.flip(0) for c in context], batch_first=True, padding_value=float("nan")).flip(1))
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
