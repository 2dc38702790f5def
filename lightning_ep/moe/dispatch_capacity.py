"""Capacity-bounded dispatch: every expert takes at most ``C`` rows from each rank; the rest drop.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of the
expert-parallel group (1 on one process), L = E / D local experts, C capacity per (rank, expert).

``C = ceil(capacity_factor * T * K / E)``. Each rank fills a ``[E, C, H]`` buffer, slot ``(e, c)``
holding the ``c``-th row this rank keeps for expert ``e`` (zeros where fewer arrived). Which rows
are kept when an expert is over capacity is the drop policy: ``"probs"`` keeps the highest routing
weights, ``"position"`` the earliest tokens. A dropped (token, expert) pair contributes nothing to
the layer output: the token still flows through the decoder's residual connection. The dropped
count is returned so the layer can report it.

Every size is static: the all-to-all exchanges ``L * C`` rows with each rank and each local expert
runs on exactly ``D * C`` rows, so there is no device-to-host sync at all. Padding rows are zeros;
a SwiGLU expert maps zero to zero and no output is read from them, so they change nothing.
Capacities are computed from each rank's own ``T``: all ranks of a group must have the same ``T``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_ep.moe.comm import all_to_all, finish_all_to_all, start_all_to_all
from lightning_ep.moe.config import DropPolicy
from lightning_ep.moe.dispatch import Dispatched, narrow_keys


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert accepts from one rank: ``ceil(capacity_factor * T * K / E)``, at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def keep_slots(
    expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor | None, num_experts: int, cap: int, policy: DropPolicy
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which (token, choice) pairs fit their expert's capacity, and where they go.

    Returns:
        ``slot_N`` (int64, ``expert * C + rank within the expert``, for every flat pair),
        ``keep_N`` (bool: rank within the expert ``< C``) and ``counts_E`` (pairs per expert,
        before dropping). No host sync.
    """
    flat_N = expert_ids_TK.reshape(-1)
    n = flat_N.numel()
    if policy == "probs":
        assert weights_TK is not None
        priority = torch.argsort(weights_TK.detach().reshape(-1), descending=True, stable=True)
    else:
        priority = torch.arange(n, device=flat_N.device)
    # Stable sort by expert of the priority-ordered pairs: within each expert, best first.
    by_expert = priority[torch.argsort(narrow_keys(flat_N[priority], num_experts), stable=True)]
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_N.device)
    counts_E.scatter_add_(0, flat_N, torch.ones_like(flat_N))
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted = torch.arange(n, device=flat_N.device) - starts_E[flat_N[by_expert]]
    rank_N = torch.empty_like(rank_sorted).scatter_(0, by_expert, rank_sorted)
    return flat_N * cap + rank_N, rank_N < cap, counts_E


class CapacityDispatcher:
    """Static-size dispatch with a per-(rank, expert) capacity; ``group=None`` is one process.

    Args:
        num_experts: global expert count ``E``.
        capacity_factor: ``C = ceil(capacity_factor * T * K / E)``.
        drop_policy: ``"probs"`` or ``"position"``.
        group: the expert-parallel process group, or ``None``.
    """

    def __init__(
        self, num_experts: int, capacity_factor: float, drop_policy: DropPolicy, group: dist.ProcessGroup | None = None
    ) -> None:
        self.group = group
        self.degree = dist.get_world_size(group) if group is not None else 1
        if num_experts % self.degree:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel degree {self.degree}.")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.degree
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy

    #: The layer passes the routing weights to ``dispatch`` (the "probs" policy ranks by them).
    takes_weights = True

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> Dispatched:
        T, K = expert_ids_TK.shape
        E, L, D = self.num_experts, self.num_local_experts, self.degree
        cap = capacity(T, K, E, self.capacity_factor)
        slot_N, keep_N, counts_E = keep_slots(expert_ids_TK, weights_TK, E, cap, self.drop_policy)
        # Buffer [E * C (+1), H]: row e * C + c is the c-th kept row for expert e, zeros where fewer
        # arrived; dropped pairs all land in the extra last row, which is cut off (no compaction,
        # so no host sync).
        dest_N = torch.where(keep_N, slot_N, E * cap)
        pair_rows_NH = x_TH.index_select(0, torch.arange(T * K, device=x_TH.device) // K)
        send_XH = x_TH.new_zeros((E * cap + 1, x_TH.shape[1])).index_copy(0, dest_N, pair_rows_NH)[: E * cap]
        counts_L = torch.full((L,), D * cap, dtype=torch.int64, device=x_TH.device)
        state = {"slot_N": slot_N, "keep_N": keep_N, "cap": cap, "tokens_dropped": (~keep_N).sum()}
        counts_host = [D * cap] * L  # known without a sync
        if self.group is None or D == 1:
            return Dispatched(send_XH, counts_L, counts_E, state, counts_host=counts_host)
        splits = [L * cap] * D
        pending_XH, flight = start_all_to_all(send_XH, splits, splits, self.group)

        def arrive() -> torch.Tensor:
            recv_XH = finish_all_to_all(pending_XH, flight)  # [D, L, C, H] by source rank
            return recv_XH.view(D, L, cap, -1).transpose(0, 1).reshape(L * D * cap, -1)  # [L, D, C, H]

        # The rows travel until the first read of x_MH (see Dispatched).
        return Dispatched(None, counts_L, counts_E, state, arrive=arrive, counts_host=counts_host)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        state = dispatched.state
        cap, slot_N, keep_N = state["cap"], state["slot_N"], state["keep_N"]
        L, D = self.num_local_experts, self.degree
        if self.group is not None and D > 1:
            back_XH = y_MH.view(L, D, cap, -1).transpose(0, 1).reshape(D * L * cap, -1)
            splits = [L * cap] * D
            y_XH = all_to_all(back_XH, splits, splits, self.group)  # [E * C, H] in my slot order
        else:
            y_XH = y_MH
        T, K = weights_TK.shape
        # Dropped pairs read slot 0 and get weight 0: the same shapes, no contribution.
        rows_NH = y_XH.index_select(0, torch.where(keep_N, slot_N, 0)).view(T, K, -1)
        weights = torch.where(keep_N.view(T, K), weights_TK, torch.zeros_like(weights_TK))
        return torch.bmm(weights.to(rows_NH.dtype).unsqueeze(1), rows_NH).squeeze(1)
