"""The all-gather dispatcher (``MoEConfig(moe_all_to_all_dispatcher=False)``).

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of the
expert-parallel group, L = E / D experts per rank, G = D * T' gathered tokens (T' the largest count),
M rows for the local experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, expert_layout
from lightning_ep.moe.dispatch.comm import all_gather_rows, reduce_scatter_rows
from lightning_ep.moe.dispatch.rows import count_ids, expert_counts, narrow_keys

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.tokens import LayerTokens


@dataclass(frozen=True)
class GatherPlan:
    """The gathered pairs for the local experts (``order_M``: flat pair ``g * K + k`` of the gathered
    tokens), the gathered rows ``G`` and the per-rank row count ``T'`` they were padded to."""

    order_M: torch.Tensor
    rows: int
    padded: int


class AllGatherDispatcher(Dispatcher):
    """Every rank gathers all tokens of the group, runs its local experts on the rows routed to
    them, weights them, and the partial outputs are reduce-scattered back to their ranks. Ranks may
    hold different numbers of tokens (``tokens.group_tokens``): each pads its rows to the largest
    count with rows routed nowhere, so the gather and the reduce-scatter stay equal-sized. One host
    read (the number of rows for the local experts) per layer.
    """

    group: dist.ProcessGroup

    needs_group_tokens = True

    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        self.group, self.num_experts = group, num_experts
        self.degree, self.rank, self.num_local_experts = expert_layout(num_experts, group)

    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        L, K, T = self.num_local_experts, expert_ids_TK.shape[1], x_TH.shape[0]
        group_tokens = tokens.group_tokens if tokens is not None else None
        padded = max(group_tokens) if group_tokens is not None else T
        # Rows past T pad this rank to the largest count; their id -1 matches no expert.
        x_all_GH = all_gather_rows(_pad_rows(x_TH, padded, 0), self.group)
        with torch.no_grad():
            ids_all_GK = all_gather_rows(_pad_rows(expert_ids_TK, padded, -1), self.group)
            # Local experts get keys 0..L-1, every other expert (and padding) the key L (sorted last, dropped).
            local_GK = ids_all_GK - self.rank * L
            key_N = torch.where((local_GK >= 0) & (local_GK < L) & (ids_all_GK >= 0), local_GK, L).reshape(-1)
            sorted_key_N, order_N = torch.sort(narrow_keys(key_N, L + 1), stable=True)
            counts_L = expert_counts(sorted_key_N, L + 1)[:L]
            counts_host = counts_L.tolist()  # the one host sync
            order_M = order_N[: sum(counts_host)]
        # Not a permutation (rows of other ranks' experts are left out): a plain index_select.
        x_MH = x_all_GH.index_select(0, torch.div(order_M, K, rounding_mode="floor"))
        plan = GatherPlan(order_M, x_all_GH.shape[0], padded)
        return Dispatched(x_MH, counts_L, count_ids(expert_ids_TK, self.num_experts), plan, counts_host=counts_host)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        plan: GatherPlan = dispatched.plan
        T, K = weights_TK.shape
        weights_all_N = all_gather_rows(_pad_rows(weights_TK, plan.padded, 0), self.group).reshape(-1)
        weighted_MH = y_MH * weights_all_N.index_select(0, plan.order_M).to(y_MH.dtype)[:, None]
        partial_GH = y_MH.new_zeros((plan.rows, y_MH.shape[1]))
        partial_GH = partial_GH.index_add(0, torch.div(plan.order_M, K, rounding_mode="floor"), weighted_MH)
        return reduce_scatter_rows(partial_GH, self.group)[:T]


def _pad_rows(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``x`` with ``rows - len(x)`` rows of ``value`` appended (``x`` itself when none); differentiable."""
    missing = rows - x.shape[0]
    if missing == 0:
        return x
    return torch.cat([x, x.new_full((missing, *x.shape[1:]), value)])
