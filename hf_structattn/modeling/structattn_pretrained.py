"""What every family's ``PreTrainedModel`` class shares (GPT-2 family, T5 family, patched ``MLR<Arch>`` decoders):
the ``auto_map`` written before saving, weight init on transformers' own path, the hierarchical key cache for
``generate`` and direct forwards, and the one place where a private transformers hook is overridden.

``structattn_layer_configs()`` / ``structattn_cache_geometries()`` (per layer index, the MLR self-attention layers
whose cache layers hold the hierarchical form) are found on the attention modules MLR is installed on when the model
is built and kept on it; subclasses define ``structattn_num_cache_layers()``.
"""

from typing import Optional

from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

from .structattn_install import mlr_geometry_of
from .structattn_prepare import prepare_structattn_cache, set_rollback_window


def _rollback_window(generation_config, model_kwargs: dict, generation_mode) -> Optional[int]:
    """The most tokens speculative decoding will crop from this generation's cache (None: not speculative, or no
    bound known). Prompt lookup and a constant draft length crop at most the draft and one token; a growing draft
    (transformers' "heuristic" schedule) at most the new tokens still to come, never the prompt."""
    if generation_config.prompt_lookup_num_tokens is not None:
        return generation_config.prompt_lookup_num_tokens + 2
    assisted = model_kwargs.get("assistant_model") is not None or "assisted" in str(generation_mode).lower()
    if getattr(generation_config, "is_assistant", False):
        # an assistant's cache is cropped back to what the main model accepted, across calls it cannot see from
        # here (its drafts plus the main model's corrections): no bound is known, the log keeps all since its last crop
        return None
    if not assisted:
        return None
    if generation_config.num_assistant_tokens_schedule == "constant":
        return (generation_config.num_assistant_tokens or 0) + 2
    mask = model_kwargs.get("attention_mask")
    if mask is None or generation_config.max_length is None:
        return None
    return max(generation_config.max_length - mask.shape[-1], 0) + 2


class StructAttnPreTrainedMixin:
    """Mixin placed before the transformers base class. Subclasses set ``structattn_auto_map`` (may be empty)."""

    # transformers' flag by which serving engines (the transformers backends of vLLM and TGI) run a model with their
    # own attention function and paged cache: that would replace MLR attention (a silent dense model) or feed it a
    # cache layout it does not know. No serving engine is tested end to end, so no class of this package claims it
    # (the stock class a patched decoder is built on does).
    _supports_attention_backend = False

    structattn_auto_map: dict = {}
    # positions beyond which the model has no embedding (learned absolute positions), or None
    structattn_max_positions_field: Optional[str] = None

    def post_init(self):
        # remote loading needs every Auto class in config.json, not only the class being saved
        if self.structattn_auto_map:
            self.config.auto_map = dict(self.structattn_auto_map)
        super().post_init()
        self._structattn_find_layers()  # every family has installed its MLR layers by now

    @classmethod
    def is_custom_code(cls) -> bool:
        # transformers guards the weight init of custom code (which may write tensors in place) by skipping every module
        # whose direct parameters are all loaded -- which also skips modules without direct parameters, whose init
        # sets their children (GPT-2's scaled residual projections, T5's attention and feed-forward formulas). These
        # models initialise only through transformers.initialization, which leaves loaded tensors alone, like
        # transformers' own models: they take the library path.
        return False

    def structattn_layer_configs(self) -> dict:
        """{layer index: MLRLayerConfig} of the decoder self-attention modules MLR attention is installed on: what the
        cache layers of those indices hold and how the forward's plan reads them (geometry, the module's scaling and
        query groups). Kept on the model, found when it is built (``post_init``, after every family installed its
        layers), so that no forward walks the modules."""
        layers = self.__dict__.get("_structattn_layers")
        return layers[0] if layers is not None else self._structattn_find_layers()[0]

    def structattn_cache_geometries(self) -> dict:
        """{layer index: MLRGeometry} of ``structattn_layer_configs``."""
        layers = self.__dict__.get("_structattn_layers")
        return layers[1] if layers is not None else self._structattn_find_layers()[1]

    def _structattn_find_layers(self) -> tuple:
        configs = {}
        for module in self.modules():
            config = getattr(module, "config", None)
            if mlr_geometry_of(module) is not None and getattr(module, "is_decoder", True) and \
                    getattr(module, "is_causal", True):
                configs[module.layer_idx] = config
        layers = self.__dict__["_structattn_layers"] = (configs, {index: config.mlr_geometry
                                                                  for index, config in configs.items()})
        return layers

    def structattn_num_cache_layers(self) -> Optional[int]:
        return None

    def structattn_cache_config(self):
        """The config a cache for this model's (decoder) self-attention is built from."""
        return self.config.get_text_config(decoder=True)

    def new_cache(self, max_cache_len: Optional[int] = None):
        """An empty cache the transformers way (``DynamicCache(config=...)``, ``StaticCache`` with ``max_cache_len``;
        an ``EncoderDecoderCache`` of both for encoder-decoders) whose MLR layers hold the hierarchical form."""
        config = self.structattn_cache_config()
        if max_cache_len is None:
            cache = DynamicCache(config=config)
        else:
            cache = StaticCache(config=config, max_cache_len=max_cache_len)
        if self.config.is_encoder_decoder:
            cache = EncoderDecoderCache(cache, DynamicCache(config=config))
        return prepare_structattn_cache(cache, self.structattn_cache_geometries(),
                                        num_layers=self.structattn_num_cache_layers())

    # ------------------------------------------------------------------ generation hooks
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        # Private transformers hook (checked against transformers 5.24): the cache generate builds from the config
        # gets its MLR layers in hierarchical form and the final length reserved, so that it allocates exactly what
        # the generation needs. Speculative decoding writes its last draft past the max_length - 1 slots generate
        # sizes a static cache to (transformers' own StaticLayer then fails with an IndexError): reserve one draft.
        if generation_config.prompt_lookup_num_tokens is not None:
            max_cache_length += generation_config.prompt_lookup_num_tokens + 1
        elif model_kwargs.get("assistant_model") is not None or "assisted" in str(generation_mode).lower():
            max_cache_length += (generation_config.num_assistant_tokens or 0) + 1
        window = _rollback_window(generation_config, model_kwargs, generation_mode)
        # transformers sizes every later static cache to the longest one this model generated with (so that a compiled
        # decode step is not recompiled); a call that needs less than half of that gets a cache of its own size
        # instead (at most 2x the formula held for a shorter call). generation_config.max_cache_len keeps the worst
        # case on purpose, as in transformers.
        previous = getattr(self, "_previous_max_cache_length", None)
        if previous is not None and generation_config.max_cache_len is None and previous > 2 * max_cache_length:
            del self._previous_max_cache_length
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                       max_cache_length)
        cache = model_kwargs.get("cache")
        if cache is not None:
            prepare_structattn_cache(cache, self.structattn_cache_geometries(), reserve=max_cache_length,
                                     num_layers=self.structattn_num_cache_layers())
            if not getattr(cache, "_is_user_defined", False):
                set_rollback_window(cache, window)
            if getattr(generation_config, "is_assistant", False) and not getattr(cache, "_is_user_defined", False):
                # transformers activated rollback on the cache it built for an assistant model; the layers
                # replaced above start recording too
                cache.activate_past_recording()
        return result

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length,
                                  model_input_name, input_ids_length, inputs_tensor):
        # Private transformers hook (checked against transformers 5.24): a model with learned absolute positions
        # refuses, before any forward, a request that would run past them (the forward would fail only after the
        # prompt and part of the output).
        generation_config = super()._prepare_generated_length(generation_config, has_default_max_length,
                                                              has_default_min_length, model_input_name,
                                                              input_ids_length, inputs_tensor)
        if self.structattn_max_positions_field is None:
            return generation_config
        limit = getattr(self.config, self.structattn_max_positions_field)
        prompt = inputs_tensor.shape[1] if model_input_name == "inputs_embeds" else input_ids_length
        positions = generation_config.max_length
        if model_input_name == "inputs_embeds" and inputs_tensor.shape[1] != input_ids_length:
            positions += inputs_tensor.shape[1]  # transformers' max_length then counts only the new tokens
        if positions > limit:
            if generation_config.max_new_tokens is not None:
                asked = f"max_new_tokens={generation_config.max_new_tokens}"
            else:
                asked = "transformers' default length" if has_default_max_length else f"max_length={positions}"
            raise ValueError(f"generate: a {prompt}-token prompt + {positions - prompt} new tokens ({asked}) needs "
                             f"{positions} positions, beyond {self.structattn_max_positions_field}={limit} (this "
                             f"model has learned position embeddings for positions < {limit}); ask for at most "
                             f"{max(limit - prompt, 0)} new tokens")
        return generation_config

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache, position_ids, **kwargs):
        # generate() precomputes 4-D masks for fixed-shape caches; these models build their masks in forward and read
        # the new tokens' padding from the 2-D mask, so keep it
        return attention_mask


__all__ = ["StructAttnPreTrainedMixin"]
