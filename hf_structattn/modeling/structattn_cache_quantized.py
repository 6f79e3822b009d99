"""The quantised hierarchical MLR cache: level-1 keys and values held as ``bits``-bit codes.

An MLR cache layer holds, per row and KV head, the level-1 keys (``r_1`` dims) and the values of every position, and
the finer levels' rings of at most ``b_l`` entries (``structattn_cache``). The first two grow with the context; the
rings do not. ``MLRQuantizedKeyCacheLayer`` stores the growing two as codes: each slot's level-1 key and its value
are cut into groups of at most ``group_size`` dims, and each group is rounded to ``2**bits`` levels between its
minimum and maximum (asymmetric, per token, as transformers' quantised caches and KIVI's values do). A slot's row
is its packed codes followed by each group's scale and minimum in the model's dtype (``EntryCodec``). The rings stay in
the model's dtype: they are bounded, and they hold the nearest keys' finer dims.

The semantics are those of MLR attention whose level-1 keys and values were rounded first (``EntryCodec.round``):
the layer hands its queries the rounded entries of the chunk it writes (a first chunk attends over those), and the
cached read decodes the stored rows slot block by slot block (``structattn_mlr_cached``), so that no float copy of the
whole cache is made. Cached == uncached with the same rounding is what the tests check.

A model uses it where a cache asks for it: ``MLRQuantizedCache(config=model.config, bits=4)``, or transformers'
``QuantizedCache`` (``cache_implementation="quantized"``), whose empty layers become quantised MLR layers of the same
``nbits`` and ``q_group_size`` for the MLR layers (``structattn_prepare.prepare_structattn_cache``; the other layers
stay transformers' own).
"""

import math
from typing import NamedTuple, Optional

import torch
from transformers.cache_utils import DynamicCache

from .structattn_cache import MLRKeyCacheLayer
from .structattn_geometry import MLRGeometry

QUANTISED_BITS = (2, 4, 8)
READ_SLOTS = 4096  # slots decoded at a time by a cached read: a bounded float copy, few Python calls


def check_quantisation(bits, group_size, key_bits=None) -> None:
    """Refuse a width or group size the codec does not have, naming the field."""
    for name, value in (("bits", bits), ("key_bits", bits if key_bits is None else key_bits)):
        if value not in QUANTISED_BITS:
            raise ValueError(f"{name} must be one of {list(QUANTISED_BITS)} (bits per code of the quantised MLR "
                             f"cache), got {value!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int (dims per scale of the quantised MLR cache), got "
                         f"{group_size!r}")


class EntryCodec(NamedTuple):
    """How a quantised layer encodes one kind of slot entry (the level-1 key or the value) of ``width`` dims.

    bits: per code; group: dims per scale (``min(group_size, width)``, a divisor of ``width``); dtype: of the scales,
    minimums and decoded entries (the model's); code_bytes: packed codes per row, padded to a multiple of the dtype's
    size so that the scales that follow are aligned; row_bytes: code_bytes + a scale and a minimum per group."""

    width: int
    bits: int
    group: int
    dtype: torch.dtype
    code_bytes: int
    row_bytes: int

    @classmethod
    def build(cls, width: int, bits: int, group_size: int, dtype: torch.dtype, name: str) -> "EntryCodec":
        group = min(group_size, width)
        if width % group:
            raise ValueError(f"group_size {group_size} does not divide the {width} dims of the {name}: the quantised "
                             f"MLR cache needs groups of equal size (pick a divisor of {width})")
        size = torch.empty((), dtype=dtype).element_size()
        code_bytes = math.ceil(math.ceil(width * bits / 8) / size) * size
        return cls(width, bits, group, dtype, code_bytes, code_bytes + 2 * (width // group) * size)

    def encode(self, entries: torch.Tensor) -> tuple:
        """entries (..., width) -> (rows (..., row_bytes) uint8, the entries as the rows decode them (..., width) in
        ``dtype``)."""
        levels = (1 << self.bits) - 1
        grouped = entries.detach().to(self.dtype).unflatten(-1, (-1, self.group))
        low = grouped.amin(-1, keepdim=True)
        scale = (grouped.amax(-1, keepdim=True) - low) / levels
        codes = ((grouped - low) / scale.clamp(min=torch.finfo(self.dtype).tiny)).round_().clamp_(0, levels)
        rounded = (codes * scale + low).flatten(-2)  # as ``decode`` computes it, in the same dtype
        codes = codes.to(torch.uint8).flatten(-2)
        per_byte = 8 // self.bits
        if per_byte > 1:  # planar: byte j holds code j + k P in bits k b.. (P = ceil(width / per_byte))
            codes = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % per_byte))
            codes = (codes.unflatten(-1, (per_byte, -1)) << self._shifts(codes.device)[:, None]).sum(
                -2, dtype=torch.uint8)
        codes = torch.nn.functional.pad(codes, (0, self.code_bytes - codes.shape[-1]))
        params = torch.cat([scale, low], -1).flatten(-2).contiguous().view(torch.uint8)
        return torch.cat([codes, params], -1), rounded

    def decode(self, rows: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """rows (..., row_bytes) uint8 -> entries (..., width) in ``work`` (computed in ``dtype``, as ``encode``)."""
        planes, scale, low = self.planes(rows)
        codes = torch.cat(planes, -1)[..., :self.width]
        return (codes.unflatten(-1, (-1, self.group)) * scale[..., None] + low[..., None]).flatten(-2).to(work)

    def planes(self, rows: torch.Tensor) -> tuple:
        """rows (..., row_bytes) uint8 -> (codes of dims [k P, (k + 1) P) for k < 8 / bits, each (..., <= P), P =
        ceil(width * bits / 8); scales (..., groups); minimums (..., groups)), in ``dtype``. Planar, so that no
        interleaving copy is made; each plane by a shift and a mask by a scalar (a shift by a tensor of shifts is not
        vectorised on the CPU: 5x the time)."""
        per_byte, mask = 8 // self.bits, (1 << self.bits) - 1
        plane = -(-self.width // per_byte)
        packed = rows[..., :plane]
        planes = [packed] if per_byte == 1 else [(packed >> (self.bits * index) if index else packed) & mask
                                                 for index in range(per_byte)]
        planes = [part[..., :max(min(plane, self.width - index * plane), 0)].to(self.dtype)
                  for index, part in enumerate(planes)]
        params = rows[..., self.code_bytes:].contiguous().view(self.dtype).unflatten(-1, (-1, 2))
        return planes, params[..., 0], params[..., 1]

    def round(self, entries: torch.Tensor) -> torch.Tensor:
        """entries (..., width) rounded as the cache holds them, in their dtype: what an uncached model with the same
        quantisation computes with."""
        return self.encode(entries)[1].to(entries.dtype)

    def _shifts(self, device) -> torch.Tensor:
        return torch.arange(0, 8, self.bits, dtype=torch.uint8, device=device)


class SlotCodecs(NamedTuple):
    """The codecs of a quantised layer's slot storages: keys (level-1, ``r_1`` dims) and values (``dv``)."""

    keys: EntryCodec
    values: EntryCodec

    @classmethod
    def build(cls, geometry: MLRGeometry, value_width: int, key_bits: int, value_bits: int, group_size: int,
              dtype: torch.dtype):
        return cls(EntryCodec.build(geometry.ranks[0], key_bits, group_size, dtype, "level-1 keys (mlr_ranks[0])"),
                   EntryCodec.build(value_width, value_bits, group_size, dtype, "values (the head dim)"))


def decoded_products(query: torch.Tensor, rows: torch.Tensor, codec: EntryCodec, work: torch.dtype) -> torch.Tensor:
    """query (N, n, r_1), rows (N, S, row_bytes) of level-1 keys -> scores (N, n, S) in ``work``, ``READ_SLOTS``
    slots at a time. With one group per key the scale and minimum multiply the products, not the keys
    (q.(s c + m) = s (q.c) + m sum(q)), and each plane of codes meets its slice of the query."""
    pieces, one_group = [], codec.group == codec.width
    total = query.sum(-1, keepdim=True) if one_group else None
    for start in range(0, max(rows.shape[1], 1), READ_SLOTS):
        part = rows[:, start:start + READ_SLOTS]
        if not one_group:
            pieces.append(torch.bmm(query, codec.decode(part, work).transpose(1, 2)))
            continue
        planes, scale, low = codec.planes(part)
        products, offset = None, 0
        for plane in planes:
            width = plane.shape[-1]
            piece = torch.bmm(query[..., offset:offset + width], plane.to(work).transpose(1, 2))
            products = piece if products is None else products.add_(piece)
            offset += width
        pieces.append(torch.addcmul(products * scale.to(work).transpose(1, 2), total, low.to(work).transpose(1, 2)))
    return torch.cat(pieces, dim=-1)


def decoded_weighted_sum(weights: torch.Tensor, rows: torch.Tensor, codec: EntryCodec) -> torch.Tensor:
    """weights (N, n, S), rows (N, S, row_bytes) of values -> (N, n, dv) in the weights' dtype, ``READ_SLOTS`` slots
    at a time. With one group per value the scale multiplies the weights and the minimums add up once
    (sum_s p_s (s_s c_s + m_s) = (p s) C + p . m), each plane of codes into its slice of the output."""
    out = weights.new_zeros(weights.shape[0], weights.shape[1], codec.width)
    dtype = weights.dtype
    for start in range(0, rows.shape[1], READ_SLOTS):
        part, part_weights = rows[:, start:start + READ_SLOTS], weights[..., start:start + READ_SLOTS]
        if codec.group != codec.width:
            out.baddbmm_(part_weights, codec.decode(part, dtype))
            continue
        planes, scale, low = codec.planes(part)
        scaled, offset = part_weights * scale.to(dtype).transpose(1, 2), 0
        for plane in planes:
            width = plane.shape[-1]
            out[..., offset:offset + width].baddbmm_(scaled, plane.to(dtype))
            offset += width
        out.add_(torch.bmm(part_weights, low.to(dtype)))
    return out


class MLRQuantizedKeyCacheLayer(MLRKeyCacheLayer):
    """A dynamic MLR cache layer whose values are ``bits``-bit codes and level-1 keys ``key_bits``-bit codes (default
    ``bits``; ``EntryCodec``): slot rows of
    ``SlotCodecs.keys.row_bytes`` and ``.values.row_bytes`` bytes; the rings as the plain layer holds them. Its reads
    are the general read, which decodes the rows block by block. Dynamic only (no static or compiled form)."""

    _layer_type = None  # a cache asks for it (``MLRQuantizedCache``); config-built caches keep the plain MLR layer

    def __init__(self, geometry: Optional[MLRGeometry] = None, bits: int = 4, group_size: int = 64,
                 key_bits: Optional[int] = None, **kwargs):
        check_quantisation(bits, group_size, key_bits)
        self.bits, self.group_size = bits, group_size
        self.key_bits = bits if key_bits is None else key_bits
        self.codecs = None  # made by the first write, which sees the value width and the dtype
        super().__init__(geometry, **kwargs)

    def _slot_entries(self, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        codecs = self.codecs
        if codecs is None or codecs.values.width != values.shape[-1] or codecs.keys.dtype != values.dtype:
            codecs = self.codecs = SlotCodecs.build(self.geometry, values.shape[-1], self.key_bits, self.bits,
                                                    self.group_size, values.dtype)
        rank = self.geometry.ranks[0]
        key_rows, first = codecs.keys.encode(keys[..., :rank])
        value_rows, rounded_values = codecs.values.encode(values)
        keys = torch.cat([first.to(keys.dtype), keys[..., rank:]], -1)
        return keys, rounded_values.to(values.dtype), key_rows, value_rows

    def _allocate(self, like_keys, like_values, capacity: int) -> None:
        batch, heads = like_keys.shape[:2]
        codecs = self.codecs
        self._storage = tuple(like_keys.new_zeros(batch, heads, capacity, codec.row_bytes, dtype=torch.uint8)
                              for codec in codecs)
        self._fine = self._new_fine(like_keys.new_empty((batch, heads, 0), dtype=codecs.keys.dtype), capacity)
        self.rings = self._fine_views(self._fine, capacity)
        self._used = 0

    def planned_storage(self, facts, chunk: int) -> tuple:
        planned = super().planned_storage(facts, chunk)
        return planned if self.codecs is None else planned[:3] + (self.codecs.keys.dtype,) + planned[4:]

    def key_cache_bytes(self) -> int:
        """Bytes of keys by the formula: ``S`` level-1 rows of codes, scales and minimums, and the rings' entries in
        the model's dtype, batch and heads included."""
        if not self.is_initialized or not self.is_bound:
            return 0
        slots = self._held_slots()
        fine = self.geometry.key_cache_elements(slots) - slots * self.geometry.ranks[0]
        batch, heads = self._storage[0].shape[:2]
        return batch * heads * (slots * self.codecs.keys.row_bytes + fine * self._fine.element_size())

    def value_cache_bytes(self) -> int:
        """Bytes of values by the formula: ``S`` rows of codes, scales and minimums, batch and heads included."""
        if not self.is_initialized or not self.is_bound:
            return 0
        batch, heads = self._storage[1].shape[:2]
        return batch * heads * self._held_slots() * self.codecs.values.row_bytes

    def reset(self) -> None:
        super().reset()
        self.codecs = None


class MLRQuantizedCache(DynamicCache):
    """A ``DynamicCache`` whose MLR layers are ``MLRQuantizedKeyCacheLayer``s: values in ``bits``-bit codes, level-1
    keys in ``key_bits``-bit codes (default ``bits``), groups of at most ``group_size`` dims (the model's other
    layers keep transformers' dynamic layers): ``model.generate(ids, cache=MLRQuantizedCache(config=model.config,
    bits=4, key_bits=8))``."""

    def __init__(self, config=None, bits: int = 4, group_size: int = 64, key_bits: Optional[int] = None, **kwargs):
        check_quantisation(bits, group_size, key_bits)
        super().__init__(config=config, **kwargs)
        self.mlr_quantisation = (bits, group_size, key_bits)


__all__ = ["EntryCodec", "MLRQuantizedCache", "MLRQuantizedKeyCacheLayer", "SlotCodecs", "check_quantisation"]
