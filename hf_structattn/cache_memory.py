"""What a generation cache really allocates, measured on the cache object (the formulas of the bytes in use are in
``hf_structattn.flops``): ``allocated_cache_bytes(cache)``."""

from __future__ import annotations

from typing import Any

__all__ = ["allocated_cache_bytes", "returned_cache"]


def _tensors_in(value: Any, seen: set, depth: int):
    """Tensors reachable from ``value`` through lists, tuples, dicts and plain objects' attributes (not through
    modules, classes, functions or objects declaring ``holds_cache_state = False``), at most ``depth`` levels down;
    ``seen`` holds ids already walked (cycles)."""
    if id(value) in seen or depth < 0:
        return
    seen.add(id(value))
    if hasattr(value, "untyped_storage") and hasattr(value, "is_meta"):  # a torch.Tensor, without importing torch
        yield value
        return
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    elif isinstance(value, (str, bytes, int, float, bool, type(None), type)) or callable(value):
        return
    elif getattr(value, "holds_cache_state", True) is False:  # an object that declares it holds no cache state
        return
    elif hasattr(value, "__dict__") and not hasattr(value, "named_parameters"):  # an nn.Module is no cache state
        children = list(vars(value).values())
    else:
        return
    for child in children:
        yield from _tensors_in(child, seen, depth - 1)


def allocated_cache_bytes(cache: Any, *, cross_attention: bool = True) -> int:
    """Bytes a generation cache really allocates: the summed sizes of the unique storages of every tensor it
    holds, however the cache lays them out (reserved slots past the length, rings, positions, flags, scratch).

    ``cache``: a transformers ``Cache`` (``DynamicCache``, ``StaticCache``, ...),
    e.g. ``model.generate(..., return_dict_in_generate=True).cache``, or an ``EncoderDecoderCache`` (its
    self-attention cache and, with ``cross_attention``, its cross-attention cache). Every tensor attribute of
    the cache and of each of its ``layers`` counts, also inside lists, dicts and helper objects they hold (an MLR
    layer's ``MLRGeometry`` with its memo of index constants, shared by the caches of that geometry, included); a
    storage shared by several tensors (views, a ring inside a larger buffer) counts once, at its full size
    (``untyped_storage().nbytes()``), not only the part that is viewed. Compare with the formulas
    (``hf_structattn.flops``: ``key_cache_bytes``, ``attention_cost_report``, ``decoder_cache_report``), which count the
    bytes in use.
    """
    caches = [cache]
    if hasattr(cache, "self_attention_cache"):
        caches = [cache.self_attention_cache] + ([cache.cross_attention_cache] if cross_attention else [])
    if any(not hasattr(part, "layers") for part in caches):
        raise TypeError(f"cache={type(cache).__name__} has no `layers`: expected a transformers Cache")
    seen: set = set()
    storages = {}
    for part in caches:
        for tensor in _tensors_in(part, seen, depth=8):
            if tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            # two storages are the same allocation when they start at the same address on the same device
            storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def returned_cache(output: Any):
    """The cache that ``generate(..., return_dict_in_generate=True)`` or a forward with ``use_cache=True`` returned:
    its ``cache`` attribute, transformers 5's name (the older name is deprecated and warns)."""
    return output.cache
