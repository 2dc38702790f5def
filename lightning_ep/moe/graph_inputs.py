"""The inputs, outputs and keys of a layer's CUDA graphs (``graphs.LayerGraphs``): the buffers a
graph reads, the router's tensors swapped for them while the routing is captured, the outputs whose
gradients its backward takes (``with_grad``), and what must match for a call to replay a graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


def gate_tensors(gate: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The router's own parameters and buffers, by name: what its routing reads."""
    return [*gate.named_parameters(recurse=False), *gate.named_buffers(recurse=False)]


@contextlib.contextmanager
def swapped(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s own parameters and buffers replaced by ``tensors`` (by name) inside the block."""
    saved = {}
    for name, tensor in tensors.items():
        table: dict[str, Any] = module._parameters if name in module._parameters else module._buffers
        saved[name] = (table, table[name])
        table[name] = tensor
    try:
        yield
    finally:
        for name, (table, tensor) in saved.items():
            table[name] = tensor


def static_copy(t: torch.Tensor) -> torch.Tensor:
    """A graph's buffer for input ``t``: a copy with a version counter of its own (see ``LayerGraphs._set_static``),
    a ``Parameter`` where ``t`` is one (the router's weight: what a compiled routing was traced with)."""
    copy = t.detach().clone()
    if isinstance(t, nn.Parameter):
        return nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.data.requires_grad_(t.requires_grad)


def with_grad(outputs: Sequence[torch.Tensor]) -> list[int]:
    """The positions in a graph's outputs (``out_TH``, ``counts_E``, with the routing captured then
    ``aux_loss``, ``z_loss``, ...) whose gradients its backward takes: those of 0, 2, 3 that have one."""
    return [i for i in (0, 2, 3) if i < len(outputs) and outputs[i].requires_grad]


def backward_of(
    outputs: Sequence[torch.Tensor], inputs: list[torch.Tensor], grads: list[torch.Tensor] | None = None
) -> list[torch.Tensor | None]:
    """The gradients of ``inputs`` (``None`` where none flows) from those of ``outputs`` at the
    positions ``with_grad`` names: ``grads``, or ones when ``None``."""
    wanted = [outputs[i] for i in with_grad(outputs)]
    if grads is None:
        grads = [torch.ones_like(t) for t in wanted]
    needs = [i for i, t in enumerate(inputs) if t.requires_grad]
    found = torch.autograd.grad(wanted, [inputs[i] for i in needs], grads, allow_unused=True)
    by_input = dict(zip(needs, found, strict=True))
    return [by_input.get(i) for i in range(len(inputs))]


def plain_key(
    x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, weights: list[nn.Parameter]
) -> tuple[Any, ...]:
    """What a call must match to replay the graphs from the dispatch on; last: which inputs need grad."""
    tensors = (x_TH, ids_TK, weights_TK, *weights)
    return (
        tuple((t.shape, t.dtype, t.device) for t in (x_TH, ids_TK, weights_TK)),
        tuple(t.requires_grad for t in tensors),
    )


def routed_key(x_TH: torch.Tensor, gate: nn.Module, check_finite: bool, weights: list[nn.Parameter]) -> tuple[Any, ...]:
    """``plain_key`` for the graphs that hold the routing (the router's mode and tensors included)."""
    named = gate_tensors(gate)
    tensors = (x_TH, *(t for _, t in named), *weights)
    return (
        "routed",
        gate.training,
        check_finite,
        tuple((name, t.shape, t.dtype, t.device, t.stride()) for name, t in [("x", x_TH), *named]),
        tuple(t.requires_grad for t in tensors),
    )
