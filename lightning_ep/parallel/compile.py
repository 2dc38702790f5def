"""``compile_blocks``: ``torch.compile`` the dense parts of each decoder layer; the MoE layers stay eager.

A fine-grained MoE step is bound by the host: the attention half of a Hugging Face decoder layer
(RMSNorm in fp32, rotary embedding, projections) launches on the order of a hundred small kernels
per layer in forward and as many in backward, and the MoE block's one host sync per layer empties
the GPU's queue, so the GPU then waits for each of those launches. Compiled, the same work is a
handful of fused kernels.

What is compiled is each decoder layer's children that hold no MoE layer (attention, norms, a
dense MLP), not the layer's own ``forward``: Hugging Face wraps that ``forward`` in its activation
checkpointing, and Dynamo cannot split a checkpointed region at the MoE layer, so it would run the
whole layer eagerly. Compiled children run inside the checkpoint like any function, and FSDP2's
hooks on the decoder layer stay as they are. The MoE layers stay eager (``MoELayer.forward`` is
excluded from compilation): they read split sizes back to the host, launch their own Triton
kernels and run custom autograd functions. Inside each, only the router with its losses and
statistics is compiled (``MoELayer.compile_routing``).

``compile_loss`` compiles a Hugging Face model's loss function: eagerly, the causal-LM loss copies
the ``[tokens, vocab]`` logits to fp32 and keeps fp32 log-probabilities for backward (several GB of
memory traffic per step at a 32k vocabulary); compiled, the fp32 arithmetic stays in registers.
``compile_head`` compiles the output projection's ``forward``: under autocast with fp32 weights,
eagerly, the backward widens the ``[vocab, hidden]`` weight gradient to fp32 through torch's
element-wise copy loop, well below the memory's rate; compiled, the casts are vectorized Triton
kernels and the GEMMs cuBLAS calls as before. It also compiles the final normalisation in front of
the projection (``compile_final_norm``), which belongs to no decoder layer: eagerly, an RMSNorm over
the ``[tokens, hidden]`` activations is some eight kernels in forward and a dozen in backward, some
of them torch's unvectorized loops; compiled, one fused kernel each way, sharing the decoder layers'
compiled norm.
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
    """The direct children of ``block`` that hold no MoE layer and have parameters or code of
    their own: attention, norms, a dense MLP (empty containers and the MoE layer are left out)."""
    return [
        child
        for child in block.children()
        if not any(isinstance(m, MoELayer) for m in child.modules()) and not isinstance(child, nn.ModuleList)
    ]


def compile_blocks(blocks: Iterable[nn.Module], *, routing: bool = True, **compile_kwargs: Any) -> int:
    """Replace the ``forward`` of each block's dense children with ``torch.compile(forward, **compile_kwargs)``,
    and compile the routing of its MoE layers (``MoELayer.compile_routing``).

    Compiling the bound ``forward`` (not the module) keeps the modules, their state-dict keys and
    their hooks as they are. Children of one class share one code object, so the layers share
    compiled graphs (one for the attention, one for the norms); a new input shape compiles once
    more (Dynamo's automatic dynamic shapes). Train with ``use_cache=False``: a Hugging Face KV
    cache makes the attention's graph depend on the layer index, one compilation per layer, and
    past Dynamo's recompile limit (8) the remaining layers run eagerly. Idempotent: a block
    compiled before is left alone.

    Args:
        blocks: the decoder layers (e.g. ``lightning_ep.parallel.fsdp.decoder_blocks(model)``).
        routing: also compile the routing of the MoE layers in ``blocks``.
        compile_kwargs: passed to ``torch.compile`` (e.g. ``mode``, ``backend``).
    Returns:
        The number of blocks compiled by this call.
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
    """Replace a Hugging Face model's ``loss_function`` with ``torch.compile(loss_function)``.

    The loss is computed as before (fp32 log-softmax and the same reduction), fused: agreement with
    eager to float rounding. Idempotent.

    Returns:
        Whether this call compiled it (``False`` when already compiled, or when ``model`` has no
        settable ``loss_function``, as a model that is not a Hugging Face ``PreTrainedModel``).
    """
    loss_property = getattr(type(model), "loss_function", None)
    if not isinstance(loss_property, property) or loss_property.fset is None:
        return False
    if getattr(model, _COMPILED_LOSS, False):
        return False
    loss_function: Any = model.loss_function  # typed Tensor | Module by nn.Module.__getattr__
    model.loss_function = torch.compile(loss_function, **compile_kwargs)  # type: ignore[assignment]
    setattr(model, _COMPILED_LOSS, True)
    return True


def compile_head(model: nn.Module, **compile_kwargs: Any) -> bool:
    """Replace the ``forward`` of a model's output projection (Hugging Face's
    ``get_output_embeddings()``, the ``lm_head``) with ``torch.compile(forward)``, and that of the
    final norm before it (``compile_final_norm``); the modules, their hooks (FSDP2's) and their
    state-dict keys stay as they are. Idempotent.

    Returns:
        Whether this call compiled the output projection (``False`` when already compiled, or when
        ``model`` has no output embeddings module).
    """
    compile_final_norm(model, **compile_kwargs)
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if not isinstance(head, nn.Module) or getattr(head, _COMPILED_HEAD, False):
        return False
    head.forward = torch.compile(head.forward, **compile_kwargs)  # type: ignore[method-assign]
    setattr(head, _COMPILED_HEAD, True)
    return True


def final_norm(model: nn.Module) -> nn.Module | None:
    """The normalisation a Hugging Face causal LM applies to the last decoder layer's output before
    its output projection: its decoder's (``get_decoder()``) ``norm``; ``None`` where there is none."""
    get_decoder = getattr(model, "get_decoder", None)
    norm = getattr(get_decoder() if callable(get_decoder) else None, "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def compile_final_norm(model: nn.Module, **compile_kwargs: Any) -> bool:
    """Replace the ``forward`` of ``final_norm(model)`` with ``torch.compile(forward)``; the module,
    its hooks and its state-dict keys stay as they are. Idempotent.

    Returns:
        Whether this call compiled it (``False`` when already compiled, or without a final norm).
    """
    norm = final_norm(model)
    if norm is None or getattr(norm, _COMPILED_NORM, False):
        return False
    norm.forward = torch.compile(norm.forward, **compile_kwargs)  # type: ignore[method-assign]
    setattr(norm, _COMPILED_NORM, True)
    return True


def compile_for_training(model: nn.Module, blocks: Iterable[nn.Module], **compile_kwargs: Any) -> int:
    """``compile_blocks(blocks)``, ``compile_loss(model)`` and ``compile_head(model)`` for training
    ``model``: first sets its ``config.use_cache = False`` (a training forward needs no KV cache, and
    with one Dynamo compiles the attention once per layer).

    Returns:
        The number of blocks compiled by this call.
    """
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
