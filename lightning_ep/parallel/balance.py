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
    """Move every ``"balanced"`` router's bias towards equal load, then clear the counts, summed over
    ``group`` (default: the world) in one all-reduce so that every rank applies the same update. Call it
    once per optimizer step, after its forwards and backwards (``update_biases_after_each_step``)."""
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
    runs the step's forward and backward inside ``step()``: a pre-hook would apply the previous
    step's counts, and lose the last step's at a checkpoint or the end of training. Megatron-Core
    updates the biases just before the optimizer's update; the optimizer never reads them, so both
    orders give the same numbers. Every rank must step the same optimizers. Returns the handles.
    """

    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        update_expert_biases(model, group)

    return [optimizer.register_step_post_hook(hook) for optimizer in optimizers]
