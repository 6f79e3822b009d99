"""What a patched decoder's config says about its MLR layers (which layers, their ``MLRGeometry``), which modules of
a decoder are its attention modules, and the RoPE pair order its level slices follow. Part of the checkpoint payload;
used by ``structattn_decoder`` (the ``MLR<Arch>`` classes) and, through the registry
``structattn_install.STOCK_GEOMETRY_RESOLVERS`` it joins at import, by ``structattn_attention`` (a stock model run
with ``attn_implementation="mlr"``)."""

import inspect
from typing import Optional

try:  # the payload imports only torch and transformers unguarded (a checkpoint's code stays auditable)
    import difflib
except ImportError:  # pragma: no cover - the standard library always has it
    difflib = None

import torch

from .structattn_geometry import MLRGeometry
from .structattn_install import STOCK_GEOMETRY_RESOLVERS


# ------------------------------------------------------------------------------------------- layer spec


def mlr_layer_indices(config) -> list:
    """Indices of the MLR layers of a patched decoder config (a one-line ValueError naming ``mlr_layers`` when it
    does not list layers of the model)."""
    count = config.num_hidden_layers
    layers = getattr(config, "mlr_layers", None)
    if layers is None:
        return list(range(count))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__") or not list(layers) or any(
            isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count for index in layers):
        raise ValueError(f"mlr_layers={layers!r} must list layer indices of this {count}-layer model "
                         f"(0..{count - 1}), or be None for every layer")
    return list(layers)


def decoder_geometry(config, head_dim: Optional[int] = None, dims: Optional["RotaryDims"] = None,
                     level_order: Optional[str] = None, dim_order=None) -> MLRGeometry:
    """The ``MLRGeometry`` of a patched decoder config, every field checked in one place, in this order, each
    ValueError one line naming its field: ``mlr_ranks`` / ``mlr_block_sizes`` present, the ranks summing to
    ``head_dim`` (when given) and the blocks nested, ``mlr_dim_order`` a permutation of the head dims, and, for a
    RoPE model (``dims``), every level holding whole rotation pairs. The head-dim order is ``config.mlr_dim_order``,
    or ``dim_order`` when a level-order rule ``level_order`` made it (``patch``, a stock model's first call): a split
    pair is then blamed on ``mlr_ranks``, since the rule's order holds the pairs together."""
    ranks = getattr(config, "mlr_ranks", None)
    blocks = getattr(config, "mlr_block_sizes", None)
    for name, value in (("mlr_ranks", ranks), ("mlr_block_sizes", blocks)):
        if value is None:
            raise ValueError(f"config.{name} is missing: MLR attention needs config.mlr_ranks (level ranks summing to "
                             f"the head dim) and config.mlr_block_sizes; set both on the config, or convert the model "
                             f"with hf_structattn.patch(model, mlr_ranks=..., mlr_block_sizes=...)")
    order = getattr(config, "mlr_dim_order", None) if level_order is None else dim_order
    geometry = MLRGeometry.build(ranks, blocks, getattr(config, "mlr_level_scales", None), head_dim=head_dim,
                                 dim_order=order, level_rule=getattr(config, "mlr_level_rule", "blocks"),
                                 scales_field="mlr_level_scales")
    if dims is not None:
        check_levels_hold_whole_pairs(geometry.ranks, list(geometry.dim_order or range(geometry.head_dim)), dims,
                                      level_order)
    return geometry


def decoder_geometries(config, modules: Optional[dict] = None) -> dict:
    """{layer index: MLRGeometry} of a patched decoder config; with the model's attention ``modules`` ({layer
    index: module}) checked against them too (the head dim, whole RoPE pairs: ``decoder_geometry``)."""
    indices = mlr_layer_indices(config)
    module = None if modules is None else next((modules[index] for index in indices if index in modules), None)
    if module is None:
        geometry = decoder_geometry(config)
    else:
        head_dim, dims = module_rotary_dims(module)
        geometry = decoder_geometry(config, head_dim, dims)
    return {index: geometry for index in indices}


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


# ------------------------------------------------------------------------------------------- RoPE pairs and levels

# Which head dims go to which level (``level_order``), whole RoPE rotation pairs per level in every rule:
#   "frequency":    position-free dims first (the unrotated dims of partial RoPE, in index order), then the rotation
#                   pairs from the lowest rotation frequency to the highest. A pretrained model's long-range
#                   attention lives in its slow pairs, which the global level then holds.
#   "index":        the pairs in the model's own dim order (for transformers' RoPE: highest frequency first), then the
#                   unrotated dims: the order of hf_structattn before level_order existed.
#   "contribution": position-free dims first, then the pairs, each part ranked by its measured contribution to the
#                   attention scores (MHA2MLA's rule: mean |q| x mean |k| of the dims, per query head, summed over
#                   heads and layers, largest first); needs calibration text (hf_structattn.patch's calibration_ids).
# A model without RoPE has only position-free dims: "frequency" is then the index order, "contribution" ranks its dims.
LEVEL_ORDERS = ("frequency", "index", "contribution")
# The default, chosen by measurement on real weights (SmolLM2-135M, ranks 32|16|8|8 at a 2,048-token context:
# benchmarks/results/real_weights.md, benchmarks/bench_real_weights.py).
DEFAULT_LEVEL_ORDER = "frequency"


def check_level_order(level_order) -> str:
    """``level_order`` itself, or a one-line ValueError naming it (with the closest valid value)."""
    if isinstance(level_order, str) and level_order in LEVEL_ORDERS:
        return level_order
    close = difflib.get_close_matches(str(level_order).lower(), LEVEL_ORDERS, n=1, cutoff=0.5) if difflib else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"level_order={level_order!r} is not one of {', '.join(map(repr, LEVEL_ORDERS))}{hint}")


class RotaryDims:
    """The RoPE structure of a head, found numerically from a model's own rotary embedding: ``pairs`` [(a, b), ...]
    (dims that rotate together, by first dim), ``frequencies`` (radians per position of each pair, averaged over the
    layer types asked for) and ``unrotated`` (dims that never move: position-free)."""

    def __init__(self, pairs: list, frequencies: list, unrotated: list):
        self.pairs, self.frequencies, self.unrotated = pairs, frequencies, unrotated

    @property
    def rotated_dims(self) -> int:
        return 2 * len(self.pairs)

    def groups(self) -> list:
        """Every head dim once, as level units: the pairs (2-tuples) then the unrotated dims (1-tuples)."""
        return [tuple(pair) for pair in self.pairs] + [(dim,) for dim in self.unrotated]


@torch.no_grad()
def rotary_dims(rotary, apply_rotary_pos_emb, head_dim: int, layer_types=(None,)) -> RotaryDims:
    """The ``RotaryDims`` of a model with RoPE (half-split, interleaved, partial, per-layer-type RoPE alike): each
    basis vector e_i of the head dim is rotated by ``apply_rotary_pos_emb`` at a few positions; dims that rotate
    together form a pair, dims that never move are unrotated; a pair's frequency is its rotation angle from position
    0 to 1. Raises ValueError when the rotation couples more than two dims."""
    with torch.device("cpu"):  # numbers, also inside a meta-device context (from_pretrained, patch on meta)
        return _rotary_dims(rotary, apply_rotary_pos_emb, head_dim, layer_types)


def _rotary_dims(rotary, apply_rotary_pos_emb, head_dim: int, layer_types) -> RotaryDims:
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]  # (1, 1, d, d): query "token" i is e_i
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    moved = torch.zeros(head_dim, head_dim, dtype=torch.bool)
    first_step = []  # per layer type: (d, d) basis vectors rotated by one position
    for layer_type in layer_types:
        for position in (1, 3, 17, 1001):
            position_ids = torch.full((1, head_dim), position, dtype=torch.long)
            extra = {"layer_type": layer_type} if takes_layer_type else {}
            cos, sin = rotary(basis, position_ids, **extra)
            rotated, _ = apply_rotary_pos_emb(basis, basis, cos.to(torch.float64), sin.to(torch.float64))
            moved |= rotated[0, 0].abs() > 1e-9
            if position == 1:
                first_step.append(rotated[0, 0])
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
    # the angle of e_a after one position, atan2(|<R e_a, e_b>|, <R e_a, e_a>) (scale-free: attention factors cancel)
    frequencies = [sum(float(torch.atan2(step[a, b].abs(), step[a, a])) for step in first_step) / len(first_step)
                   for a, b in pairs]
    return RotaryDims(pairs, frequencies, unrotated)


def rotary_pair_order(rotary, apply_rotary_pos_emb, head_dim: int, layer_types=(None,)) -> tuple[list, int]:
    """The ``"index"`` level order of a RoPE model: ``[a_1, b_1, a_2, b_2, ..., unrotated...]`` with pairs ordered by
    their first dim (the model's own order), and the number of rotated dims."""
    dims = rotary_dims(rotary, apply_rotary_pos_emb, head_dim, layer_types)
    return level_dim_order(dims, head_dim, "index"), dims.rotated_dims


def level_dim_order(dims: Optional[RotaryDims], head_dim: int, level_order: str,
                    contributions: Optional[dict] = None) -> list:
    """The head-dim order whose consecutive level slices are the levels (``config.mlr_dim_order``), by
    ``level_order`` (see ``LEVEL_ORDERS``). ``dims``: the head's RoPE structure, None for a model without RoPE (all
    dims position-free). ``contributions``: {group (a tuple of dims, ``RotaryDims.groups``): score} for
    ``"contribution"``. Ties keep the index order."""
    level_order = check_level_order(level_order)
    dims = dims or RotaryDims([], [], list(range(head_dim)))
    pairs, unrotated = [tuple(pair) for pair in dims.pairs], [(dim,) for dim in dims.unrotated]
    if level_order == "index":
        groups = pairs + unrotated
    elif level_order == "frequency":
        by_frequency = sorted(range(len(pairs)), key=lambda index: (dims.frequencies[index], index))
        groups = unrotated + [pairs[index] for index in by_frequency]
    else:
        if contributions is None or set(contributions) != set(pairs + unrotated):
            raise ValueError("level_order='contribution' needs a measured contribution of every RoPE pair and "
                             "unrotated dim (calibration text)")

        def ranked(part):
            return sorted(part, key=lambda group: (-contributions[group], group))

        groups = ranked(unrotated) + ranked(pairs)
    return [dim for group in groups for dim in group]


def stored_dim_order(order: list) -> Optional[list]:
    """``config.mlr_dim_order`` for a level order: None for the identity (no permutation at run time)."""
    return None if order == list(range(len(order))) else order


def check_levels_hold_whole_pairs(ranks, dim_order, dims: Optional[RotaryDims],
                                  level_order: Optional[str] = None) -> None:
    """Every RoPE rotation pair lies inside one level slice of ``dim_order``, so that each level's score depends on
    relative position only; otherwise a one-line ValueError naming ``mlr_ranks`` when the rule ``level_order`` made
    the order (its boundaries are at fault), or ``mlr_dim_order`` when the order is the config's own (None)."""
    if dims is None or not dims.pairs:
        return
    level_of, start = {}, 0
    for level, rank in enumerate(ranks, start=1):
        for dim in dim_order[start:start + rank]:
            level_of[dim] = level
        start += rank
    for a, b in dims.pairs:
        if level_of[a] == level_of[b]:
            continue
        if level_order is None:
            raise ValueError(f"mlr_dim_order={list(dim_order)} splits the RoPE rotation pair ({a}, {b}) between "
                             f"levels {level_of[a]} and {level_of[b]} of mlr_ranks={list(ranks)}: every level must "
                             f"hold whole pairs (hf_structattn.patch writes such an order)")
        offset = sum(ranks[:level_of[a]])
        raise ValueError(f"mlr_ranks={list(ranks)} splits a RoPE rotation pair: level {level_of[a]} ends at head "
                         f"dim {offset} of the level-ordered head (level_order={level_order!r}: "
                         f"{len(dims.unrotated)} unrotated dims and {len(dims.pairs)} pairs, "
                         f"{'pairs first' if level_order == 'index' else 'unrotated dims first'}); every level "
                         f"must hold whole pairs (even boundaries within the pairs)")


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


def module_rotary_dims(module: torch.nn.Module) -> tuple:
    """(head dim, ``RotaryDims`` or None without RoPE) of an attention module, from its own rotary embedding (over
    every layer type of its config)."""
    config = module.config
    head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size")
    found = model_rotary(module)
    layer_types = tuple(sorted(set(getattr(config, "layer_types", None) or [None])))
    return head_dim, None if found is None else rotary_dims(*found, head_dim, layer_types)


def stock_layer_geometry(module: torch.nn.Module) -> Optional[MLRGeometry]:
    """The geometry of an attention module of a stock model run with ``attn_implementation="mlr"``, from the MLR
    fields of its config (``decoder_geometry``: a config without them is refused), or None for a layer outside
    ``mlr_layers``. A config without ``mlr_dim_order`` gets the RoPE pair order from the module's rotary embedding
    here, stored in the config with the attention implementation (``config.attn_implementation``), so that the model
    saves as what it runs: ``from_pretrained`` of the saved folder loads it with MLR attention again."""
    config = module.config
    if getattr(module, "layer_idx", None) not in mlr_layer_indices(config):
        return None
    head_dim, dims = module_rotary_dims(module)
    if hasattr(config, "mlr_dim_order"):
        geometry = decoder_geometry(config, head_dim, dims)
    else:
        level_order = check_level_order(getattr(config, "mlr_level_order", DEFAULT_LEVEL_ORDER))
        if level_order == "contribution":
            raise ValueError("config.mlr_level_order='contribution' needs calibration text, which a stock model loaded "
                             "with attn_implementation='mlr' does not have: patch it with hf_structattn.patch(model, "
                             "level_order='contribution', calibration_ids=...)")
        order = stored_dim_order(level_dim_order(dims, head_dim, level_order))
        geometry = decoder_geometry(config, head_dim, dims, level_order, order)
        config.mlr_dim_order = order
    config.attn_implementation = config._attn_implementation
    return geometry


# (once per loaded copy of this file: the installed package and a checkpoint's remote code each register theirs)
if all(resolver.__module__ != __name__ for resolver in STOCK_GEOMETRY_RESOLVERS):
    STOCK_GEOMETRY_RESOLVERS.append(stock_layer_geometry)

__all__ = ["DEFAULT_LEVEL_ORDER", "LEVEL_ORDERS", "RotaryDims", "attention_modules", "check_level_order",
           "check_levels_hold_whole_pairs", "decoder_geometries", "decoder_geometry", "dispatches_attention",
           "level_dim_order", "mlr_layer_indices", "model_rotary", "module_rotary_dims", "rotary_dims",
           "rotary_pair_order", "stock_layer_geometry", "stored_dim_order"]
