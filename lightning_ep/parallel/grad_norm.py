"""``clip_grad_norm_``: the exact global gradient norm over parameters on different meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard


def _shards(t: torch.Tensor) -> int:
    """How many distinct pieces a gradient is split into across the world (1: replicated)."""
    if not isinstance(t, DTensor):
        return 1
    count = 1
    for size, placement in zip(t.device_mesh.shape, t.placements, strict=True):
        if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":
            count *= size
    return count


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm, for parameters living on different meshes.

    Each rank sums ``|g|^p`` over its local shards, divided by how many ranks hold a copy of that
    shard, so one all-reduce over the world gives the exact ``sum |g|^p`` of the full gradients
    (``max`` for ``p = inf``). Gradients are then scaled by ``min(1, max_norm / (norm + 1e-6))``.

    ``parameters`` (plain tensors or DTensors) without ``.grad`` are skipped; ``norm_type`` is ``p``
    (``float("inf")``: the max norm). Returns the total norm before clipping (a plain 0-dim float32
    tensor, equal on every rank).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.zeros(())
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        if local.numel() == 0:
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, local.detach().abs().max().float())
        else:
            copies = world / _shards(g)
            total += torch.linalg.vector_norm(local.detach().float(), norm_type) ** norm_type / copies
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))
    return norm
