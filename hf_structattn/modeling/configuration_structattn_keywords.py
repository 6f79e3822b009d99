"""Which keyword arguments the package's config classes accept, and where a saved config.json may carry more.

transformers' configs accept any keyword and keep an unknown one as an attribute (so a config.json written by an
older release or by other code still loads); a misspelt field then builds a model with that field's default and no
word said. The package's config classes refuse, at construction, every keyword that is not

* a field of the class, an ``attribute_map`` alias, or a property with a setter (``num_labels``, ``name_or_path``);
* a key that transformers' ``PreTrainedConfig`` itself reads or writes (``model_type``, ``torch_dtype``,
  ``auto_map``, ``_name_or_path``, ``attn_implementation``, ...);
* a generation key (``GenerationConfig``'s own fields: ``decoder_start_token_id``, ``max_length``, ...), which
  transformers reads from a model config;
* a key the class declares in ``accepted_keywords`` (older field names it migrates, keys its parent class reads or
  writes, keys of the checkpoints it wraps),

with a one-line ``ValueError`` naming the keyword and its value and, where ``difflib`` finds one, the field it
resembles. A dict read from a file (``from_dict``: ``from_pretrained``, ``AutoConfig``, the patcher converting
another checkpoint's config) is read as transformers reads it: keys it does not know are kept as attributes, since
save_pretrained writes whatever attributes other code set (``quantization_config``, a Chronos ``chronos_config``).
"""

try:  # the payload imports only torch and transformers unguarded (a checkpoint's code stays auditable)
    import difflib
except ImportError:  # pragma: no cover - the standard library always has it
    difflib = None
from dataclasses import fields

# keys PreTrainedConfig's __post_init__ / from_dict consume, or that save_pretrained writes besides the fields
PRETRAINED_CONFIG_KEYWORDS = ("model_type", "torch_dtype", "_name_or_path", "_commit_hash", "attn_implementation",
                              "experts_implementation", "_attn_implementation_internal",
                              "_experts_implementation_internal", "auto_map", "quantization_config")


def _settable_properties(config_class) -> set:
    return {name for klass in config_class.__mro__ for name, value in vars(klass).items()
            if isinstance(value, property) and value.fset is not None}


def _generation_keys() -> set:
    from transformers import GenerationConfig  # only when a keyword is not otherwise known

    return set(GenerationConfig().to_dict())


def _class_keywords(config_class) -> set:
    return ({f.name for f in fields(config_class)} | set(config_class.attribute_map) |
            _settable_properties(config_class) | set(PRETRAINED_CONFIG_KEYWORDS) |
            set(getattr(config_class, "accepted_keywords", ())))


def unknown_keywords(config_class, names) -> list:
    """The names among ``names`` that ``config_class`` does not accept as keyword arguments (see the module
    docstring), in order."""
    known = _class_keywords(config_class)
    unknown = [name for name in names if name not in known]
    if unknown:
        generation = _generation_keys()
        unknown = [name for name in unknown if name not in generation]
    return unknown


def refuse_unknown_keywords(config, kwargs: dict) -> None:
    """Raise a one-line ValueError for the first keyword of ``kwargs`` (the ones that are not fields, as
    transformers' ``__init__`` passes them to ``__post_init__``) that ``type(config)`` does not accept."""
    config_class = type(config)
    unknown = unknown_keywords(config_class, kwargs)
    if not unknown:
        return
    name = unknown[0]
    candidates = sorted({f.name for f in fields(config_class)} | set(config_class.attribute_map))
    close = difflib.get_close_matches(name, candidates, n=1) if difflib is not None else []
    hint = f" (did you mean {close[0]!r}?)" if close else f"; its fields: {', '.join(candidates)}"
    raise ValueError(f"{config_class.__name__}: unknown keyword {name}={kwargs[name]!r}{hint}")


class ConfigKeywordsMixin:
    """Placed first among a config class's bases; the class calls ``refuse_unknown_keywords(self, kwargs)`` first
    thing in its ``__post_init__``. ``accepted_keywords``: keys besides the fields that the class reads."""

    accepted_keywords = ()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' ``from_dict``, keeping the keys of ``config_dict`` that are not keywords of this class as
        attributes (as transformers' own configs do) instead of refusing them."""
        return_unused = kwargs.get("return_unused_kwargs", False)
        unknown = set(unknown_keywords(cls, config_dict))
        result = super().from_dict({k: v for k, v in config_dict.items() if k not in unknown}, **kwargs)
        config, unused = result if return_unused else (result, {})
        for name in config_dict:
            if name in unknown:  # a keyword override of such a key wins, as it would for transformers' configs
                setattr(config, name, kwargs[name] if name in kwargs else config_dict[name])
                unused.pop(name, None)
        return result


__all__ = ["ConfigKeywordsMixin", "refuse_unknown_keywords", "unknown_keywords"]
