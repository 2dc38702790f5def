"""Capacity-bounded dispatch: every expert takes at most ``C`` rows from each rank; the rest drop.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of the
expert-parallel group (1 on one process), L = E / D local experts, C capacity per (rank, expert).

``C`` (``capacity``) comes from each rank's own ``T``, as data parallelism of the unsharded model
computes it on each rank's micro-batch. Each rank fills a ``[E, C_max, H]`` buffer, ``C_max`` the
largest capacity in the group, slot ``(e, c)`` holding the ``c``-th row this rank keeps for expert
``e`` (zeros where fewer arrived). The drop policy picks the rows kept (``keep_slots``). A dropped
(token, expert) pair contributes nothing to the layer output: the token still flows through the
decoder's residual connection. The dropped count is returned so the layer can report it. The
all-to-all exchanges ``L * C_max`` rows with each rank and each local expert runs on exactly
``D * C_max`` rows, so no split size is read back. When the ranks' token counts may differ, ``C_max``
needs them: one all-gather of one integer per call of the model (``lightning_ep.moe.tokens``).
Padding rows are zeros and no output is read from them, so they change nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_ep.moe.config import DropPolicy
from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, expert_layout
from lightning_ep.moe.dispatch.comm import all_to_all, finish_all_to_all, start_all_to_all
from lightning_ep.moe.dispatch.rows import count_ids, narrow_keys

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.tokens import LayerTokens


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert accepts from one rank: ``ceil((T * K / E) * capacity_factor)``, at least 1. The
    float operations are Megatron-Core's (``get_capacity(T * K, E, capacity_factor)``), so the
    integer is the same at exact boundaries, where ``capacity_factor * T * K / E`` may round the other
    way (``T, K, E = 30, 6, 4`` and ``capacity_factor = 2.2``: ``ceil(2.2 * 30 * 6 / 4) = 99`` but
    ``ceil((30 * 6 / 4) * 2.2) = ceil(99.00000000000001) = 100``).
    """
    return max(1, math.ceil((num_tokens * top_k / num_experts) * capacity_factor))


def capacity_tensor(num_tokens: torch.Tensor, top_k: int, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """``capacity`` of a device-side token count (float64, the same operations: the same integer)."""
    rows = num_tokens.to(torch.float64) * top_k
    return torch.ceil((rows / num_experts) * capacity_factor).clamp_min(1).to(torch.int64)


def keep_slots(
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    num_experts: int,
    cap: int | torch.Tensor,
    policy: DropPolicy,
    *,
    positions_T: torch.Tensor | None = None,
    valid_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which (token, choice) pairs fit their expert's capacity ``cap`` (an int or a 0-dim device
    tensor), and their rank within the expert. No host sync.

    The ``"probs"`` policy keeps the highest ``weights_TK``; ``"position"`` the smallest
    ``positions_T`` (int64 position of each token in its sequence; ``None``: token order), ties by
    token order, as Megatron-Core does on its ``[S, B]``-flattened tokens. ``valid_T`` (bool):
    ``False`` at padded tokens, whose pairs are never kept and take no capacity. Returns ``rank_N``
    (int64: the pair's rank within its expert, best first), ``keep_N`` (bool: a real pair with rank
    ``< cap``) and ``counts_E`` (real pairs per expert, before dropping).
    """
    flat_N = expert_ids_TK.reshape(-1)
    n, top_k = flat_N.numel(), expert_ids_TK.shape[1]
    real_N = valid_T.repeat_interleave(top_k) if valid_T is not None else None
    if policy == "probs":
        assert weights_TK is not None
        score_N = weights_TK.detach().reshape(-1)
        if real_N is not None:  # padded pairs rank last
            score_N = torch.where(real_N, score_N, float("-inf"))
        priority = torch.argsort(score_N, descending=True, stable=True)
    else:
        position_N = (
            torch.arange(n, device=flat_N.device) if positions_T is None else positions_T.repeat_interleave(top_k)
        )
        if real_N is not None:
            position_N = torch.where(real_N, position_N, torch.iinfo(torch.int64).max)
        priority = torch.argsort(position_N, stable=True)
    # Stable sort by expert of the priority-ordered pairs: within each expert, best first.
    by_expert = priority[torch.argsort(narrow_keys(flat_N[priority], num_experts), stable=True)]
    all_E = count_ids(expert_ids_TK, num_experts)
    starts_E = torch.cumsum(all_E, 0) - all_E
    rank_sorted = torch.arange(n, device=flat_N.device) - starts_E[flat_N[by_expert]]
    rank_N = torch.empty_like(rank_sorted).scatter_(0, by_expert, rank_sorted)
    if real_N is None:
        return rank_N, rank_N < cap, all_E
    return rank_N, (rank_N < cap) & real_N, count_ids(expert_ids_TK, num_experts, valid_T)


@dataclass(frozen=True)
class SlotPlan:
    """Each pair's slot ``e * C_max + c`` in the ``[E * C_max, H]`` buffer, whether it was kept, and ``C_max``."""

    slot_N: torch.Tensor
    keep_N: torch.Tensor
    cap: int


class CapacityDispatcher(Dispatcher):
    """Static-size dispatch with a per-(rank, expert) capacity; ``group=None`` is one process."""

    def __init__(
        self, num_experts: int, capacity_factor: float, drop_policy: DropPolicy, group: dist.ProcessGroup | None = None
    ) -> None:
        self.degree, _, self.num_local_experts = expert_layout(num_experts, group)
        self.group = group if self.degree > 1 else None
        self.num_experts, self.capacity_factor, self.drop_policy = num_experts, capacity_factor, drop_policy
        # Above one rank every rank's token count sizes the common capacity C_max.
        self.needs_group_tokens = self.group is not None

    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        """Rows for the local experts (still travelling above one rank). Of ``tokens`` it reads the
        positions, every rank's token count and the padding mask (one process only, where the layer
        keeps the call's shapes under ``torch.compile``: the capacity is then that of the real tokens)."""
        positions_T = tokens.positions_T if tokens is not None else None
        valid_T = tokens.valid_T if tokens is not None else None
        group_tokens = tokens.group_tokens if tokens is not None else None
        T, K = expert_ids_TK.shape
        E, L, D = self.num_experts, self.num_local_experts, self.degree
        if valid_T is not None:
            cap: int | torch.Tensor = capacity_tensor(valid_T.sum(), K, E, self.capacity_factor)
            slots = capacity(T, K, E, self.capacity_factor)  # room for the largest count: all real
        else:
            cap = slots = capacity(T, K, E, self.capacity_factor)
            if D > 1 and group_tokens is not None:
                slots = max(capacity(t, K, E, self.capacity_factor) for t in group_tokens)
        rank_N, keep_N, counts_E = keep_slots(
            expert_ids_TK, weights_TK, E, cap, self.drop_policy, positions_T=positions_T, valid_T=valid_T
        )
        slot_N = expert_ids_TK.reshape(-1) * slots + rank_N
        # Buffer [E * C_max (+1), H]: row e * C_max + c is the c-th kept row for expert e, zeros where
        # fewer arrived; dropped pairs all land in the extra last row, which is cut off (no
        # compaction, so no host sync).
        dest_N = torch.where(keep_N, slot_N, E * slots)
        pair_rows_NH = x_TH.index_select(0, torch.arange(T * K, device=x_TH.device) // K)
        send_XH = x_TH.new_zeros((E * slots + 1, x_TH.shape[1])).index_copy(0, dest_N, pair_rows_NH)[: E * slots]
        counts_L = torch.full((L,), D * slots, dtype=torch.int64, device=x_TH.device)
        plan = SlotPlan(slot_N, keep_N, slots)
        counts_host = [D * slots] * L  # known without a sync
        # What Megatron-Core's "balanced" bias counts: the pairs each expert kept.
        kept_E = torch.minimum(counts_E, torch.as_tensor(cap, device=counts_E.device))
        dropped = counts_E.sum() - keep_N.sum()

        def dispatched(x_MH: torch.Tensor | None, arrive: Any = None) -> Dispatched:
            return Dispatched(
                x_MH, counts_L, counts_E, plan, arrive=arrive, counts_host=counts_host, kept_per_expert_E=kept_E,
                tokens_dropped=dropped,
            )  # fmt: skip

        if self.group is None:
            return dispatched(send_XH)
        splits = [L * slots] * D
        pending_XH, flight = start_all_to_all(send_XH, splits, splits, self.group)

        def arrive() -> torch.Tensor:
            recv_XH = finish_all_to_all(pending_XH, flight)  # [D, L, C, H] by source rank
            return recv_XH.view(D, L, slots, -1).transpose(0, 1).reshape(L * D * slots, -1)  # [L, D, C, H]

        # The rows travel until the first read of x_MH (see Dispatched).
        return dispatched(None, arrive)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        plan: SlotPlan = dispatched.plan
        cap, slot_N, keep_N = plan.cap, plan.slot_N, plan.keep_N
        L, D = self.num_local_experts, self.degree
        if self.group is not None:
            back_XH = y_MH.view(L, D, cap, -1).transpose(0, 1).reshape(D * L * cap, -1)
            splits = [L * cap] * D
            y_XH = all_to_all(back_XH, splits, splits, self.group)  # [E * C, H] in my slot order
        else:
            y_XH = y_MH
        T, K = weights_TK.shape
        # Dropped pairs read slot 0 and get weight 0: the same shapes, no contribution.
        rows_NH = y_XH.index_select(0, torch.where(keep_N, slot_N, 0)).view(T, K, y_XH.shape[-1])
        weights = torch.where(keep_N.view(T, K), weights_TK, torch.zeros_like(weights_TK))
        return torch.bmm(weights.to(rows_NH.dtype).unsqueeze(1), rows_NH).squeeze(1)
