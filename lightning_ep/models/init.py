"""Materialise a Hugging Face MoE model built on the meta device, after transform and sharding."""

from __future__ import annotations

import torch
from torch import nn

from lightning_ep.models.peft_lora import reset_lora_parameters
from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.experts.grouped import RoutedExperts
from lightning_ep.moe.routing.router import TopKRouter


@torch.no_grad()
def init_moe_weights(model: nn.Module) -> None:
    """Initialise every MoE router and expert weight as Hugging Face does for its own classes:
    ``normal(0, initializer_range)`` for weights and the router's logit bias (GPT-OSS), zeros for
    expert biases and for the selection bias (``"balanced"``'s ``expert_bias``, DeepSeek's
    ``e_score_correction_bias``). Works on DTensors."""
    std = float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.normal_(module.bias, mean=0.0, std=std)
            if module.selection_bias is not None:
                module.selection_bias.zero_()
            if module.mode == "balanced":
                module.pending_load.zero_()
        elif isinstance(module, FrozenExpertWeight):
            module.init_normal_(std)
        elif isinstance(module, RoutedExperts):
            for name, param in module.named_parameters(recurse=False):
                if "_lora_" in name:
                    continue  # LoRA factors: reset_lora_parameters
                if name.endswith("_bias"):
                    nn.init.zeros_(param)
                else:
                    nn.init.normal_(param, mean=0.0, std=std)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device (possibly sharded) model on ``device`` and initialise every weight. Dense
    modules get Hugging Face's own ``initialize_weights``, MoE layers ``init_moe_weights``, LoRA
    factors PEFT's initialisation (``models.peft_lora.reset_lora_parameters``). Ranks must share the
    torch seed so that replicated values agree.
    """
    model.to_empty(device=device)
    for module in model.modules():
        for obj in (module, *module.parameters(recurse=False), *module.buffers(recurse=False)):
            if hasattr(obj, "_is_hf_initialized"):
                setattr(obj, "_is_hf_initialized", False)  # noqa: B010
    initialize = getattr(model, "initialize_weights", None)
    if callable(initialize):
        initialize()
    else:
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    init_moe_weights(model)
    reset_lora_parameters(model)
    return model


def materialize_if_meta(
    model: nn.Module, device: torch.device | str, pretrained_dtype: torch.dtype | None = None
) -> nn.Module:
    """``materialize`` ``model`` if it has meta tensors, then read the weights of a model built by
    ``models.pretrained.from_pretrained`` from its folder (each rank its own shards,
    ``load_pretrained_sharded``); a model with no meta tensor is left as it is. ``pretrained_dtype``:
    the floating dtype a pretrained model's parameters take before allocation (a free cast on the meta
    device), whatever its config names; ``None`` keeps the config's."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return model
    from lightning_ep.models.pretrained import PRETRAINED_ATTR

    folder = getattr(model, PRETRAINED_ATTR, None)
    if folder is not None and pretrained_dtype is not None:
        model.to(dtype=pretrained_dtype)
    materialize(model, device)
    if folder is not None:
        from lightning_ep.models.hf_io import load_pretrained_sharded

        load_pretrained_sharded(model, folder)
    return model
