"""Pick the dispatcher a layer uses from its ``MoEConfig`` and its expert-parallel group."""

from __future__ import annotations

import torch.distributed as dist

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch import Dispatcher, LocalDispatcher
from lightning_ep.moe.dispatch_capacity import CapacityDispatcher


def make_dispatcher(config: MoEConfig, num_experts: int, group: dist.ProcessGroup | None = None) -> Dispatcher:
    """Capacity-bounded when ``config.capacity_factor`` is set; otherwise local on one process (or a
    group of one), all-to-all (deduplicated with ``config.token_dedup``, or pulled through symmetric memory with
    ``config.symmetric_memory_dispatch``) or all-gather across a group."""
    degree = dist.get_world_size(group) if group is not None else 1
    if config.capacity_factor is not None:
        return CapacityDispatcher(
            num_experts, config.capacity_factor, config.drop_policy, group if degree > 1 else None
        )  # type: ignore[return-value]
    if degree == 1:
        return LocalDispatcher(num_experts)
    from lightning_ep.moe.dispatch_ep import AllGatherDispatcher, AllToAllDispatcher

    if config.symmetric_memory_dispatch:
        from lightning_ep.moe.dispatch_symm import SymmetricMemoryDispatcher

        return SymmetricMemoryDispatcher(num_experts, group, config.max_tokens_per_rank)  # type: ignore[arg-type,return-value]
    if config.moe_all_to_all_dispatcher:
        return AllToAllDispatcher(
            num_experts,
            group,  # type: ignore[arg-type]
            config.max_tokens_per_rank,
            dedup=config.token_dedup,
        )
    return AllGatherDispatcher(num_experts, group)  # type: ignore[arg-type]
