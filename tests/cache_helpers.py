"""Helpers shared by the tests that drive an MLR cache layer without a model (tests/test_mlr_cached.py,
tests/test_generation_cache.py, tests/test_rollback.py, tests/test_mlr_plan.py): a small geometry, rows with
padding and offsets, the model's flow for one chunk (the step and its plan, then ``update``, the one write) and the
cached read, and the naive reference of one query index."""

import dataclasses
import types

import torch
from transformers.cache_utils import Cache

from hf_structattn.modeling.structattn_cache import MLRKeyCacheLayer, MLRStaticKeyCacheLayer
from hf_structattn.modeling.structattn_geometry import MLRGeometry
from hf_structattn.modeling.structattn_install import MLRLayerConfig
from hf_structattn.modeling.structattn_mlr_cached import mlr_cached_attention
from hf_structattn.modeling.structattn_prepare import plan_layers
from hf_structattn.modeling.structattn_reference import mlr_attention_reference
from hf_structattn.modeling.structattn_step import STEP_KEY, build_step

RANKS, BLOCKS = [4, 2, 1, 1], [16, 8, 4]
EXACT = dict(atol=1e-12, rtol=1e-12)


def small_geometry(average_levels=False, blocks=BLOCKS, level_rule="blocks"):
    return MLRGeometry.build(RANKS, blocks, [0.5, 0.7, 0.9, 1.1], average_levels=average_levels,
                             level_rule=level_rule)


def cache_layer(static, geometry, capacity=48):
    return MLRStaticKeyCacheLayer(capacity, geometry) if static else MLRKeyCacheLayer(geometry)


def layer_config(geometry, groups=2, implementation="sdpa"):
    """The ``MLRLayerConfig`` of an attention module of ``geometry`` (level scales of its own, so no module scaling)
    with ``groups`` query heads per cached head, under a model config naming ``implementation``."""
    return MLRLayerConfig(types.SimpleNamespace(_attn_implementation=implementation), geometry, None, groups)


def plan_step(layer, positions, valid, *, traced=False, gradients=False, groups=2, implementation="sdpa",
              custom_mask=None):
    """The model's step for one chunk into ``layer`` (one host read) with its plan, made before the write as a model
    forward makes it. ``traced``: the step as torch.compile sees it (no host facts: fixed shapes, the whole
    storage); ``gradients``: planned with grad mode on (a decode runs under ``no_grad``)."""
    cache = Cache(layers=[layer])
    step = build_step(cache=cache, positions=positions, valid=valid, batch=positions.shape[0],
                      length=positions.shape[1], device=positions.device)
    if traced:
        step = dataclasses.replace(step, facts=None)
    config = layer_config(layer.geometry, groups, implementation)
    with torch.set_grad_enabled(gradients):
        layers = plan_layers(step, cache, {0: config}, custom_mask=custom_mask)
    return dataclasses.replace(step, layers=layers)


def write(layer, keys, values, positions, valid, traced=False, **plan):
    """The model's flow for one chunk: the step and its plan, then ``update``, the one write, which returns the
    layer's view."""
    step = plan_step(layer, positions, valid, traced=traced, **plan)
    _, view = layer.update(keys, values, kwargs={STEP_KEY: step})
    return view


def attend(query, view, **kwargs):
    """query (B, Hk, g, c, r) -> (B, Hk, g, c, dv) [, probabilities (B, Hk, g c, S) in slot order], by the layer's
    read record."""
    batch, heads, groups, chunk, width = query.shape
    out, weights = mlr_cached_attention(query.reshape(batch, heads * groups, chunk, width), view, view.plan.read,
                                        **kwargs)
    out = out.transpose(1, 2).reshape(batch, heads, groups, chunk, -1)
    return (out, weights) if kwargs.get("return_weights") else out


def make_rows(batch=3, length=40, pads=(0, 5, 13), offsets=(0, 0, 3), seed=0, heads=2, dtype=torch.float64):
    """q (B, Hk, g=2, T, r), k, v (B, Hk, T, r) and per-row padding / positions: row b has ``pads[b]`` padding tokens
    first and real positions starting at ``offsets[b]``."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 2, length, 8, generator=generator, dtype=dtype)
    k = torch.randn(batch, heads, length, 8, generator=generator, dtype=dtype)
    v = torch.randn(batch, heads, length, 5, generator=generator, dtype=dtype)
    valid = torch.ones(batch, length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0) + torch.tensor(offsets)[:, None]
    positions = positions.masked_fill(~valid, 1)  # what generate gives padding
    return q, k, v, positions, valid


def reference_rows(q, k, v, positions, valid, geometry, query_index):
    """Reference MLR output of query index ``query_index`` over all keys up to it: (B, Hk, g, dv)."""
    end = query_index + 1
    outs = []
    for group in range(q.shape[2]):
        out = mlr_attention_reference(q[:, :, group, :end], k[:, :, :end], v[:, :, :end], ranks=geometry.ranks,
                                      block_sizes=geometry.block_sizes, scales=list(geometry.level_scales),
                                      positions=positions[:, :end], attention_mask=valid[:, :end],
                                      average_levels=geometry.average_levels, level_rule=geometry.level_rule)
        outs.append(out[:, :, -1])
    return torch.stack(outs, dim=2)
