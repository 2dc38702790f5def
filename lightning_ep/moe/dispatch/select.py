"""Pick the dispatcher a layer uses from its ``MoEConfig``, its ``LayerExecution`` and its group."""

from __future__ import annotations

import torch.distributed as dist

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch.base import Dispatcher, LocalDispatcher
from lightning_ep.moe.dispatch.capacity import CapacityDispatcher
from lightning_ep.moe.layer_execution import LayerExecution


def make_dispatcher(
    config: MoEConfig,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    execution: LayerExecution | None = None,
) -> Dispatcher:
    """The dispatcher for ``config`` and ``execution`` (checked at the group's degree) across ``group``
    (``None``: one process)."""
    execution = execution if execution is not None else LayerExecution()
    degree = dist.get_world_size(group) if group is not None else 1
    execution.check(config, degree)
    if config.capacity_factor is not None:
        return CapacityDispatcher(num_experts, config.capacity_factor, config.drop_policy, group)
    if degree == 1:
        return LocalDispatcher(num_experts)
    assert group is not None
    if execution.exchange == "symmetric_memory":
        from lightning_ep.moe.dispatch.static.symmetric import SymmetricMemoryDispatcher

        budget = execution.row_budget
        assert budget is None or isinstance(budget, int)
        return SymmetricMemoryDispatcher(num_experts, group, budget)
    if not config.moe_all_to_all_dispatcher:
        from lightning_ep.moe.dispatch.all_gather import AllGatherDispatcher

        return AllGatherDispatcher(num_experts, group)
    if execution.row_budget is not None:
        from lightning_ep.moe.dispatch.static.padded import PaddedAllToAllDispatcher

        return PaddedAllToAllDispatcher(num_experts, group, execution.row_budget, config.max_tokens_per_rank)
    if execution.token_dedup:
        from lightning_ep.moe.dispatch.dedup import DedupAllToAllDispatcher

        return DedupAllToAllDispatcher(num_experts, group, config.max_tokens_per_rank)
    from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher

    return AllToAllDispatcher(num_experts, group, config.max_tokens_per_rank)
