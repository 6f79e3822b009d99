"""The forward's plan (``structattn_mlr_plan``, made by ``structattn_prepare.prepare_step`` before the first layer):
one plan, layout and read record shared by a model's layers, the formulation each kind of step is planned to take,
growth before any write, a caller's mask refused before any layer writes, immutable records, and a layer that finds
no plan refused in one line."""

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder
from hf_structattn.modeling.structattn_mlr_plan import (
    GeneralRead,
    InStepRead,
    LayerPlan,
    TracedRead,
    make_plan,
    read_formulation,
)
from hf_structattn.modeling.structattn_prepare import prepare_step
from hf_structattn.modeling.structattn_step import STEP_KEY, build_step

from conftest import tiny_lm
from cache_helpers import cache_layer, make_rows, plan_step, small_geometry, write


def _llama(layers=4):
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return hf_structattn.patch(transformers.LlamaForCausalLM(config).eval(), mlr_ranks=[8, 4, 4],
                               mlr_block_sizes=[8, 4])


def _decode_step(model, cache, position, batch=2, mask=None):
    """The plan of a one-token forward at ``position`` (the model's own preparation, as its forward makes it)."""
    return prepare_step(model, cache=cache, batch=batch, length=1, device=torch.device("cpu"),
                        position_ids=torch.full((batch, 1), position), attention_mask=mask,
                        heads=model.config.num_attention_heads)


@torch.no_grad()
def test_a_models_layers_share_one_plan_layout_and_read_record():
    """Four MLR layers of a patched Llama: one ``LayerPlan`` object at every MLR index of ``step.layers`` (its
    layout, its read record, whose plan is the geometry's), an in-step read for a decode step of rows in step; the
    first layer's plan is the later layers'."""
    model = _llama()
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    model(ids, cache=cache)
    step = _decode_step(model, cache, 12)
    plans = step.layers
    assert len(plans) == 4 and all(type(plan) is LayerPlan for plan in plans)
    assert all(plan is plans[0] for plan in plans)
    assert type(plans[0].read) is InStepRead and plans[0].layout.first_slot == 12 - plans[0].layout.base
    assert plans[0].layout.plan.geometry is model.model.layers[0].self_attn.config.mlr_geometry
    assert plans[0].scaling == model.model.layers[0].self_attn.scaling


@torch.no_grad()
@pytest.mark.parametrize("case, expected", [("rows in step", InStepRead), ("padded rows", GeneralRead),
                                            ("eager", GeneralRead), ("gradients", GeneralRead),
                                            ("bfloat16", InStepRead)])
def test_each_kind_of_step_is_planned_to_take_its_formulation(case, expected):
    """The formulation is the read record's type, decided before the first layer: rows in step read in step (also
    in bfloat16: each product in bfloat16, added onto float32 scores); rows at different positions (left padding
    with generate's positions), the eager implementation (maps) and grad mode take the general read."""
    model = _llama(2)
    if case == "bfloat16":
        model = model.to(torch.bfloat16)
    if case == "eager":
        model.set_attn_implementation("eager")
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(2, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    if case == "padded rows":  # positions as generate gives them: the padded row is 3 positions behind
        mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model(ids, attention_mask=mask, position_ids=positions, cache=cache)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    with torch.set_grad_enabled(case == "gradients"):
        step = prepare_step(model, cache=cache, batch=2, length=1, device=torch.device("cpu"),
                            position_ids=positions[:, -1:] + 1, attention_mask=mask, heads=4)
    assert type(step.layers[0].read) is expected


def test_traced_steps_and_first_chunks_are_planned_without_host_facts_or_reads():
    """A traced step (no host facts) reads one token per row by the tiled formulation, a traced chunk by the general
    one; a layer's first chunk has no read record (it attends to itself with the uncached op)."""
    geometry = small_geometry()
    _, k, v, positions, valid = make_rows(length=12, pads=(0, 2, 0), offsets=(0, 0, 3))
    layer = cache_layer(True, geometry)
    first = plan_step(layer, positions[:, :8], valid[:, :8])
    assert first.layers[0].read is None
    write(layer, k[:, :, :8], v[:, :, :8], positions[:, :8], valid[:, :8])
    assert type(plan_step(layer, positions[:, 8:9], valid[:, 8:9], traced=True).layers[0].read) is TracedRead
    assert type(plan_step(layer, positions[:, 8:11], valid[:, 8:11], traced=True).layers[0].read) is GeneralRead


def test_read_formulation_is_the_one_place_that_picks():
    """``read_formulation`` over a plan of rows in step (in-step unless something else is asked) and a traced plan."""
    geometry = small_geometry()
    layer = cache_layer(False, geometry)
    _, k, v, positions, valid = make_rows(length=12, pads=(0, 0, 0), offsets=(0, 0, 0))
    write(layer, k[:, :, :8], v[:, :, :8], positions[:, :8], valid[:, :8])
    step = plan_step(layer, positions[:, 8:9], valid[:, 8:9])
    plan = step.layers[0].layout.plan
    assert plan.host_write and plan.in_step
    common = dict(contiguous=True, dtype=torch.float32, biased=False, maps=False, gradients=False)
    assert read_formulation(plan, **common) is InStepRead
    assert read_formulation(plan, **{**common, "dtype": torch.bfloat16}) is InStepRead
    for changed in ("biased", "maps", "gradients"):
        assert read_formulation(plan, **{**common, changed: True}) is GeneralRead, changed
    assert read_formulation(plan, **{**common, "contiguous": False}) is GeneralRead
    traced = plan._replace(traced=True)
    assert read_formulation(traced, **common) is TracedRead
    assert read_formulation(traced._replace(chunk=3), **common) is GeneralRead
    assert read_formulation(traced, **{**common, "maps": True}) is GeneralRead


@torch.no_grad()
def test_dynamic_layers_grow_when_planned_before_any_layer_writes():
    """A dynamic cache filled to its capacity grows while the next forward is planned: every MLR layer's storage is
    larger before the first layer runs, holds what it held, and the rows' positions are untouched until the
    writes."""
    model = _llama(2)
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(2, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    model(ids[:, :8], cache=cache)
    position = 8
    while all(layer.capacity > position for layer in cache.layers):
        model(ids[:, position:position + 1], cache=cache)
        position += 1
    before = [(layer.capacity, layer.keys_storage().clone(), layer.last_positions.clone()) for layer in cache.layers]
    step = _decode_step(model, cache, position)
    for layer, (capacity, keys, last) in zip(cache.layers, before):
        assert layer.capacity > capacity and torch.equal(layer.keys_storage()[:, :, :capacity], keys)
        assert torch.equal(layer.last_positions, last)
    assert step.layers[0].layout.capacity == cache.layers[0].capacity


@torch.no_grad()
def test_a_mask_the_cache_cannot_apply_is_refused_before_any_layer_writes():
    """A caller's 4-D mask that lets a decode step see a padding token (never stored) is refused while the forward
    is planned: no layer has written the step's token."""
    model = tiny_lm("mlr", n_layer=3).double()
    ids = torch.randint(2, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0
    cache = model(ids[:, :8], attention_mask=mask, use_cache=True).cache
    lengths = [(layer.get_seq_length(), layer.last_positions.clone()) for layer in cache.layers]
    allowed = torch.ones(2, 1, 1, 9, dtype=torch.bool)  # row 1's padding keys allowed
    with pytest.raises(ValueError, match="does not hold"):
        model(ids[:, 8:9], attention_mask=allowed, cache=cache)
    for layer, (length, last) in zip(cache.layers, lengths):
        assert layer.get_seq_length() == length and torch.equal(layer.last_positions, last)


def test_plan_records_are_immutable():
    geometry = small_geometry()
    layer = cache_layer(False, geometry)
    _, k, v, positions, valid = make_rows(length=10, pads=(0, 0, 0), offsets=(0, 0, 0))
    write(layer, k[:, :, :8], v[:, :, :8], positions[:, :8], valid[:, :8])
    plan = plan_step(layer, positions[:, 8:9], valid[:, 8:9]).layers[0]
    for record, field in ((plan, "read"), (plan.layout, "base"), (plan.layout.plan, "chunk"), (plan.read, "slots")):
        with pytest.raises(AttributeError):
            setattr(record, field, None)


def test_a_layer_the_step_holds_no_plan_for_is_refused_in_one_line():
    """A step made without its plan (``build_step`` alone) cannot write an MLR layer: the error names the missing
    plan and where it is made."""
    geometry = small_geometry()
    layer = cache_layer(False, geometry)
    _, k, v, positions, valid = make_rows(length=4, pads=(0, 0, 0), offsets=(0, 0, 0))
    write(layer, k[:, :, :2], v[:, :, :2], positions[:, :2], valid[:, :2])
    from transformers.cache_utils import Cache

    step = build_step(cache=Cache(layers=[layer]), positions=positions[:, 2:3], valid=None, batch=3, length=1,
                      device=torch.device("cpu"))
    with pytest.raises(ValueError, match="no plan for it.*prepare_step"):
        layer.update(k[:, :, 2:3], v[:, :, 2:3], kwargs={STEP_KEY: step})
    assert layer.get_seq_length() == 2


def test_a_plan_made_without_padding_flags_shares_the_geometrys_all_real_table():
    """Rows without padding read the same (B, c) all-real flags from the geometry's bounded memo, step after step:
    no tensor is made per forward for them."""
    geometry = small_geometry()
    _, _, _, positions, _ = make_rows(length=6, pads=(0, 0, 0), offsets=(0, 0, 0))
    step = build_step(cache=None, positions=positions[:, :1], valid=None, batch=3, length=1,
                      device=torch.device("cpu"))
    first, second = make_plan(step, geometry), make_plan(step, geometry)
    assert first.real is second.real and bool(first.real.all()) and first.valid is None


def test_a_t5_decoder_plans_its_relative_bias_at_the_slots():
    """T5's decoder self-attention over the MLR cache: its relative bias (here a stand-in over the token indices) is
    read at the cache's slots while the forward is planned (a general read carrying it), once for every layer."""
    from model_helpers import T5_MLR, tiny_structattn_t5

    model = tiny_structattn_t5(**T5_MLR).double()
    ids = torch.randint(2, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    decoder_ids = torch.randint(2, 50, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(input_ids=ids, decoder_input_ids=decoder_ids[:, :4], use_cache=True)
        step = prepare_step(model, cache=out.cache, batch=2, length=1, device=torch.device("cpu"),
                            count_positions=True, heads=4,
                            relative_bias=lambda past: torch.zeros(1, 4, 1, past + 1, dtype=torch.float64))
    reads = {id(plan.read) for plan in step.layers if plan is not None}
    read = next(plan.read for plan in step.layers if plan is not None)
    assert len(reads) == 1 and type(read) is GeneralRead and read.bias is not None
    assert read.bias.shape[-1] == step.layers[0].layout.slots


def test_tiny_decoder_reads_the_same_through_its_plan():
    """A patched decoder's decode steps, planned before their first layer, give the logits of one uncached forward
    (float64)."""
    model = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4]).double()
    ids = torch.randint(2, 61, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = transformers.DynamicCache(config=model.config)
        pieces = [model(ids[:, :7], cache=cache).logits]
        pieces += [model(ids[:, index:index + 1], cache=cache).logits for index in range(7, 20)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-12)
