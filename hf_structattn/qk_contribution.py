"""How much each RoPE rotation pair (or position-free dim) of a decoder's heads contributes to its attention scores,
measured on calibration text: the ``level_order="contribution"`` rule of ``hf_structattn.patch``.

The rule is MHA2MLA's (Ji et al., 2025, "Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent
Attention in Any Transformer-based LLMs", its 2-norm partial-RoPE criterion): for a group of head dims g (a rotation
pair, or one unrotated dim), layer l and query head h with key/value head kv(h),

    contribution(g) = sum over layers l and query heads h of  mean_t ||q_{l,h,t}[g]|| * mean_t ||k_{l,kv(h),t}[g]||

with the means over every calibration token, q and k exactly as the model's attention function receives them
(after q/k norms and RoPE; a rotation leaves a pair's norm unchanged). By Cauchy-Schwarz the product bounds the
pair's share of q.k; a large one marks a pair the scores lean on.

The measurement runs the stock model once over the calibration ids, through a copy that shares every tensor with
``model`` (nothing is cloned, nothing of ``model`` changes) and whose converted layers' attention modules read a config
view naming the probe attention function below: it records the norms and then runs the model's own attention
implementation, so every layer sees the stock inputs.
"""

from __future__ import annotations

import copy
import sys
from typing import Optional, Sequence

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .conversion import convert_model
from .modeling.structattn_decoder_spec import attention_modules
from .modeling.structattn_install import LayerConfigView

QK_PROBE_ATTENTION = "structattn_qk_probe"


class QKNormRecord:
    """Running sums of per-group q and k norms per layer and head: ``query[layer]`` (H, G) and ``key[layer]`` (KV, G)
    summed over tokens, ``tokens[layer]`` the tokens seen. ``membership`` (d, G) float64: one-hot group of each dim."""

    def __init__(self, groups: Sequence[tuple], head_dim: int):
        self.groups = [tuple(group) for group in groups]
        self.membership = torch.zeros(head_dim, len(self.groups), dtype=torch.float64)
        for index, group in enumerate(self.groups):
            self.membership[list(group), index] = 1.0
        self.query, self.key, self.tokens = {}, {}, {}

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """query (B, H, T, d), key (B, KV, T, d): the tensors the attention function receives."""
        membership = self.membership.to(query.device)
        query_norms = (query.double().square() @ membership).sqrt().sum(dim=(0, 2))  # (H, G)
        key_norms = (key.double().square() @ membership).sqrt().sum(dim=(0, 2))  # (KV, G)
        tokens = query.shape[0] * query.shape[2]
        self.query[layer] = self.query.get(layer, 0) + query_norms.cpu()
        self.key[layer] = self.key.get(layer, 0) + key_norms.cpu()
        self.tokens[layer] = self.tokens.get(layer, 0) + tokens

    def contributions(self) -> dict:
        """{group: sum over layers and query heads of mean ||q[g]|| * mean ||k[g]|| of its key/value head}."""
        total = torch.zeros(len(self.groups), dtype=torch.float64)
        for layer, query_sums in self.query.items():
            query_means = query_sums / self.tokens[layer]  # (H, G)
            key_means = self.key[layer] / self.tokens[layer]  # (KV, G)
            repeat = query_means.shape[0] // key_means.shape[0]  # transformers' repeat_kv: head h reads h // repeat
            total += (query_means * key_means.repeat_interleave(repeat, dim=0)).sum(dim=0)
        return {group: float(value) for group, value in zip(self.groups, total)}


class _ProbeLayerConfig(LayerConfigView):
    """The config view a probed attention module reads: ``_attn_implementation`` names the probe, which finds the
    record here and the implementation to run in the model's own config."""

    implementation = staticmethod(lambda name: QK_PROBE_ATTENTION)

    def __init__(self, config, record: QKNormRecord):
        super().__init__(config)
        self.__dict__["qk_norm_record"] = record

    def _extra(self) -> tuple:
        return (self.qk_norm_record,)


def _qk_probe_attention(module, query, key, value, attention_mask, **kwargs):
    """Record the norms of ``query`` (B, H, T, d) and ``key`` (B, KV, T, d), then run the model's own attention."""
    config = module.config
    config.qk_norm_record.add(module.layer_idx, query, key)
    own = config.base_config._attn_implementation
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(own, eager)(module, query, key, value, attention_mask, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(QK_PROBE_ATTENTION, _qk_probe_attention)


def max_positions(config) -> Optional[int]:
    """The longest sequence a decoder config states (``max_position_embeddings`` or GPT-2's ``n_positions``)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_calibration_ids(calibration_ids, vocab_size: Optional[int], max_positions: Optional[int] = None
                          ) -> torch.Tensor:
    """``calibration_ids`` as a (N, T) long tensor, or a one-line ValueError naming it (not integer token ids, no
    token, ids outside ``[0, vocab_size)``, windows longer than the model's ``max_positions``)."""
    if not isinstance(calibration_ids, torch.Tensor) or calibration_ids.is_floating_point() or \
            calibration_ids.is_complex() or calibration_ids.dtype == torch.bool or calibration_ids.dim() not in (1, 2):
        described = (f"{calibration_ids.dtype} tensor of shape {tuple(calibration_ids.shape)}"
                     if isinstance(calibration_ids, torch.Tensor) else type(calibration_ids).__name__)
        raise ValueError(f"calibration_ids must be an integer tensor of token ids, (tokens,) or (windows, tokens); "
                         f"got {described}")
    if calibration_ids.numel() == 0:
        raise ValueError(f"calibration_ids of shape {tuple(calibration_ids.shape)} holds no token")
    ids = calibration_ids.long().reshape(-1, calibration_ids.shape[-1])
    if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
        raise ValueError(f"calibration_ids holds ids in [{int(ids.min())}, {int(ids.max())}], outside the model's "
                         f"vocabulary [0, {vocab_size})")
    if max_positions is not None and ids.shape[1] > max_positions:
        raise ValueError(f"calibration_ids has windows of {ids.shape[1]} tokens, more than the model's "
                         f"{max_positions} positions: pass (windows, tokens) with shorter windows")
    return ids


@torch.no_grad()
def measure_qk_contributions(model, calibration_ids: torch.Tensor, groups: Sequence[tuple], head_dim: int,
                             layers: Sequence[int]) -> dict:
    """{group: contribution} (module docstring) of ``model`` (a stock transformers decoder, not modified) on
    ``calibration_ids`` (N, T), one window per forward, over the attention modules of ``layers``. ``groups``: tuples
    of head dims covering the head once (``RotaryDims.groups``)."""
    if any(tensor.is_meta for tensor in model.parameters()):
        raise ValueError("level_order='contribution' measures q and k on calibration text and needs the model's "
                         "weights; this model is on the meta device")
    ids = check_calibration_ids(calibration_ids, getattr(model.config, "vocab_size", None), max_positions(model.config))
    probe = convert_model(model, type(model), copy.deepcopy(model.config), clone=False).eval()
    record = QKNormRecord(groups, head_dim)
    modules = attention_modules(probe)
    for layer in layers:
        modules[layer].config = _ProbeLayerConfig(modules[layer].config, record)
    device = next(model.parameters()).device
    for window in ids:
        probe(window[None].to(device), use_cache=False)
    return record.contributions()


__all__ = ["QK_PROBE_ATTENTION", "QKNormRecord", "check_calibration_ids", "measure_qk_contributions"]
