"""What the GPT-2 and T5 families' ``PreTrainedModel`` classes share: the ``auto_map`` written before saving, weight
init on transformers' own path, and the generation hooks that give ``generate()`` the hierarchical key cache and
keep the 2-D padding mask."""

from .structattn_cache import structattn_generation_cache


class StructAttnPreTrainedMixin:
    """Mixin placed before the transformers base class. Subclasses set ``structattn_auto_map`` and define
    ``new_cache(max_cache_len=None)`` (the empty cache ``generate()`` should fill)."""

    structattn_auto_map: dict = {}

    def post_init(self):
        # remote loading needs every Auto class in config.json, not only the class being saved
        self.config.auto_map = dict(self.structattn_auto_map)
        super().post_init()

    def _initialize_weights(self, module, is_custom_code: bool = False):
        # transformers guards custom code whose _init_weights might overwrite loaded tensors by skipping every module
        # whose direct parameters are all loaded, which also skips modules with no direct parameters at all (an
        # attention or feed-forward layer whose init sets its children: T5's q/k/v/o and wi/wo formulas, GPT-2's
        # scaled residual projections). These models initialise only through transformers.initialization, which
        # leaves loaded tensors alone, so they take transformers' own path.
        super()._initialize_weights(module, is_custom_code=False)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        # generate() would build a plain DynamicCache / StaticCache from the config; MLR layers need their
        # hierarchical key cache
        cache = structattn_generation_cache(self.new_cache, generation_config, model_kwargs, max_cache_length)
        if cache is not None:
            model_kwargs["cache"] = cache
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                     max_cache_length)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache, position_ids, **kwargs):
        # generate() turns the 2-D padding mask into 4-D masks for fixed-shape caches; these models build the masks
        # each variant needs themselves (MLR reads the 2-D padding flags), so keep the 2-D mask
        return attention_mask


__all__ = ["StructAttnPreTrainedMixin"]
