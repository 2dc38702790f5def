"""``skip_causal_mask``: leave Hugging Face's attention-mask creation out of the calls whose mask is
known on the host, which saves one host sync per forward.

Each forward of a Hugging Face decoder (transformers 5) builds its attention mask with
``create_causal_mask``, which first decides on the host whether any mask is needed. It reads
whether the ``position_ids`` hold packed sequences (``find_packed_sequence_indices``) or whether a
2-D ``attention_mask`` pads anything (``fast_all``). Either read waits for the GPU. The queue then
runs dry early in the forward, and the GPU waits on each launch until the host is ahead again.

For a call with no ``attention_mask``, no ``position_ids`` and no cache, the answer is known before
the call. The model numbers each row's positions ``0 .. S-1`` itself (one sequence per row, nothing
packed) and pads nothing, so under SDPA every layer gets no mask and SDPA runs with
``is_causal=True``. That holds for sliding-window layers too, while ``S`` is shorter than the
window. For such a call, a forward pre-hook hands the model a shallow copy of its config whose
attention implementation is ``"lightning_ep_sdpa"``, and a forward hook gives the model its own
config back. That name calls the SDPA function registered as ``"sdpa"`` but has no mask function,
so ``create_causal_mask`` (which reads the model's config) returns no mask at once. The decoder
layers keep the config object they hold: their attention still reads ``"sdpa"``, in the forward and
in an activation-checkpointed recompute alike, and a compiled attention keeps its graph. The kernels
and the numbers stay the same, without the sync; the cost is one shallow copy of the config per
call.

Every other call runs Hugging Face's mask creation as before: one with a mask, positions or a
cache, with an argument outside ``_NEUTRAL``, with another attention implementation, chunked
attention or sub-configs, with a sequence as long as the sliding window, or one traced by
``torch.compile``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

NAME = "lightning_ep_sdpa"
# Arguments that decide the mask: the shortcut applies only when each one is absent or None.
_MASK_INPUTS = ("attention_mask", "position_ids", "past_key_values", "cache", "cache_position")
# Arguments known to leave the mask alone.
_NEUTRAL = frozenset(
    {
        "input_ids",
        "inputs_embeds",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
    }
)
_OWN_CONFIG = "_lightning_ep_config_to_restore"  # the model's own config, while a call runs on the copy
_HOOKED = "_lightning_ep_skips_causal_mask"


def skip_causal_mask(model: nn.Module) -> bool:
    """Put the hooks of the module docstring on ``model.base_model`` (idempotent). Returns whether
    they are in place: ``False`` when the model has no config or its implementation is not SDPA."""
    base = getattr(model, "base_model", model)
    if getattr(base, _HOOKED, False):
        return True
    config = getattr(base, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    setattr(base, _HOOKED, True)
    base.register_forward_pre_hook(_switch, with_kwargs=True)
    base.register_forward_hook(_switch_back, with_kwargs=True, always_call=True)
    return True


def mask_is_known(config: Any, args: tuple, kwargs: dict) -> bool:
    """Whether Hugging Face's SDPA path gives every layer no mask for this call, from the call's
    arguments and the config alone (see the module docstring)."""
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "attention_chunk_size", None):
        return False
    if getattr(config, "sub_configs", None):  # the implementation's setter would reach shared sub-configs
        return False
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not layer_types <= {"full_attention", "sliding_attention"} or len(args) > 1:
        return False
    if any(kwargs.get(name) is not None for name in _MASK_INPUTS):
        return False
    if any(name not in _NEUTRAL and name not in _MASK_INPUTS for name in kwargs):
        return False
    tokens = args[0] if args else kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return False
    window = getattr(config, "sliding_window", None)
    if window is None or (layer_types and "sliding_attention" not in layer_types):
        return True
    return tokens.shape[1] < window


def _switch(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling() or getattr(module, _OWN_CONFIG, None) is not None:
        return
    config: Any = module.config
    if mask_is_known(config, args, kwargs):
        switched = copy.copy(config)
        switched._attn_implementation = NAME
        setattr(module, _OWN_CONFIG, config)
        module.config = switched


def _switch_back(module: nn.Module, _args: tuple, _kwargs: dict, _output: Any) -> None:
    config = getattr(module, _OWN_CONFIG, None)
    if config is not None:
        module.config = config
        setattr(module, _OWN_CONFIG, None)


def _register() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    def sdpa(*args: Any, **kwargs: Any) -> Any:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, sdpa)
