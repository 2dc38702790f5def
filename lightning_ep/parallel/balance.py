"""The once-per-optimizer-step update of the ``"balanced"`` routers' expert biases."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_ep.moe.layer import MoELayer


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Move every ``"balanced"`` router's bias towards equal load, then clear the counts.

    The counts of all layers are summed over ``group`` (default: the world, when a process group
    exists) in one all-reduce, so every rank applies the same update and the biases stay equal.
    Call it once per optimizer step, after that step's forwards and backwards (the counts are those
    of the step's micro-batches); ``update_biases_after_each_step`` does it for a set of optimizers.
    A call with no pending count (a second optimizer stepped after the first) changes nothing.
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.gate.mode == "balanced"]
    if not layers:
        return
    load_LE = torch.stack([layer.gate.pending_load for layer in layers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(load_LE, group=group)
    for layer, load_E in zip(layers, load_LE, strict=True):
        layer.gate.update_bias(layer.config.balance_update_rate, load_E)


def update_biases_after_each_step(
    optimizers: Iterable[torch.optim.Optimizer], model: nn.Module, group: dist.ProcessGroup | None = None
) -> list[RemovableHandle]:
    """Run ``update_expert_biases(model, group)`` at the end of every ``step()`` of ``optimizers``.

    A step *post*-hook, because ``optimizer.step(closure)`` (Lightning's automatic optimization)
    runs the closure, the step's forward and backward, inside ``step()``: a pre-hook would apply the
    previous step's counts, and lose the last step's at a checkpoint or the end of training. After
    ``step()`` the counts are those of the step's own micro-batches, under gradient accumulation,
    a manual ``opt.step()`` (through Lightning's optimizer wrapper or the raw torch optimizer) and an
    optimizer that evaluates its closure several times alike, once per step. Megatron-Core updates
    the biases just before the optimizer's update instead; the biases are buffers the optimizer
    never reads, so the two orders give the same numbers. Every rank must step the same optimizers
    (the update all-reduces).

    Returns:
        the hooks' handles (``handle.remove()`` detaches one).
    """

    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        update_expert_biases(model, group)

    return [optimizer.register_step_post_hook(hook) for optimizer in optimizers]
