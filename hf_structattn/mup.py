"""Maximal-update parameterisation (muP) for the structured-attention models (paper App. E, Yang et al.).

With AdamW, a weight matrix with fan-in ``n`` gets learning rate ``lr * base_width / n`` and init std
``1/sqrt(n)``; embeddings, norms and biases keep ``lr``; the residual output projections, the LM head and the
ICL read-out start at zero. Structured factors follow the same rule with their own fan-in (bilinear MLR level l:
``D / p_l``; BTT: ``d`` for R and ``c*s`` for L) and are used through the authors' RMS weight clamp. Attention
logits use ``1/r`` for dense and SWA heads, ``1/r_l`` per MLR level and ``1/width`` for bilinear scores
(``mup_config_overrides``). The LM head is a read-out (zero init, ``1/fan_in`` learning rate), so it cannot share
its weight with the input embedding: muP needs ``tie_word_embeddings=False`` (the authors do not tie either) and
:func:`mup_rules` refuses a tied model.

Usage::

    config = StructAttnGPT2Config(..., **mup_config_overrides())
    model = StructAttnGPT2LMHeadModel(config)
    mup_init_(model)
    optimizer = torch.optim.AdamW(mup_param_groups(model, lr=3e-3, base_width=256), betas=(0.9, 0.95))
"""

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
