"""Dispatchers: move routed token rows to the experts that own them and bring the outputs back.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of the
expert-parallel group, L = E / D experts held per rank, N = T * K routed rows on this rank, M rows
received for the local experts.

Every dispatcher has the same two-call interface, and keeps no state between calls:

    dispatched = dispatcher.dispatch(x_TH, expert_ids_TK)     # rows grouped by local expert
    y_MH = experts(dispatched.x_MH, dispatched.counts_L)
    out_TH = dispatcher.combine(y_MH, weights_TK, dispatched)   # weighted sum over the K choices

``LocalDispatcher`` (one process, or no expert parallelism) lives here; the collective ones in
``lightning_ep.moe.dispatch_ep``. Process groups are always passed in by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Dispatched:
    """Rows for the local experts, plus what ``combine`` needs to undo the dispatch.

    Attributes:
        x_MH: rows sorted by local expert.
        counts_L: rows per local expert (int64, device), summing to ``M``.
        tokens_per_expert_E: tokens this rank routed to each global expert (int64, device).
        state: dispatcher-private bookkeeping.
    """

    x_MH: torch.Tensor
    counts_L: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    state: dict[str, Any] = field(default_factory=dict)


class Dispatcher(Protocol):
    """The interface every dispatcher implements."""

    num_experts: int
    num_local_experts: int

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> Dispatched: ...

    def combine(
        self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched
    ) -> torch.Tensor: ...


def sort_by_expert(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the ``N = T * K`` (token, choice) pairs by expert, and the count per expert.

    Returns:
        ``order_N`` (int64: position ``i`` of the sorted list holds flat pair ``order_N[i]``, whose
        token is ``order_N[i] // K``) and ``counts_E`` (int64). No host sync.
    """
    flat_N = expert_ids_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    return order_N, counts_E


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``."""
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return inverse_N


def gather_rows(x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows of ``x_TH`` in sorted pair order: ``x_NH[i] = x_TH[order_N[i] // K]``."""
    return x_TH.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))


def weighted_unsort(y_NH: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Undo ``gather_rows`` and combine: ``out[t] = sum_k weights[t, k] * y[pair (t, k)]``.

    A permutation gather plus a batched ``[1, K] @ [K, H]`` product: deterministic, no atomics.
    """
    num_tokens, top_k = weights_TK.shape
    y_TKH = y_NH.index_select(0, inverse_permutation(order_N)).view(num_tokens, top_k, -1)
    return torch.bmm(weights_TK.to(y_TKH.dtype).unsqueeze(1), y_TKH).squeeze(1)


class LocalDispatcher:
    """All experts on this process: sort rows by expert, run, unsort and combine."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> Dispatched:
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        x_NH = gather_rows(x_TH, order_N, expert_ids_TK.shape[1])
        return Dispatched(x_NH, counts_E, counts_E, {"order_N": order_N})

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return weighted_unsort(y_MH, dispatched.state["order_N"], weights_TK)
