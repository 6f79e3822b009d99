"""How a layer gets MLR attention (``structattn_install``): the config view an MLR layer's module reads, what
installing records for the forward's plan (the geometry, the module's scaling, its query groups), the model keeping
what it installed, and the registry through which a stock model's layers get their geometry."""

import copy
import pickle

import pytest
import torch
import transformers

import hf_structattn
from hf_structattn.decoder_patching import tiny_decoder
from hf_structattn.modeling.structattn_decoder_spec import stock_layer_geometry
from hf_structattn.modeling.structattn_install import (
    MLR_ATTENTION,
    MLR_EAGER_ATTENTION,
    STOCK_GEOMETRY_RESOLVERS,
    MLRLayerConfig,
    mlr_geometry_of,
)

from conftest import tiny_lm


def test_install_records_the_geometry_the_module_scaling_and_its_query_groups():
    """What the forward's plan reads before the layers run: a patched grouped-query Llama's layers (4 query heads
    over 2 KV heads, scaling head_dim ** -0.5), the GPT-2 family's (one query head per key head, its own scaling) and
    T5's (no 1/sqrt(d): scaling 1)."""
    llama = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    attention = llama.model.layers[0].self_attn
    config = attention.config
    assert isinstance(config, MLRLayerConfig) and config.mlr_geometry is mlr_geometry_of(attention)
    assert config.mlr_query_groups == attention.num_key_value_groups == 2
    assert config.mlr_scaling == attention.scaling == attention.head_dim ** -0.5
    gpt2 = tiny_lm("mlr").transformer.h[0].attn
    assert gpt2.config.mlr_query_groups == 1 and gpt2.config.mlr_scaling == gpt2.scaling
    from model_helpers import T5_MLR, tiny_structattn_t5

    t5 = tiny_structattn_t5(**T5_MLR).decoder.block[0].layer[0].SelfAttention
    assert t5.config.mlr_query_groups == 1 and t5.config.mlr_scaling == 1.0


def test_the_layer_config_is_a_live_view_of_the_models_config():
    """Every attribute is the model's config's, read live; writes go to it; ``_attn_implementation`` names the MLR
    function of the model's kind (eager -> ``"mlr_eager"``, anything else -> ``"mlr"``) and follows the model's
    ``set_attn_implementation``; copies and pickles keep what install recorded."""
    model = hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    view = model.model.layers[1].self_attn.config
    assert view.base_config is model.config and view.hidden_size == model.config.hidden_size
    assert view._attn_implementation == MLR_ATTENTION
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager" and view._attn_implementation == MLR_EAGER_ATTENTION
    view.rms_norm_eps = 1e-3  # a write through the view is the model's
    assert model.config.rms_norm_eps == 1e-3
    for copied in (copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(copied) is MLRLayerConfig and copied.mlr_geometry == view.mlr_geometry
        assert (copied.mlr_scaling, copied.mlr_query_groups) == (view.mlr_scaling, view.mlr_query_groups)
        assert copied.base_config is not model.config and copied.hidden_size == model.config.hidden_size


def test_a_model_keeps_the_layers_it_installed():
    """``structattn_layer_configs`` is found when the model is built (no module walk per forward, no process-wide
    counter): building another MLR model, of another geometry, leaves this one's table as it was."""
    first = tiny_lm("mlr", n_layer=3)
    table = first.transformer.structattn_layer_configs()
    assert sorted(table) == [0, 1, 2] and all(config.mlr_geometry.ranks == (8, 4, 2, 2) for config in table.values())
    assert first.transformer.structattn_cache_geometries() == {index: config.mlr_geometry
                                                                for index, config in table.items()}
    tiny_lm("mlr", n_layer=2, mlr_ranks=[12, 4])
    assert first.transformer.structattn_layer_configs() is table
    mixed = tiny_lm("mixed").transformer  # only its MLR layer holds the hierarchical form
    assert list(mixed.structattn_layer_configs()) == [0]


def test_a_stock_models_layers_get_their_geometry_through_the_registry():
    """The installed package registers the decoder spec's resolver once (the checkpoints of the GPT-2 and T5 families
    ship without the spec); a stock Llama whose config carries MLR fields runs MLR attention, installed on each layer
    at its first call, equal to the patched model."""
    assert sum(resolver.__name__ == "stock_layer_geometry" for resolver in STOCK_GEOMETRY_RESOLVERS) == 1
    assert stock_layer_geometry in STOCK_GEOMETRY_RESOLVERS
    stock = tiny_decoder("llama").double()
    patched = hf_structattn.patch(stock, mlr_ranks=[8, 4, 4], mlr_block_sizes=[8, 4])
    stock.config.mlr_ranks, stock.config.mlr_block_sizes = [8, 4, 4], [8, 4]
    stock.set_attn_implementation(MLR_ATTENTION)
    assert mlr_geometry_of(stock.model.layers[0].self_attn) is None
    ids = torch.randint(1, 61, (2, 19), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(stock(ids, use_cache=False).logits, patched(ids, use_cache=False).logits,
                               rtol=0, atol=1e-12)
    assert mlr_geometry_of(stock.model.layers[0].self_attn) == mlr_geometry_of(patched.model.layers[0].self_attn)
    assert type(stock) is transformers.LlamaForCausalLM


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_installing_again_on_the_same_module_replaces_the_view_not_stacks_it(family):
    from hf_structattn.modeling.structattn_install import install_mlr_attention

    module = (tiny_lm("mlr").transformer.h[0].attn if family == "gpt2" else
              hf_structattn.patch(tiny_decoder("llama"), mlr_ranks=[8, 4, 4],
                                  mlr_block_sizes=[8, 4]).model.layers[0].self_attn)
    base = module.config.base_config
    geometry = module.config.mlr_geometry
    install_mlr_attention(module, geometry)
    assert module.config.base_config is base and not isinstance(module.config.base_config, MLRLayerConfig)
