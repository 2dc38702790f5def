"""Router losses as pure functions, and the autograd hook that adds them to the gradients.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

from typing import Any

import torch


def load_balancing_loss(
    probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor, valid_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Load-balancing loss ``E * sum_i f_i * P_i`` of one layer, as SMP v2 and Megatron-Core define it.

    ``f_i``: the fraction of the routed (token, expert) pairs that went to expert ``i`` (its count over
    ``T * K``: the ``f_i`` sum to 1); ``P_i``: the mean router probability of expert ``i``. Even routing
    gives 1 whatever the probabilities. Megatron-Core's ``switch_load_balancing_loss_func`` computes
    exactly this (before its coefficient); ``transformers``' ``load_balancing_loss_func`` on this
    layer's logits alone is ``K`` times it (its ``f_i`` sum to ``K``). Gradients flow through ``P`` only.

    ``probs_TE``: float ``[T, E]`` router probabilities; ``expert_ids_TK``: int64 ``[T, K]`` choices;
    ``valid_T``: bool ``[T]``, ``False`` at padded positions, which count neither in ``f`` nor in ``P``
    (``T`` becomes the number of real tokens). Returns a 0-dim tensor in ``probs_TE``'s dtype, 0
    without a real token.
    """
    num_tokens, num_experts = probs_TE.shape
    top_k = expert_ids_TK.shape[1]
    counts_E = torch.zeros(num_experts, dtype=probs_TE.dtype, device=probs_TE.device)
    ones_TK = torch.ones_like(expert_ids_TK, dtype=probs_TE.dtype)
    if valid_T is None:
        real: torch.Tensor | int = max(num_tokens, 1)
        prob_sums_E = probs_TE.sum(dim=0)
    else:
        ones_TK = ones_TK * valid_T[:, None]
        real = valid_T.sum().clamp_min(1).to(probs_TE.dtype)
        prob_sums_E = torch.where(valid_T[:, None], probs_TE, 0.0).sum(dim=0)
    counts_E.scatter_add_(0, expert_ids_TK.reshape(-1), ones_TK.reshape(-1))
    fraction_E = counts_E / (real * top_k)
    mean_prob_E = prob_sums_E / real
    return num_experts * torch.sum(fraction_E * mean_prob_E)


def z_loss(
    logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None, weight_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Router z-loss ``mean_t(logsumexp(logits_t)^2)`` (ST-MoE): keeps router logits small. The mean
    runs over the real tokens of ``valid_T`` (0 without one). ``weight_T`` weighs each token's term (the
    sum still divided by the number of tokens): the token shuffle gives a token from a rank with ``T_s``
    tokens the weight ``T / T_s``, its weight in that rank's own mean."""
    squares_T = torch.logsumexp(logits_TE, dim=-1).square()
    if weight_T is not None:
        squares_T = squares_T * weight_T.to(squares_T.dtype)
    if valid_T is None:
        if weight_T is not None:
            return squares_T.sum() / max(logits_TE.shape[0], 1)
        return squares_T.mean() if logits_TE.shape[0] else squares_T.sum()
    return torch.where(valid_T, squares_T, 0.0).sum() / valid_T.sum().clamp_min(1)


class _AttachLosses(torch.autograd.Function):
    """Identity on ``x``; in backward, gives each attached loss the gradient ``weight``: the router
    losses reach the gradients without the user adding them to the loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: tuple[float, ...], *losses: torch.Tensor) -> torch.Tensor:
        ctx.weights = weights
        ctx.loss_meta = [(loss.dtype, loss.device) for loss in losses]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor) -> tuple[Any, ...]:
        grads = tuple(
            torch.full((), w, dtype=dtype, device=device)
            for w, (dtype, device) in zip(ctx.weights, ctx.loss_meta, strict=True)
        )
        return (grad_x, None, *grads)


def attach_losses(x: torch.Tensor, losses: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Return ``x`` unchanged, with ``sum_i weights[i] * losses[i]`` added to what backward differentiates
    (losses that do not require grad, or whose weight is 0, are skipped)."""
    kept = [(loss, w) for loss, w in zip(losses, weights, strict=True) if w != 0 and loss.requires_grad]
    if not kept or not torch.is_grad_enabled():
        return x
    return _AttachLosses.apply(x, tuple(w for _, w in kept), *(loss for loss, _ in kept))
