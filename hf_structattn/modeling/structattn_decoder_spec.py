"""What a patched decoder's config says about its MLR layers (which layers, their ``MLRGeometry``), which modules of
a decoder are its attention modules, and the RoPE pair order its level slices follow. Part of the checkpoint payload;
used by ``structattn_decoder`` (the ``MLR<Arch>`` classes) and, through the registry
``structattn_install.STOCK_GEOMETRY_RESOLVERS`` it joins at import, by ``structattn_attention`` (a stock model run
with ``attn_implementation="mlr"``)."""

import inspect
from typing import Optional

import torch

from .structattn_geometry import MLRGeometry
from .structattn_install import STOCK_GEOMETRY_RESOLVERS


# ------------------------------------------------------------------------------------------- layer spec


def mlr_layer_indices(config) -> list:
    """Indices of the MLR layers of a patched decoder config."""
    layers = getattr(config, "mlr_layers", None)
    return list(range(config.num_hidden_layers)) if layers is None else list(layers)


def decoder_geometry(config) -> MLRGeometry:
    """The ``MLRGeometry`` of a patched decoder config (ValueError naming the field when a field is missing or
    invalid)."""
    ranks = getattr(config, "mlr_ranks", None)
    blocks = getattr(config, "mlr_block_sizes", None)
    if ranks is None or blocks is None:
        raise ValueError(f"MLR attention needs config.mlr_ranks and config.mlr_block_sizes; got mlr_ranks={ranks!r}, "
                         f"mlr_block_sizes={blocks!r} (use hf_structattn.patch)")
    return MLRGeometry.build(ranks, blocks, getattr(config, "mlr_level_scales", None),
                             dim_order=getattr(config, "mlr_dim_order", None), scales_field="mlr_level_scales")


def decoder_geometries(config) -> dict:
    """{layer index: MLRGeometry} of a patched decoder config."""
    geometry = decoder_geometry(config)
    return {index: geometry for index in mlr_layer_indices(config)}


def dispatches_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an attention module whose forward dispatches through transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (read from the names its code refers to; decorators are unwrapped)."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names and hasattr(module, "layer_idx")


def attention_modules(model: torch.nn.Module) -> dict:
    """{layer index: attention module} of a decoder's self-attention layers."""
    return {module.layer_idx: module for module in model.modules() if dispatches_attention(module)
            and not getattr(module, "is_cross_attention", False)}


# ------------------------------------------------------------------------------------------- RoPE pairs


@torch.no_grad()
def rotary_pair_order(rotary, apply_rotary_pos_emb, head_dim: int, layer_types=(None,)) -> tuple[list, int]:
    """Head-dim order with complete rotation pairs first, found numerically from a model's own rotary embedding.

    Each basis vector e_i of the head dim is rotated by ``apply_rotary_pos_emb`` at a few positions; dims that
    rotate together form a pair, dims that never move are unrotated. Works for half-split, interleaved and
    partial RoPE. Returns (``[a_1, b_1, a_2, b_2, ..., unrotated...]`` with pairs ordered by their first dim, i.e.
    the model's own frequency order; the number of rotated dims). Raises ValueError when the rotation couples
    more than two dims.
    """
    with torch.device("cpu"):  # numbers, also inside a meta-device context (from_pretrained, patch on meta)
        return _rotary_pair_order(rotary, apply_rotary_pos_emb, head_dim, layer_types)


def _rotary_pair_order(rotary, apply_rotary_pos_emb, head_dim: int, layer_types) -> tuple[list, int]:
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]  # (1, 1, d, d): query "token" i is e_i
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    moved = torch.zeros(head_dim, head_dim, dtype=torch.bool)
    for layer_type in layer_types:
        for position in (1, 3, 17, 1001):
            position_ids = torch.full((1, head_dim), position, dtype=torch.long)
            extra = {"layer_type": layer_type} if takes_layer_type else {}
            cos, sin = rotary(basis, position_ids, **extra)
            rotated, _ = apply_rotary_pos_emb(basis, basis, cos.to(torch.float64), sin.to(torch.float64))
            moved |= rotated[0, 0].abs() > 1e-9
    moved |= torch.eye(head_dim, dtype=torch.bool)
    pairs, unrotated, seen = [], [], set()
    for dim in range(head_dim):
        partners = [other for other in moved[dim].nonzero().flatten().tolist() if other != dim]
        if len(partners) > 1 or (partners and moved[partners[0]].sum() != 2):
            raise ValueError(f"the rotary embedding couples head dim {dim} with {partners}: only 2-D rotations "
                             f"(RoPE pairs) can be split into MLR levels")
        if not partners:
            unrotated.append(dim)
        elif dim not in seen:
            pairs.append((dim, partners[0]))
            seen.update((dim, partners[0]))
    return [dim for pair in pairs for dim in pair] + unrotated, 2 * len(pairs)


def check_pair_complete_levels(ranks, rotated_dims: int) -> None:
    """Level slices of the pair-first order must not split a rotation pair: every level boundary inside the
    first ``rotated_dims`` dims falls at an even offset."""
    boundary = 0
    for level, rank in enumerate(ranks[:-1], start=1):
        boundary += rank
        if boundary < rotated_dims and boundary % 2:
            raise ValueError(f"mlr_ranks={list(ranks)} splits a RoPE rotation pair: level {level} ends at head dim "
                             f"{boundary} of the pair-ordered head ({rotated_dims // 2} pairs first); within the "
                             f"rotated dims every level must hold whole pairs (even boundaries)")


def model_rotary(module):
    """(rotary embedding built from the module's config, apply_rotary_pos_emb) from the attention module's own
    modeling file, or None for a model without RoPE."""
    modeling = inspect.getmodule(type(module))
    apply_fn = getattr(modeling, "apply_rotary_pos_emb", None)
    classes = [obj for name, obj in vars(modeling).items() if name.endswith("RotaryEmbedding") and
               isinstance(obj, type) and issubclass(obj, torch.nn.Module)] if modeling is not None else []
    if apply_fn is None or not classes:
        return None
    with torch.device("cpu"):  # never the meta device of an init-empty context
        return classes[0](config=module.config), apply_fn


def stock_layer_geometry(module: torch.nn.Module) -> Optional[MLRGeometry]:
    """The geometry of an attention module of a stock model whose config carries MLR fields (a stock checkpoint
    loaded with ``attn_implementation="mlr"`` and ``config.mlr_ranks`` / ``config.mlr_block_sizes``), or None for a
    layer outside ``mlr_layers``. A config without ``mlr_dim_order`` gets the RoPE pair order from the module's
    rotary embedding here, stored in the config (so it is saved with the model)."""
    config = module.config
    if getattr(module, "layer_idx", None) not in mlr_layer_indices(config):
        return None
    if not hasattr(config, "mlr_dim_order"):
        found = model_rotary(module)
        head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size")
        layer_types = tuple(sorted(set(getattr(config, "layer_types", None) or [None])))
        order, rotated = (None, 0) if found is None else rotary_pair_order(*found, head_dim, layer_types)
        check_pair_complete_levels(list(config.mlr_ranks), rotated)
        config.mlr_dim_order = order
    return decoder_geometry(config)


# (once per loaded copy of this file: the installed package and a checkpoint's remote code each register theirs)
if all(resolver.__module__ != __name__ for resolver in STOCK_GEOMETRY_RESOLVERS):
    STOCK_GEOMETRY_RESOLVERS.append(stock_layer_geometry)

__all__ = ["attention_modules", "check_pair_complete_levels", "decoder_geometries", "decoder_geometry",
           "dispatches_attention", "mlr_layer_indices", "model_rotary", "rotary_pair_order", "stock_layer_geometry"]
