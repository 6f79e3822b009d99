"""Maximal-update parameterisation (muP) for the structured-attention models (paper App. E, Yang et al.).

With AdamW, a weight matrix with fan-in ``n`` gets learning rate ``lr * base_width / n`` and init std
``1/sqrt(n)``; embeddings, norms and biases keep ``lr``; the residual output projections, the LM head and the
ICL read-out start at zero. Structured factors follow the same rule with their own fan-in (bilinear MLR level l:
``D / p_l``; BTT: ``d`` for R and ``c*s`` for L) and are used through the authors' RMS weight clamp. Attention
logits use ``1/r`` for dense and SWA heads, ``1/r_l`` per MLR level and ``1/width`` for bilinear scores
(``mup_config_overrides``). The LM head is a read-out (zero init, ``1/fan_in`` learning rate), so it cannot share
its weight with the input embedding: muP needs ``tie_word_embeddings=False`` (the authors do not tie either) and
:func:`mup_rules` refuses a tied model.

Learning rate of bilinear BTT's key factor R (``weight_r``, paper W_K): ``lr * base_width / d``, its fan-in d, as in
the authors' code (``768 / d``). The paper's App. E text gives ``eta_base * D1 / a`` for it, which disagrees with the
same appendix's init of that factor (``N(0, 1/d)``, i.e. fan-in d) and with its own AdamW rule (learning rate
``Theta(1/fan_in)``): R contracts the d index of x viewed as (c, d), and a is the output size of the other factor L.
The factor L (``weight_l``, paper W_Q) gets ``lr * base_width / (c*s)`` as in both.

:func:`attention_logit_rms` measures the attention logits' scale, which the coordinate check
(``tests/test_mup.py``) holds flat across widths: with a fixed number of heads the head dim r grows with the width,
and ``1/sqrt(r)`` logits then grow like ``sqrt(r)`` once training correlates queries and keys, where muP's ``1/r``
keeps them Theta(1).

Usage::

    config = StructAttnGPT2Config(..., **mup_config_overrides())
    model = StructAttnGPT2LMHeadModel(config)
    mup_init_(model)
    optimizer = torch.optim.AdamW(mup_param_groups(model, lr=3e-3, base_width=256), betas=(0.9, 0.95))
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .modeling.structattn_bilinear import BilinearBTTKeyProjection, BilinearMLRProjection


def mup_config_overrides() -> dict:
    """Config fields of muP (paper App. E): logit scales ``1/r`` (dense, SWA), ``1/r_l`` per MLR level and
    ``1/width`` for bilinear scores; the RMS clamp of the bilinear factors; an untied LM head (the read-out)."""
    return {"mlr_scaling": "mup", "bilinear_scaling": "mup", "dense_scaling": "mup",
            "bilinear_weight_rms_clamp": True, "tie_word_embeddings": False}


def check_untied_readout(model: nn.Module) -> None:
    """Raise if the model's LM head shares its weight with the input embedding (muP needs a separate read-out)."""
    head = getattr(model, "lm_head", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and embeddings is not None and head.weight is embeddings.weight:
        raise ValueError("mup: the LM head is tied to the input embedding (tie_word_embeddings=True); muP treats it "
                         "as a read-out (zero init, 1/fan_in learning rate), so build the model with "
                         "tie_word_embeddings=False (mup_config_overrides() does)")


@dataclass(frozen=True)
class MupRule:
    """How one parameter is treated: ``fan_in`` None means 'vector-like' (lr multiplier 1)."""

    fan_in: int | None
    zero_init: bool = False


def _is_output_projection(name: str) -> bool:
    return name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight") or \
        name.endswith("lm_head.weight") or name.endswith("read_out.weight")


def mup_rules(model: nn.Module) -> dict[str, MupRule]:
    """The muP rule of every trainable parameter, by name. Raises ValueError for a parameter it does not know and
    for a tied LM head."""
    check_untied_readout(model)
    rules: dict[str, MupRule] = {}
    structured = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (BilinearMLRProjection, BilinearBTTKeyProjection)):  # the fan-ins their init uses
            for name, fan_in in module.fan_ins().items():
                structured[f"{module_name}.{name}"] = MupRule(fan_in=fan_in)
    seen = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if name in structured:
            rules[name] = structured[name]
        elif name.endswith("wte.weight") or name.endswith("wpe.weight") or param.dim() < 2:
            rules[name] = MupRule(fan_in=None)
        elif name.endswith("read_in.weight"):
            rules[name] = MupRule(fan_in=None)  # the ICL read-in is embedding-like (fan-in = input dim, fixed)
        elif param.dim() == 2:
            # Conv1D stores (in, out), nn.Linear (out, in)
            fan_in = param.shape[0] if _is_conv1d_weight(model, name) else param.shape[1]
            rules[name] = MupRule(fan_in=fan_in, zero_init=_is_output_projection(name))
        else:
            raise ValueError(f"mup: no rule for parameter {name!r} of shape {tuple(param.shape)}")
    return rules


def _is_conv1d_weight(model: nn.Module, name: str) -> bool:
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return type(module).__name__ == "Conv1D"


def mup_param_groups(model: nn.Module, lr: float, base_width: int, weight_decay: float = 0.0) -> list[dict]:
    """AdamW parameter groups: ``lr * base_width / fan_in`` for matrices, ``lr`` for vector-like parameters.

    Weight decay applies to matrices only. Each group carries ``lr_multiplier`` and ``name`` for inspection.
    """
    if base_width <= 0:
        raise ValueError(f"base_width must be positive, got {base_width}")
    groups: dict[float, dict] = {}
    params = dict(model.named_parameters())
    for name, rule in mup_rules(model).items():
        multiplier = 1.0 if rule.fan_in is None else base_width / rule.fan_in
        decay = 0.0 if rule.fan_in is None else weight_decay
        key = (multiplier, decay)
        group = groups.setdefault(key, {"params": [], "names": [], "lr": lr * multiplier, "lr_multiplier": multiplier,
                                        "weight_decay": decay})
        group["params"].append(params[name])
        group["names"].append(name)
    return list(groups.values())


@torch.no_grad()
def mup_init_(model: nn.Module, embedding_std: float = 0.02) -> None:
    """Re-initialise a freshly built model with muP: N(0, 1/fan_in) for matrices, zeros for output projections,
    N(0, embedding_std^2) for embeddings, ones/zeros for norms and biases."""
    params = dict(model.named_parameters())
    for name, rule in mup_rules(model).items():
        param = params[name]
        if rule.zero_init:
            param.zero_()
        elif rule.fan_in is not None:
            param.normal_(0.0, rule.fan_in ** -0.5)
        elif param.dim() >= 2:
            param.normal_(0.0, embedding_std)
        elif "ln" in name or "norm" in name:
            param.fill_(1.0) if name.endswith("weight") else param.zero_()
        else:
            param.zero_()


def _attended_pairs(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, T, T) bool: the causal pairs (query i, key j <= i) of real tokens, for scores (B, H, T, T)."""
    batch, _, length, _ = scores.shape
    keep = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril().expand(batch, 1, length, length)
    if attention_mask is not None:
        real = attention_mask.to(device=scores.device, dtype=torch.bool)
        keep = keep & real[:, None, None, :] & real[:, None, :, None]
    return keep


def attention_logits(model: nn.Module, attention_mask: torch.Tensor | None = None, **inputs) -> list[torch.Tensor]:
    """Every layer's pre-softmax attention logits, centred per query row, from the probabilities the model returns
    with ``output_attentions=True`` and eager attention (a public output of every variant; it applies the model's own q/k
    normalisation, logit scales and MLR level averaging).

    ``log p_ij = s_ij - logsumexp_j s_ij``, so centring ``log p`` over the keys a query attends to gives ``s_ij``
    minus its row mean: the logits up to the per-row shift softmax ignores. Runs on a float64 copy in eval mode (so
    that probabilities of logits far below the row maximum do not underflow). The model must be causal (the GPT-2
    family; the ICL model included). ``inputs``: what the model's forward takes (``input_ids``, or ``xs`` and
    ``ys``); ``attention_mask`` (B, T) keep-mask, optional.

    Returns one tensor (B, H, T, T) per layer, 0 at the masked pairs and in rows of padding queries.
    """
    probe = copy.deepcopy(model).to(torch.float64).eval()
    probe.set_attn_implementation("eager")  # as in transformers, only eager attention returns probabilities
    inputs = {name: value.to(torch.float64) if torch.is_tensor(value) and value.is_floating_point() else value
              for name, value in inputs.items()}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    with torch.no_grad():
        probabilities = probe(**inputs, output_attentions=True).attentions
    if not probabilities:
        raise ValueError(f"attention_logits: {type(model).__name__} returned no attention probabilities")
    keep = _attended_pairs(probabilities[0], attention_mask)
    counts = keep.sum(-1, keepdim=True).clamp_min(1)
    logits = []
    for layer, layer_probabilities in enumerate(probabilities):
        if (layer_probabilities[keep.expand_as(layer_probabilities)] == 0).any():
            raise ValueError(f"attention_logits: layer {layer} has attended probabilities that underflow float64 "
                             f"(a logit spread beyond ~700)")
        log_probabilities = torch.where(keep, layer_probabilities.log(), 0.0)
        centred = log_probabilities - log_probabilities.sum(-1, keepdim=True) / counts
        logits.append(torch.where(keep, centred, 0.0))
    return logits


def attention_logit_rms(model: nn.Module, attention_mask: torch.Tensor | None = None, **inputs) -> torch.Tensor:
    """RMS of each layer's row-centred attention logits (:func:`attention_logits`) over batch, heads and the
    attended pairs of query rows with at least two keys (a single key has no spread). Returns (n_layer,)."""
    logits = attention_logits(model, attention_mask=attention_mask, **inputs)
    keep = _attended_pairs(logits[0], attention_mask)
    keep = keep & (keep.sum(-1, keepdim=True) >= 2)
    return torch.stack([layer[keep.expand_as(layer)].pow(2).mean().sqrt() for layer in logits])
