"""The once-per-optimizer-step update of the ``"balanced"`` routers' expert biases."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_ep.moe.layer import MoELayer


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Move every ``"balanced"`` router's bias towards equal load, then clear the counts.

    The counts of all layers are summed over ``group`` (default: the world, when a process group
    exists) in one all-reduce, so every rank applies the same update and the biases stay equal.
    Call it once per optimizer step (the strategy does, in an optimizer step pre-hook).
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.gate.mode == "balanced"]
    if not layers:
        return
    load_LE = torch.stack([layer.gate.pending_load for layer in layers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(load_LE, group=group)
    for layer, load_E in zip(layers, load_LE, strict=True):
        layer.gate.update_bias(layer.config.balance_update_rate, load_E)
