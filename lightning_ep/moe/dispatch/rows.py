"""Row permutations of a dispatch: sort (token, choice) pairs by expert, gather their rows, undo it.

Legend: T tokens, H hidden size, K experts per token, E experts, N = T * K pairs. None of these
reads a value back to the host; the permutations' backwards are gathers (deterministic, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ep.moe.dispatch.combine import sum_copies, weighted_combine


def expert_counts(sorted_ids_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert (int64 ``[E]``) from ids sorted ascending, by binary search: deterministic,
    and unlike ``torch.bincount`` (which reads the maximum id back on CUDA) no host sync."""
    bounds = torch.arange(num_experts + 1, device=sorted_ids_N.device, dtype=sorted_ids_N.dtype)
    edges_E1 = torch.searchsorted(sorted_ids_N, bounds)
    return edges_E1[1:] - edges_E1[:-1]


def block_of_rows(ends: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """For each row index in ``rows``, the block that holds it, blocks laid out one after another
    with inclusive ends ``ends`` (the prefix sums of their sizes), by binary search: no host sync.
    Rows past the last block (padding) get the last block's index."""
    return torch.searchsorted(ends, rows, right=True).clamp_(max=ends.numel() - 1)


def count_ids(expert_ids_TK: torch.Tensor, num_experts: int, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Rows per expert (int64 ``[E]``) of unsorted ids (of the tokens ``valid_T`` only): no host sync."""
    flat = expert_ids_TK.reshape(-1)
    if valid_T is None:
        ones = torch.ones_like(flat, dtype=torch.int64)
    else:
        ones = valid_T.to(torch.int64)[:, None].expand(expert_ids_TK.shape).reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, ones)


def narrow_keys(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """``keys`` (integers in ``[0, bound]``) in the narrowest integer dtype that holds ``bound``: a
    stable sort gives the same order in fewer passes (CUDA's radix sort makes one per 8 key bits)."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max:
            return keys.to(dtype)
    return keys


def sort_by_expert(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the ``N = T * K`` (token, choice) pairs by expert, and the count per expert:
    ``order_N`` (int64: sorted position ``i`` holds flat pair ``order_N[i]``, of token
    ``order_N[i] // K``) and ``counts_E`` (int64). No host sync."""
    # num_experts, not num_experts - 1: expert_counts searches for the bound E too.
    sorted_N, order_N = torch.sort(narrow_keys(expert_ids_TK.reshape(-1), num_experts), stable=True)
    return order_N, expert_counts(sorted_N, num_experts)


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i`` (a scatter: no host sync)."""
    arange_N = torch.arange(order_N.numel(), device=order_N.device, dtype=order_N.dtype)
    return torch.empty_like(order_N).scatter_(0, order_N, arange_N)


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; backward gathers with the inverse permutation (one
    read, one write, deterministic) where ``index_select``'s zero-fills and scatter-adds with atomics."""

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
    the inverse, summed in fp32 and rounded once (``combine.sum_copies``), not ``K`` rounded atomic adds."""

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
    """Rows of ``x_TH`` in sorted pair order: ``x_NH[i] = x_TH[order_N[i] // K]``, for a permutation
    ``order_N`` of the ``T * K`` pairs (``inverse_N``: its inverse, computed if not given). No atomics."""
    if inverse_N is None:
        inverse_N = inverse_permutation(order_N)
    return _ExpandRows.apply(x_TH, order_N, inverse_N, top_k)


def weighted_unsort(
    y_NH: torch.Tensor, inverse_N: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """Undo ``gather_rows`` and combine: ``out[t] = sum_k weights[t, k] * y[pair (t, k)]``
    (``combine.weighted_combine``; deterministic, no atomics)."""
    return weighted_combine(y_NH, inverse_N, order_N, weights_TK)
