"""Tell the MoE layers of a Hugging Face model which tokens of each call are padding.

Decoder layers call their MoE block with the hidden states alone; the padding is known only where
the model is called. ``watch_padding`` puts a forward pre-hook on the decoder
(``causal_mask.decoder_model``: the innermost Hugging Face base model, inside a PEFT model too) that
wraps each call's 2-D ``attention_mask`` (``[batch, sequence]``, 0 at padding) in a ``TokenBatch`` for every
``MoELayer``, and a forward hook that takes it back; the layers then leave padded positions out of
routing, losses, counts, capacity and the exchange. A call without a 2-D mask (none, or a 4-D custom
attention pattern) routes every token.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from lightning_ep.models.causal_mask import decoder_model
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.tokens import TokenBatch

# Attributes on the hooked module (plain attributes, so that a deep copy of the model carries its own).
_POSITION = "_lightning_ep_mask_position"  # index of attention_mask among forward's positional arguments
_LAYERS = "_lightning_ep_moe_layers"


def watch_padding(model: nn.Module) -> bool:
    """Hand each call's padding mask to the ``MoELayer``s of ``model`` (see the module docstring).
    Idempotent; returns whether the hooks are in place (``False``: the forward takes no ``attention_mask``)."""
    base = decoder_model(model)  # a PEFT model's own base_model (its tuner) takes *args, **kwargs
    if hasattr(base, _POSITION):
        return True
    names = list(inspect.signature(base.forward).parameters)
    if "attention_mask" not in names:
        return False
    setattr(base, _POSITION, names.index("attention_mask"))
    setattr(base, _LAYERS, [m for m in base.modules() if isinstance(m, MoELayer)])
    base.register_forward_pre_hook(_hand_over, with_kwargs=True)
    base.register_forward_hook(_take_back, with_kwargs=True, always_call=True)
    return True


def _hand_over(module: nn.Module, args: tuple, kwargs: dict) -> None:
    position = getattr(module, _POSITION)
    mask = kwargs.get("attention_mask", args[position] if position < len(args) else None)
    batch = TokenBatch(mask if mask is not None and getattr(mask, "ndim", 0) == 2 else None)
    for layer in getattr(module, _LAYERS):
        layer.token_batch = batch


def _take_back(module: nn.Module, _args: tuple, _kwargs: dict, _output: Any) -> None:
    for layer in getattr(module, _LAYERS):
        layer.token_batch = None
