"""Rebuild a model as another class with the same tensors: how ``patch`` converts without touching the original."""

import copy
import itertools

import torch


def convert_model(model: torch.nn.Module, target_class: type, config, clone: bool = True) -> torch.nn.Module:
    """``target_class(config)`` built on the meta device (nothing allocated, its ``post_init`` installs the structured
    attention) and given clones of ``model``'s parameters and buffers under the same names (``clone=False``: the
    very tensors of ``model``, for a read-only companion such as a measuring probe); tied weights re-tied,
    the generation config, the train/eval mode and activation (gradient) checkpointing carried over. Every tensor is
    that holds values is marked initialised, as ``from_pretrained`` marks loaded ones, so ``post_init()`` /
    ``init_weights()`` keep the converted weights. A model on the meta device (or built inside
    ``torch.device("meta")``) converts to one."""
    with torch.device("meta"):
        converted = target_class(config)
    state = {name: tensor.detach().clone() if clone else tensor.detach() for name, tensor in model.state_dict().items()}
    converted.load_state_dict(state, strict=True, assign=True)
    originals = dict(model.named_buffers())
    for name, buffer in list(converted.named_buffers()):  # non-persistent buffers (RoPE frequencies, ...) are no state
        if buffer.is_meta and name in originals:
            owner, _, attribute = name.rpartition(".")
            buffer = originals[name].detach()
            setattr(converted.get_submodule(owner), attribute, buffer.clone() if clone else buffer)
    converted.tie_weights()
    for tensor in itertools.chain(converted.parameters(), converted.buffers()):
        # a meta model holds no values yet: init_weights after to_empty() fills it, as stock; shared tensors are
        # model's own, whose flags stay as they are
        if clone and not tensor.is_meta:
            tensor._is_hf_initialized = True
    for module in converted.modules():
        if not any(tensor.is_meta for tensor in itertools.chain(module.parameters(recurse=False),
                                                                 module.buffers(recurse=False))):
            module._is_hf_initialized = True
    _carry_checkpointing(model, converted)
    if getattr(model, "generation_config", None) is not None:
        converted.generation_config = copy.deepcopy(model.generation_config)
    return converted.train(model.training)


def _carry_checkpointing(model: torch.nn.Module, converted: torch.nn.Module) -> None:
    """Give every module of ``converted`` the activation checkpointing flag and function of the module of the same
    name in ``model`` (whether enabled by ``gradient_checkpointing_enable``, ``activation_checkpointing_enable``
    with its kwargs and ``every_n_layers``, or ``config.gradient_checkpointing``)."""
    sources = dict(model.named_modules())
    for name, module in converted.named_modules():
        source = sources.get(name)
        if source is None or not hasattr(module, "gradient_checkpointing") or \
                not hasattr(source, "gradient_checkpointing"):
            continue
        module.gradient_checkpointing = source.gradient_checkpointing
        if hasattr(source, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = source._gradient_checkpointing_func


__all__ = ["convert_model"]
