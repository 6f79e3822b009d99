"""Diagnostics of trained or fresh structured-attention models (not part of the checkpoint payload).

``effective_rank(model)`` measures the rank of each head's score function. A head scores a query input x and a
key input x' (both the layer's attention input, i.e. the ``ln_1`` output; the q/k norms' eps is set to 0 in the
probe) with ``s(x, x') = <q(x), k(x')>``, the logit scale folded into q. Without q/k normalisation this is the
bilinear form ``x^T M x'`` and its rank is the matrix rank of M: r for dense, D for bilinear BTT,
``min(D, sum_l p_l r_l)`` for bilinear MLR (paper §3.2).
With a normalisation the form depends on the point, so the probe takes the mixed second derivative
``H(x, x') = d^2 s / dx dx' = J_q(x)^T J_k(x')`` (D x D) at sampled pairs and reports

* ``span``: the rank of all sampled ``H`` stacked (``min`` of the row- and column-stacked ranks): the number of
  input directions the head's score can tell apart anywhere. This is the rank the experiments' labels use.
  LayerNorm over a slice of width w removes its mean direction (w - 1 left), and for w <= 2 its output is a
  constant or a sign (0 left); RMSNorm removes nothing here.
* ``local``: the median rank of ``H`` at one pair: every normalisation also removes the radial direction at a
  point (RMSNorm r - 1, LayerNorm r - 2).

For sequence MLR the nearest pairs (all levels shared) are probed; distant pairs use only the level-1 slice.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .modeling.structattn_attention import mlr_geometry_of
from .modeling.structattn_mlr_levels import depth_scale_vector


@dataclass
class HeadRank:
    layer: int
    head: int
    span: int
    local: int


def _queries_keys(attention, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, D) -> query, key (H, N, E) of one ``StructAttnGPT2Attention`` with the logit scale in the query."""
    query, key, _ = attention._query_key_value(hidden[None])  # bilinear: logit scales folded into the queries
    query, key = query[0], key[0]
    if attention.variant == "mlr":
        geometry = mlr_geometry_of(attention)
        scale = depth_scale_vector(geometry.ranks, geometry.scales(attention.scaling), geometry.num_levels,
                                   geometry.average_levels, query.dtype, query.device)
        return query * scale, key
    if attention.variant in ("dense", "swa"):
        return query * attention.scaling, key
    return query, key


def _rank(matrix: torch.Tensor, rtol: float) -> int:
    singular = torch.linalg.svdvals(matrix)
    if singular.numel() == 0 or singular[0] == 0:
        return 0
    return int((singular > rtol * singular[0]).sum())


@torch.no_grad()
def effective_rank(model, num_pairs: int = 8, inputs: torch.Tensor | None = None, seed: int = 0,
                   rtol: float = 1e-7) -> list[HeadRank]:
    """Rank of every head's score function (see the module docstring), computed in float64 on a copy.

    model: a ``StructAttnGPT2*`` model (LM, base or ICL head). inputs: optional (N, D) attention inputs to probe
    at (default ``N(0, I)`` samples); pairs are (inputs[2i], inputs[2i+1]). Returns one ``HeadRank`` per
    (layer, head), layer-major.
    """
    probe = copy.deepcopy(model).to(torch.float64).eval()
    blocks = probe.transformer.h if hasattr(probe, "transformer") else probe.h
    width = probe.config.n_embd
    if inputs is None:
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(2 * num_pairs, width, generator=generator, dtype=torch.float64)
    inputs = inputs.to(torch.float64)
    if inputs.dim() != 2 or inputs.shape[1] != width or inputs.shape[0] < 2:
        raise ValueError(f"inputs must have shape (N >= 2, {width}), got {tuple(inputs.shape)}")
    results = []
    for layer_idx, block in enumerate(blocks):
        attention = block.attn
        for module in attention.modules():
            # the q/k norms' eps is a regulariser of tiny inputs; without it the normalisation is exactly
            # scale-invariant, so the directions it removes give exact zeros, not eps-sized singular values
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                module.eps = 0.0
        jac_q = torch.func.jacrev(lambda x: _queries_keys(attention, x[None])[0][:, 0])
        jac_k = torch.func.jacrev(lambda x: _queries_keys(attention, x[None])[1][:, 0])
        with torch.enable_grad():
            forms = []  # (pairs, H, D, D)
            for first, second in zip(inputs[0::2], inputs[1::2]):
                dq, dk = jac_q(first), jac_k(second)  # (H, E, D)
                forms.append(dq.transpose(1, 2) @ dk)
        forms = torch.stack(forms)
        for head in range(forms.shape[1]):
            head_forms = forms[:, head]
            span = min(_rank(head_forms.reshape(-1, width), rtol),
                       _rank(head_forms.transpose(0, 1).reshape(width, -1), rtol))
            local = int(torch.tensor([_rank(form, rtol) for form in head_forms]).median())
            results.append(HeadRank(layer=layer_idx, head=head, span=span, local=local))
    return results





@torch.no_grad()
def mlr_logit_std_by_depth(model, num_tokens: int = 256, seed: int = 0) -> list[float]:
    """Standard deviation of the pre-softmax logits of the MLR layers by pair depth (1 = only the global level
    shared, L = all levels shared), pooled over layers, heads and token pairs; attention inputs ``N(0, I)``.

    Shows the logit scale the configuration gives each distance at init: e.g. a uniform ``1/sqrt(r)`` with level
    averaging makes the nearest pairs' logits several times smaller than the distant pairs' (``docs/models.md``).
    """
    blocks = model.transformer.h if hasattr(model, "transformer") else model.h
    layers = [block.attn for block in blocks if block.attn.variant == "mlr"]
    if not layers:
        raise ValueError("mlr_logit_std_by_depth: the model has no MLR layer")
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, model.config.n_embd, generator=generator)
    per_depth = [[] for _ in mlr_geometry_of(layers[0]).ranks]
    for attention in layers:
        geometry = mlr_geometry_of(attention)
        query, key, _ = attention.c_attn(hidden[None]).split(attention.embed_dim, -1)
        query, key = attention._split_heads(query)[0], attention._split_heads(key)[0]
        if attention.config.qk_layernorm:
            query, key = attention.q_norm(query), attention.k_norm(key)
        for depth in range(1, geometry.num_levels + 1):
            scale = depth_scale_vector(geometry.ranks, geometry.scales(attention.scaling), depth,
                                       geometry.average_levels, query.dtype, query.device)
            per_depth[depth - 1].append(((query * scale) @ key.transpose(-1, -2)).flatten())
    return [float(torch.cat(values).std()) for values in per_depth]
__all__ = ["HeadRank", "effective_rank", "mlr_logit_std_by_depth"]
