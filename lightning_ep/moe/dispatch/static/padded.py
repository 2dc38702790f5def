"""The dropless all-to-all on a static plan: every exchange padded to a row budget, no host sync.

Legend as in ``lightning_ep.moe.dispatch.all_to_all``; ``R`` rows received per rank (the budget),
``C = R / D`` rows each rank sends to each rank (its slot count per destination).

The all-to-all dispatcher reads its split sizes on the host (one sync per layer). Here every rank
sends exactly ``C`` rows to every rank: the pairs for rank ``d``'s experts, in sorted order, fill
slots ``d * C ..`` and the rest are zeros. The exchange is an even ``all_to_all_single`` whose sizes
the host knows in advance, and the received ``[D * C, H]`` rows are regrouped by local expert on
the device, padding rows last, where the grouped GEMM stops at the last expert's offset. The rows,
their order and the arithmetic are the dynamic plan's, so the numbers are the same bits. A source
that routes more than ``C`` pairs to one rank in a layer overflows: its pairs past ``C`` are left
out of that layer's output, and ``RowBudget`` notes the loads (the same on every rank).

Cost: ``D * C`` rows per exchange instead of the rows routed: an automatic budget is ``HEADROOM``
times the largest source-to-rank load times ``D``, so at least ``HEADROOM`` times the routed rows, more
where routing is uneven; in exchange, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher
from lightning_ep.moe.dispatch.base import Dispatched, gather_counts
from lightning_ep.moe.dispatch.comm import all_to_all
from lightning_ep.moe.dispatch.rows import (
    block_of_rows,
    gather_rows,
    inverse_permutation,
    sort_by_expert,
    weighted_unsort,
)
from lightning_ep.moe.dispatch.static.budget import RowBudget

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.tokens import LayerTokens


@dataclass(frozen=True)
class PaddedPlan:
    """The index maps of one padded dispatch (``padded_plan``), the sort order and its inverse, and ``C``."""

    send_S: torch.Tensor
    slot_N: torch.Tensor
    regroup_M: torch.Tensor
    unregroup_S: torch.Tensor
    counts_L: torch.Tensor
    loads_D: torch.Tensor
    order_N: torch.Tensor | None = None
    inverse_N: torch.Tensor | None = None
    C: int = 0


class PaddedAllToAllDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher on the static plan padded to a row budget (see the module docstring).

    ``row_budget``: ``R`` rows received per rank (rounded up to a multiple of the degree), or
    ``"auto"``: sized from the first dispatch's loads, grown after an excess. ``max_tokens_per_rank``
    is checked by the dynamic plan, which runs (one host sync) under ``dynamic``, for an automatic
    budget not sized yet (sizing it from that dispatch's loads), and without grad (evaluation, which
    no fallback watches).
    """

    keeps_exchanges = False
    budget: RowBudget

    def __init__(
        self, num_experts: int, group: dist.ProcessGroup, row_budget: int | str, max_tokens_per_rank: int | None = None
    ) -> None:
        super().__init__(num_experts, group, max_tokens_per_rank)
        auto = row_budget == "auto"
        self.budget = RowBudget(None if auto else int(row_budget), adaptive=auto, multiple=self.degree)

    @property
    def static_plan(self) -> bool:
        return self.budget.budget is not None

    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        if keep is not None:
            raise ValueError("keep_all_to_all needs the dynamic all-to-all plan, not a row budget.")
        if self.dynamic or self.budget.budget is None or not torch.is_grad_enabled():  # evaluation: dynamic
            if self.budget.budget is None:  # sized from the loads dispatch_static would note: one more host read
                _, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
                self.budget.fit(pair_loads(gather_counts(counts_E, self.group), self.num_local_experts).tolist())
            return super().dispatch(x_TH, expert_ids_TK, weights_TK)
        if self.budget.raise_at_dispatch:
            self.budget.check(wait=False)
        dispatched, loads_D = self.dispatch_static(x_TH, expert_ids_TK)
        self.budget.note(loads_D)
        return dispatched

    def dispatch_static(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> tuple[Dispatched, torch.Tensor]:
        """The dispatch on the padded plan, and ``loads_D``: for each destination rank, the most
        pairs one source sent it, times ``D`` (over the budget ``R`` exactly when a source overflowed)."""
        D, L, K = self.degree, self.num_local_experts, expert_ids_TK.shape[1]
        assert self.budget.budget is not None
        C = self.budget.budget // D
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        inverse_N = inverse_permutation(order_N)
        counts_DE = gather_counts(counts_E, self.group)
        plan = padded_plan(counts_DE, self.rank, L, C, order_N.numel(), order_N=order_N, inverse_N=inverse_N)
        x_SH = _SelectRows.apply(gather_rows(x_TH, order_N, K, inverse_N), plan.send_S, plan.slot_N)
        recv_SH = all_to_all(x_SH, [C] * D, [C] * D, self.group)
        x_MH = _SelectRows.apply(recv_SH, plan.regroup_M, plan.unregroup_S)
        return Dispatched(x_MH, plan.counts_L, counts_E, plan), plan.loads_D

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        plan = dispatched.plan
        if not isinstance(plan, PaddedPlan):  # the dynamic plan
            return super().combine(y_MH, weights_TK, dispatched)
        assert plan.order_N is not None and plan.inverse_N is not None
        splits = [plan.C] * self.degree
        y_SH = _SelectRows.apply(y_MH, plan.unregroup_S, plan.regroup_M)
        y_back_SH = all_to_all(y_SH, splits, splits, self.group)
        y_NH = _SelectRows.apply(y_back_SH, plan.slot_N, plan.send_S)
        return weighted_unsort(y_NH, plan.inverse_N, plan.order_N, weights_TK)


def pair_loads(counts_DE: torch.Tensor, num_local: int) -> torch.Tensor:
    """For each destination rank, the most pairs one source routes to it, times ``D``: ``[D]``."""
    D = counts_DE.shape[0]
    pairs_DD = counts_DE.view(D, D, num_local).sum(2)  # [source, destination]
    return pairs_DD.max(0).values * D


def padded_plan(
    counts_DE: torch.Tensor,
    rank: int,
    num_local: int,
    slots: int,
    pairs: int,
    *,
    order_N: torch.Tensor | None = None,
    inverse_N: torch.Tensor | None = None,
) -> PaddedPlan:
    """The index maps of one padded dispatch, from the gathered counts ``C[s, e]`` (no host sync).
    Send side (``S = D * slots`` rows): ``send_S[q]`` is the sorted pair in slot ``q`` (``-1``:
    padding), ``slot_N[p]`` the slot of sorted pair ``p`` (``-1``: past its destination's slots).
    Receive side: ``regroup_M[m]`` is the received row that expert-major row ``m`` holds (local
    expert, then source rank, then the source's sorted order; ``-1``: padding or overflow) and
    ``unregroup_S`` its inverse. ``counts_L``: rows per local expert, within the ``S`` rows.
    """
    D, L, device = counts_DE.shape[0], num_local, counts_DE.device
    rows = D * slots
    # Send: the sorted pairs for rank d are contiguous; the first ``slots`` of them fill its slots.
    sent_D = counts_DE[rank].view(D, L).sum(1)
    first_D = torch.cumsum(sent_D, 0) - sent_D
    arange_N = torch.arange(pairs, device=device)
    dest_N = block_of_rows(torch.cumsum(sent_D, 0), arange_N)
    within_N = arange_N - first_D[dest_N]
    slot_N = torch.where(within_N < slots, dest_N * slots + within_N, -1)
    arange_S = torch.arange(rows, device=device)
    dest_S, within_S = torch.div(arange_S, slots, rounding_mode="floor"), arange_S % slots
    send_S = torch.where(within_S < sent_D[dest_S], first_D[dest_S] + within_S, -1)
    # Receive: source s's slots hold its pairs for my experts l = 0..L-1, in that order.
    mine_DL = counts_DE[:, rank * L : (rank + 1) * L]  # [source, local expert]
    start_DL = torch.cumsum(mine_DL, 1) - mine_DL
    sizes = mine_DL.T.reshape(-1)  # segments (l, s), expert-major
    ends = torch.cumsum(sizes, 0)
    segment_M = block_of_rows(ends, arange_S)
    source_M, expert_M = segment_M % D, torch.div(segment_M, D, rounding_mode="floor")
    within_M = start_DL[source_M, expert_M] + arange_S - (ends - sizes)[segment_M]
    regroup_M = torch.where((arange_S < ends[-1]) & (within_M < slots), source_M * slots + within_M, -1)
    unregroup_S = torch.full((rows + 1,), -1, dtype=regroup_M.dtype, device=device)
    unregroup_S.scatter_(0, torch.where(regroup_M >= 0, regroup_M, rows), arange_S)
    ends_L = torch.cumsum(mine_DL.sum(0), 0).clamp(max=rows)
    counts_L = torch.diff(ends_L, prepend=ends_L.new_zeros(1))
    loads_D = pair_loads(counts_DE, L)
    return PaddedPlan(send_S, slot_N, regroup_M, unregroup_S[:rows], counts_L, loads_D, order_N, inverse_N, slots)


class _SelectRows(torch.autograd.Function):
    """``out[i] = x[index[i]]``, zero where ``index[i] < 0``, for an ``index`` whose non-negative
    entries are distinct; ``inverse[j]`` is the ``i`` with ``index[i] = j`` (``-1``: none). Backward
    is the same selection with the two swapped: a gather, deterministic, no atomics."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, inverse)
        return _select(x, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _, inverse = ctx.saved_tensors
        return _select(grad, inverse), None, None


def _select(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:  # nothing to select: every entry is padding
        return x.new_zeros((index.numel(), *x.shape[1:]))
    rows = x.index_select(0, index.clamp(min=0))
    return torch.where((index >= 0)[:, None], rows, rows.new_zeros(()))
