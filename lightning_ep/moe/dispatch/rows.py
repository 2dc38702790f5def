"""Row permutations of a dispatch: sort (token, choice) pairs by expert, gather their rows, undo it.

Legend: T tokens, H hidden size, K experts per token, E experts, N = T * K pairs. None of these
reads a value back to the host; the permutations' backwards are gathers (deterministic, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ep.moe.dispatch.combine import sum_copies, weighted_combine


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
