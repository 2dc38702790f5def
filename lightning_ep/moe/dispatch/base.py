"""Dispatchers: move routed token rows to the experts that own them and bring the outputs back.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of the
expert-parallel group, L = E / D experts held per rank, N = T * K routed rows on this rank, M rows
received for the local experts.

Every dispatcher has the same two-call interface; what one call's ``combine`` needs travels in its
``Dispatched``, and what a dispatcher keeps between calls (a row budget, a kept exchange) it says:

    dispatched = dispatcher.dispatch(x_TH, expert_ids_TK)     # rows grouped by local expert
    y_MH = experts(dispatched.x_MH, dispatched.counts_L)
    out_TH = dispatcher.combine(y_MH, weights_TK, dispatched)   # weighted sum over the K choices

``LocalDispatcher`` (one process, or no expert parallelism) lives here; the collective ones in
``lightning_ep.moe.dispatch.all_to_all``. Process groups are always passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_ep.moe.dispatch.combine import sum_copies, weighted_combine


class Dispatched:
    """Rows for the local experts, plus what ``combine`` needs to undo the dispatch.

    A dispatcher may return while the rows are still travelling (``arrive``): the first read of
    ``x_MH`` waits for them, so work done between ``dispatch`` and that read (the layer's shared
    experts) overlaps the exchange.

    Attributes:
        x_MH: rows sorted by local expert.
        counts_L: rows per local expert (int64, device), summing to ``M``.
        tokens_per_expert_E: tokens this rank routed to each global expert (int64, device).
        state: dispatcher-private bookkeeping.
        counts_host: ``counts_L`` as host integers when the dispatcher read them anyway (its one
            host sync), else ``None``; the experts may then pick a path that needs them.
    """

    def __init__(
        self,
        x_MH: torch.Tensor | None,
        counts_L: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        state: dict[str, Any] | None = None,
        *,
        arrive: Callable[[], torch.Tensor] | None = None,
        counts_host: list[int] | None = None,
    ) -> None:
        if (x_MH is None) == (arrive is None):
            raise ValueError("Dispatched needs exactly one of x_MH and arrive.")
        self._x_MH = x_MH
        self._arrive = arrive
        self.counts_L = counts_L
        self.counts_host = counts_host
        self.tokens_per_expert_E = tokens_per_expert_E
        self.state = state if state is not None else {}

    @property
    def x_MH(self) -> torch.Tensor:
        if self._arrive is not None:
            self._x_MH, self._arrive = self._arrive(), None
        assert self._x_MH is not None
        return self._x_MH


class Dispatcher(Protocol):
    """The interface every dispatcher implements."""

    num_experts: int
    num_local_experts: int

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> Dispatched: ...

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...


def expert_counts(sorted_ids_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert (int64 ``[E]``) from ids sorted ascending, by binary search.

    Unlike ``torch.bincount``, which reads the maximum id back to the host on CUDA, this never
    synchronises with the device, and it is deterministic.
    """
    bounds = torch.arange(num_experts + 1, device=sorted_ids_N.device, dtype=sorted_ids_N.dtype)
    edges_E1 = torch.searchsorted(sorted_ids_N, bounds)
    return edges_E1[1:] - edges_E1[:-1]


def block_of_rows(ends: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """For each row index in ``rows``, the block that holds it, blocks laid out one after another
    with inclusive ends ``ends`` (the prefix sums of their sizes), by binary search: no host sync.
    Rows past the last block (padding) get the last block's index."""
    return torch.searchsorted(ends, rows, right=True).clamp_(max=ends.numel() - 1)


def count_ids(expert_ids_TK: torch.Tensor, num_experts: int, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Rows per expert (int64 ``[E]``) of unsorted ids, by an integer scatter-add: no host sync.

    ``valid_T`` (bool ``[T]``): count the rows of those tokens only."""
    flat = expert_ids_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    if valid_T is None:
        return counts_E.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    ones = valid_T.to(torch.int64)[:, None].expand(expert_ids_TK.shape).reshape(-1)
    return counts_E.scatter_add_(0, flat, ones)


def narrow_keys(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """``keys`` (integers in ``[0, bound]``) in the narrowest integer dtype that holds ``bound``.

    A stable sort gives the same order on the narrowed keys, in fewer passes: CUDA's radix sort
    makes one pass per 8 key bits (int64: 8 passes, ``uint8``: 1).
    """
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max:
            return keys.to(dtype)
    return keys


def sort_by_expert(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the ``N = T * K`` (token, choice) pairs by expert, and the count per expert.

    Returns:
        ``order_N`` (int64: position ``i`` of the sorted list holds flat pair ``order_N[i]``, whose
        token is ``order_N[i] // K``) and ``counts_E`` (int64). No host sync.
    """
    # num_experts, not num_experts - 1: expert_counts searches for the bound E too.
    sorted_N, order_N = torch.sort(narrow_keys(expert_ids_TK.reshape(-1), num_experts), stable=True)
    return order_N, expert_counts(sorted_N, num_experts)


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i`` (a scatter: no host sync)."""
    arange_N = torch.arange(order_N.numel(), device=order_N.device, dtype=order_N.dtype)
    return torch.empty_like(order_N).scatter_(0, order_N, arange_N)


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; backward gathers with the inverse permutation.

    ``index_select``'s own backward zero-fills a buffer and scatter-adds into it with atomics;
    for a permutation the adjoint is a plain gather: one read and one write, deterministic.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _ExpandRows(torch.autograd.Function):
    """``x_NH[i] = x_TH[order_N[i] // K]``; backward: each token's K gradient copies, found through
    the inverse, summed (``combine.sum_copies``: one pass on CUDA).

    The sum over ``K`` runs in fp32 and rounds once, instead of ``K`` rounded atomic adds.
    """

    @staticmethod
    def forward(
        ctx: Any, x_TH: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse_N)
        ctx.shape = (x_TH.shape[0], top_k)
        return x_TH.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx: Any, grad_NH: torch.Tensor) -> tuple[Any, ...]:
        (inverse_N,) = ctx.saved_tensors
        return sum_copies(grad_NH, inverse_N, ctx.shape[1]), None, None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in the order of the permutation ``index`` (``inverse`` is its inverse)."""
    return _PermuteRows.apply(x, index, inverse)


def gather_rows(
    x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int, inverse_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of ``x_TH`` in sorted pair order: ``x_NH[i] = x_TH[order_N[i] // K]``.

    ``order_N`` must be a permutation of ``T * K`` pairs (``inverse_N`` its inverse, computed if not
    given); then the backward is a gather and a sum over the ``K`` copies (no atomics).
    """
    if inverse_N is None:
        inverse_N = inverse_permutation(order_N)
    return _ExpandRows.apply(x_TH, order_N, inverse_N, top_k)


def weighted_unsort(
    y_NH: torch.Tensor, inverse_N: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """Undo ``gather_rows`` and combine: ``out[t] = sum_k weights[t, k] * y[pair (t, k)]``.

    ``inverse_N`` is the inverse of ``order_N``. A fused Triton kernel on CUDA, a permutation
    gather plus a batched product elsewhere (``lightning_ep.moe.dispatch.combine``); deterministic, no atomics.
    """
    return weighted_combine(y_NH, inverse_N, order_N, weights_TK)


class LocalDispatcher:
    """All experts on this process: sort rows by expert, run, unsort and combine."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> Dispatched:
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        inverse_N = inverse_permutation(order_N)
        x_NH = gather_rows(x_TH, order_N, expert_ids_TK.shape[1], inverse_N)
        return Dispatched(x_NH, counts_E, counts_E, {"order_N": order_N, "inverse_N": inverse_N})

    def dispatch_static(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> tuple[Dispatched, None]:
        """``dispatch``: its shapes depend on ``T`` and ``K`` alone and it reads nothing back to the
        host, so ``LayerGraphs`` can capture it (``Execution(cuda_graphs=True)`` at degree 1). No budget,
        so no per-rank loads (``None``)."""
        return self.dispatch(x_TH, expert_ids_TK), None

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        state = dispatched.state
        return weighted_unsort(y_MH, state["inverse_N"], state["order_N"], weights_TK)


def dispatch(
    dispatcher: Dispatcher,
    x_TH: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    tokens: Any,
    keep: Any = None,
) -> Dispatched:
    """``dispatcher.dispatch`` with what this dispatcher takes of the call: the weights, positions and
    padding mask (capacity: ``"probs"`` ranks rows by weight), every rank's token count (ragged
    ranks), or the exchange kept for a recomputation (``keep``). ``tokens``: the call's
    ``tokens.LayerTokens``."""
    any_dispatcher: Any = dispatcher
    if getattr(dispatcher, "takes_weights", False):
        return any_dispatcher.dispatch(
            x_TH,
            expert_ids_TK,
            weights_TK,
            positions_T=tokens.positions_T,
            valid_T=tokens.valid_T,
            group_tokens=tokens.group_tokens,
        )
    if getattr(dispatcher, "needs_group_tokens", False):
        return any_dispatcher.dispatch(x_TH, expert_ids_TK, group_tokens=tokens.group_tokens)
    if keep is not None:
        return any_dispatcher.dispatch(x_TH, expert_ids_TK, keep=keep)
    return dispatcher.dispatch(x_TH, expert_ids_TK)
