"""Rebuild a model as another class with the same tensors: how ``patch`` converts without touching the original."""

import copy

import torch


def convert_model(model: torch.nn.Module, target_class: type, config) -> torch.nn.Module:
    """``target_class(config)`` built on the meta device (nothing allocated, its ``post_init`` installs the structured
    attention) and given clones of ``model``'s parameters and buffers under the same names; tied weights re-tied,
    the generation config and the train/eval mode carried over. A model on the meta device converts to one."""
    with torch.device("meta"):
        converted = target_class(config)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    converted.load_state_dict(state, strict=True, assign=True)
    originals = dict(model.named_buffers())
    for name, buffer in list(converted.named_buffers()):  # non-persistent buffers (RoPE frequencies, ...) are no state
        if buffer.is_meta and name in originals:
            owner, _, attribute = name.rpartition(".")
            setattr(converted.get_submodule(owner), attribute, originals[name].detach().clone())
    converted.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        converted.generation_config = copy.deepcopy(model.generation_config)
    return converted.train(model.training)


__all__ = ["convert_model"]
