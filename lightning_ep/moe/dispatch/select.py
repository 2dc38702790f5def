"""Pick the dispatcher a layer uses from its ``MoEConfig`` and its expert-parallel group."""

from __future__ import annotations

import torch.distributed as dist

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch.base import Dispatcher, LocalDispatcher
from lightning_ep.moe.dispatch.capacity import CapacityDispatcher


def make_dispatcher(config: MoEConfig, num_experts: int, group: dist.ProcessGroup | None = None) -> Dispatcher:
    """Capacity-bounded when ``config.capacity_factor`` is set; otherwise local on one process (or a
    group of one), all-to-all (deduplicated with ``config.token_dedup``, or pulled through symmetric memory with
    ``config.symmetric_memory_dispatch``) or all-gather across a group."""
    degree = dist.get_world_size(group) if group is not None else 1
    check_graphs_plan(config, degree)
    if config.capacity_factor is not None:
        return CapacityDispatcher(
            num_experts, config.capacity_factor, config.drop_policy, group if degree > 1 else None
        )  # type: ignore[return-value]
    if degree == 1:
        return LocalDispatcher(num_experts)
    from lightning_ep.moe.dispatch.all_to_all import AllGatherDispatcher, AllToAllDispatcher

    if config.symmetric_memory_dispatch:
        from lightning_ep.moe.dispatch.symmetric import SymmetricMemoryDispatcher

        return SymmetricMemoryDispatcher(num_experts, group, config.max_tokens_per_rank)  # type: ignore[arg-type,return-value]
    if config.moe_all_to_all_dispatcher:
        return AllToAllDispatcher(
            num_experts,
            group,  # type: ignore[arg-type]
            config.max_tokens_per_rank,
            dedup=config.token_dedup,
        )
    return AllGatherDispatcher(num_experts, group)  # type: ignore[arg-type]


def check_graphs_plan(config: MoEConfig, degree: int) -> None:
    """``MoEConfig.cuda_graphs`` needs a static plan: at degree 1 the local dispatch has one; above it
    only the symmetric-memory dispatch with a row budget does. Raises ``ValueError`` with the fix."""
    static = config.symmetric_memory_dispatch and config.max_tokens_per_rank is not None
    if config.cuda_graphs and degree > 1 and not static:
        raise ValueError(
            f"MoEConfig.cuda_graphs=True at expert-parallel degree {degree} captures the static plan of the "
            f"symmetric-memory dispatch, but symmetric_memory_dispatch={config.symmetric_memory_dispatch}, "
            f"max_tokens_per_rank={config.max_tokens_per_rank}; set symmetric_memory_dispatch=True and "
            "max_tokens_per_rank (about 1.25-1.6 x tokens per rank x top_k), or cuda_graphs=False."
        )
