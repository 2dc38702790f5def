"""How a transformed model's calls reach Hugging Face's attention-mask creation: ``skip_causal_mask``
leaves it out of the calls whose mask is known on the host, which saves one host sync per forward;
``separate_packed_documents`` makes sure it sees the documents of a packed row.

Hugging Face's ``create_causal_mask`` first decides on the host whether any mask is needed, reading
whether the ``position_ids`` are packed (``find_packed_sequence_indices``) or a 2-D
``attention_mask`` pads anything (``fast_all``). Either read waits for the GPU, and the queue runs
dry early in the forward.

For a call with no ``attention_mask``, no ``position_ids`` and no cache, the answer is known: the
model numbers each row ``0 .. S-1`` and pads nothing, so under SDPA every layer gets no mask and runs
with ``is_causal=True`` (sliding-window layers too, while ``S`` is shorter than the window). For such
a call a forward pre-hook hands the model a shallow copy of its config whose attention
implementation is ``"lightning_ep_sdpa"`` (the ``"sdpa"`` function without a mask function, so
``create_causal_mask`` returns no mask at once), and a forward hook gives the config back. The
decoder layers keep the config object they hold, so their attention still reads ``"sdpa"``, in an
activation-checkpointed recompute and a compiled graph alike. Same kernels and numbers, without the
sync; the cost is one shallow config copy per call. Every other call (``mask_is_known``), and a
trace by ``torch.compile``, runs Hugging Face's mask creation as before.

**Packed rows.** A row packed from several documents (transformers' ``DataCollatorWithFlattening``)
carries ``position_ids`` that restart at 0 per document and no ``attention_mask``. Hugging Face masks
each document apart only for a call with positions, no 2-D mask and no cache; but a call that leaves
``use_cache`` unset takes ``config.use_cache`` (on by default), builds an empty KV cache first, and
the documents attend to each other. ``separate_packed_documents``' pre-hook runs such calls with
``use_cache=False`` (the config itself is left as it is, so ``save_pretrained`` writes it
unchanged). GPT-OSS's decoder (transformers 5.17 to 5.25) hands its mask functions no positions at
all: for it the hook builds the masks (full and sliding-window) with the same functions given the
positions and passes them in as the call's mask mapping. A training forward that asks for a cache in
such a call is refused, since its documents would attend to each other; an evaluation call is Hugging
Face's as before. The hook reads no tensor; transformers' packing check costs one host read of the
positions per mask built in a forward (two where a full and a sliding-window mask are built, as for
GPT-OSS and Qwen2-MoE), never per layer.
"""

from __future__ import annotations

import copy
import inspect
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
        "num_items_in_batch",  # the loss's divisor (token-weighted objective): the mask does not read it
    }
)
_KNOWN = _NEUTRAL | frozenset(_MASK_INPUTS)
_OWN_CONFIG = "_lightning_ep_config_to_restore"  # the model's own config, while a call runs on the copy
_HOOKED = "_lightning_ep_skips_causal_mask"
# Names of the hooked forward's parameters, in order, while separate_packed_documents' hook is in place.
_PACKING_PARAMETERS = "_lightning_ep_packing_parameters"
_CACHES = ("cache", "past_key_values")  # the cache argument's name in transformers >= 5.24, and before
# model_type -> the masks its decoder builds, by layer type, from transformers' functions that it calls
# without the positions (GptOssModel, transformers 5.17 to 5.25), so that it never sees packed documents.
_MASKS_BUILT_WITHOUT_POSITIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt_oss": (("full_attention", "create_causal_mask"), ("sliding_attention", "create_sliding_window_causal_mask"))
}


def skip_causal_mask(model: nn.Module) -> bool:
    """Put the hooks of the module docstring on ``decoder_model(model)`` (idempotent). Returns whether
    they are in place: ``False`` when the model has no config or its implementation is not SDPA."""
    base = decoder_model(model)
    if getattr(base, _HOOKED, False):
        return True
    if getattr(getattr(base, "config", None), "_attn_implementation", None) != "sdpa":
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
    if any(kwargs.get(name) is not None for name in _MASK_INPUTS) or not kwargs.keys() <= _KNOWN:
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


def decoder_model(model: nn.Module) -> nn.Module:
    """The innermost Hugging Face base model of ``model``, the module called with ``input_ids``,
    ``attention_mask`` and ``position_ids`` (``MixtralModel`` inside ``MixtralForCausalLM``, inside a
    PEFT model too): ``base_model`` followed down (a PEFT model's is its tuner) to the decoder, its own."""
    base = model
    for _ in range(8):  # nesting is shallow: PEFT model -> tuner -> causal LM -> decoder
        inner = getattr(base, "base_model", base)
        if inner is base or not isinstance(inner, nn.Module):
            break
        base = inner
    return base


def separate_packed_documents(model: nn.Module) -> bool:
    """Put the pre-hook of the module docstring's "Packed rows" on the innermost Hugging Face base
    model of ``model`` (``MixtralModel`` inside ``MixtralForCausalLM``, inside a PEFT model too).
    Idempotent; reads no tensor. Returns whether the hook is in place (``False`` when the model's
    forward takes no ``position_ids`` or no ``use_cache``)."""
    base = decoder_model(model)
    if getattr(base, _PACKING_PARAMETERS, None) is not None:
        return True
    names = tuple(inspect.signature(base.forward).parameters)
    if "position_ids" not in names or "use_cache" not in names:
        return False
    setattr(base, _PACKING_PARAMETERS, names)
    base.register_forward_pre_hook(_no_cache_for_packed_rows, with_kwargs=True)
    return True


def _no_cache_for_packed_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    names: tuple[str, ...] = getattr(module, _PACKING_PARAMETERS)
    given = {**dict(zip(names, args)), **kwargs}
    position_ids = given.get("position_ids")
    if position_ids is None or given.get("attention_mask") is not None:
        return None  # nothing for Hugging Face to look for: one sequence per row, or the mask says it all
    cache = next((given[name] for name in _CACHES if given.get(name) is not None), None)
    if cache is None and not given.get("use_cache"):
        updates: dict[str, Any] = {"use_cache": False}
        masks = _MASKS_BUILT_WITHOUT_POSITIONS.get(str(getattr(module.config, "model_type", "")), ())
        if masks:
            updates["attention_mask"] = _masks_from_positions(module, given, position_ids, masks)
        positional = names[: len(args)]  # each argument set where it was passed
        args = tuple(updates.get(name, value) for name, value in zip(positional, args))
        return args, {**kwargs, **{name: value for name, value in updates.items() if name not in positional}}
    if module.training:
        asked, fix = (
            ("a cache", "pass none (cache=None / past_key_values=None)")
            if cache is not None
            else ("use_cache=True", "leave use_cache unset (the call then runs with use_cache=False) or pass False")
        )
        raise ValueError(
            f"{type(module).__name__} was called in train mode with {asked}, position_ids and no attention_mask: "
            "with a KV cache transformers does not look for packed documents (position_ids restarting at 0), "
            f"so the documents of a packed row would attend to each other. A training forward needs no cache: {fix}."
        )
    return None


def _masks_from_positions(
    module: nn.Module, given: dict[str, Any], position_ids: torch.Tensor, masks: tuple[tuple[str, str], ...]
) -> dict[str, Any]:
    """The masks the decoder ``module`` would build for this call had it handed its mask functions the
    positions: ``{layer type: mask}``, each from transformers' own function, without a cache."""
    from transformers import masking_utils

    embeds = given.get("inputs_embeds")
    if embeds is None:  # the mask functions read only its batch and sequence sizes, dtype and device
        ids = given["input_ids"]
        dtype = module.get_input_embeddings().weight.dtype  # type: ignore[operator]
        embeds = torch.empty((*ids.shape, 0), dtype=dtype, device=ids.device)
    # Positional: the cache argument is ``cache`` in transformers >= 5.24, ``past_key_values`` before.
    return {
        layer_type: getattr(masking_utils, function)(module.config, embeds, None, None, position_ids)
        for layer_type, function in masks
    }
