"""``compile_blocks``: ``torch.compile`` the dense parts of each decoder layer; the MoE layers stay eager.

A fine-grained MoE step is bound by the host: the attention half of a decoder layer launches on the
order of a hundred small kernels per layer each way, and the MoE block's one host sync per layer
empties the GPU's queue, so the GPU then waits for each launch. Compiled, that is a handful of fused
kernels.

What is compiled is each decoder layer's children that hold no MoE layer (attention, norms, a dense
MLP), not the layer's own ``forward``: Hugging Face wraps that in its activation checkpointing, and
Dynamo cannot split a checkpointed region at the MoE layer, so it would run the whole layer eagerly.
FSDP2's hooks on the decoder layer stay as they are. The MoE layers stay eager (host reads, their own
Triton kernels, custom autograd functions); only their routing is compiled
(``MoELayer.compile_routing``).

``compile_loss``: eagerly, the causal-LM loss copies the ``[tokens, vocab]`` logits to fp32 and keeps
fp32 log-probabilities for backward; compiled, the fp32 arithmetic stays in registers.
``compile_head``: under autocast with fp32 weights, the eager backward widens the ``[vocab, hidden]``
weight gradient to fp32 through torch's element-wise copy loop; compiled, the casts are vectorized.
It also compiles the final norm (``compile_final_norm``), which belongs to no decoder layer: some
eight kernels forward and a dozen backward eagerly, one fused kernel each way compiled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_ep.moe.layer import MoELayer

_COMPILED = "_lightning_ep_compiled"
_COMPILED_LOSS = "_lightning_ep_compiled_loss"
_COMPILED_HEAD = "_lightning_ep_compiled_head"
_COMPILED_NORM = "_lightning_ep_compiled_norm"
_log = logging.getLogger(__name__)


def dense_children(block: nn.Module) -> list[nn.Module]:
    """The direct children of ``block`` that hold no MoE layer and are no ``ModuleList``: attention,
    norms, a dense MLP."""
    children = [child for child in block.children() if not isinstance(child, nn.ModuleList)]
    return [child for child in children if not any(isinstance(m, MoELayer) for m in child.modules())]


def compile_blocks(blocks: Iterable[nn.Module], *, routing: bool = True, **compile_kwargs: Any) -> int:
    """Replace the ``forward`` of each block's dense children with ``torch.compile(forward, **compile_kwargs)``,
    and compile the routing of its MoE layers (``MoELayer.compile_routing``).

    Compiling the bound ``forward`` keeps the modules, their state-dict keys and hooks as they are.
    Children of one class share one code object, so the layers share compiled graphs. Train with
    ``use_cache=False``: a KV cache makes the attention's graph depend on the layer index, and past
    Dynamo's recompile limit (8) the remaining layers run eagerly. Idempotent.

    Returns the number of blocks this call compiled; ``blocks``: the decoder layers (``parallel.fsdp.decoder_blocks``).
    """
    count = 0
    for block in blocks:
        if is_compiled(block):
            continue
        for child in dense_children(block):
            child.forward = torch.compile(child.forward, **compile_kwargs)  # type: ignore[method-assign]
        for layer in block.modules():
            if routing and isinstance(layer, MoELayer):
                layer.compile_routing(**compile_kwargs)
        setattr(block, _COMPILED, True)
        count += 1
    return count


def compile_loss(model: nn.Module, **compile_kwargs: Any) -> bool:
    """Replace a Hugging Face model's settable ``loss_function`` with ``torch.compile(loss_function)``
    (the same loss to float rounding). Idempotent; returns whether this call compiled it."""
    loss_property = getattr(type(model), "loss_function", None)
    if not isinstance(loss_property, property) or loss_property.fset is None:
        return False
    return _compile_once(model, "loss_function", _COMPILED_LOSS, compile_kwargs)


def compile_head(model: nn.Module, **compile_kwargs: Any) -> bool:
    """Replace the ``forward`` of a model's output projection (``get_output_embeddings()``) with
    ``torch.compile(forward)``, and that of the final norm before it (``compile_final_norm``).
    Idempotent; returns whether this call compiled the output projection."""
    compile_final_norm(model, **compile_kwargs)
    get_output = getattr(model, "get_output_embeddings", None)
    return _compile_once(get_output() if callable(get_output) else None, "forward", _COMPILED_HEAD, compile_kwargs)


def final_norm(model: nn.Module) -> nn.Module | None:
    """The normalisation a Hugging Face causal LM applies to the last decoder layer's output before
    its output projection: its decoder's (``get_decoder()``) ``norm``; ``None`` where there is none."""
    get_decoder = getattr(model, "get_decoder", None)
    norm = getattr(get_decoder() if callable(get_decoder) else None, "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def compile_final_norm(model: nn.Module, **compile_kwargs: Any) -> bool:
    """Replace the ``forward`` of ``final_norm(model)`` with ``torch.compile(forward)``. Idempotent;
    returns whether this call compiled it."""
    return _compile_once(final_norm(model), "forward", _COMPILED_NORM, compile_kwargs)


def _compile_once(owner: Any, name: str, flag: str, compile_kwargs: dict[str, Any]) -> bool:
    """Replace the module ``owner``'s attribute ``name`` with ``torch.compile`` of it unless ``flag`` marks
    it done; returns whether this call did."""
    if not isinstance(owner, nn.Module) or getattr(owner, flag, False):
        return False
    setattr(owner, name, torch.compile(getattr(owner, name), **compile_kwargs))
    setattr(owner, flag, True)
    return True


def compile_for_training(model: nn.Module, blocks: Iterable[nn.Module], **compile_kwargs: Any) -> int:
    """``compile_loss(model)``, ``compile_head(model)`` and ``compile_blocks(blocks)`` (whose count it
    returns), after setting ``model.config.use_cache = False`` (see ``compile_blocks``)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        _log.info("compile_for_training: set %s's config.use_cache=False", type(model).__name__)
    compile_loss(model, **compile_kwargs)
    compile_head(model, **compile_kwargs)
    return compile_blocks(blocks, **compile_kwargs)


def is_compiled(block: nn.Module) -> bool:
    """Whether ``compile_blocks`` compiled ``block``'s dense children."""
    return bool(getattr(block, _COMPILED, False))
