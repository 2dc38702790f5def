"""Router losses as pure functions, and the autograd hook that adds them to the gradients.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

from typing import Any

import torch


def load_balancing_loss(probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load-balancing loss ``E * sum_i f_i * P_i`` of one layer.

    ``f_i`` is the fraction of the ``T`` tokens that picked expert ``i`` (counting every one of the
    ``K`` choices, so ``sum_i f_i = K``) and ``P_i`` the mean router probability of expert ``i``.
    Equals ``transformers``' ``load_balancing_loss_func`` given this layer's logits alone, when the
    ids are the top-k of the same softmax. Gradients flow through ``P`` only.

    Args:
        probs_TE: softmax of the router logits, ``[T, E]``, float.
        expert_ids_TK: chosen experts, ``[T, K]``, int64.
    Returns:
        0-dim tensor in the dtype of ``probs_TE``.
    """
    num_tokens, num_experts = probs_TE.shape
    counts_E = torch.zeros(num_experts, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_E.scatter_add_(
        0, expert_ids_TK.reshape(-1), torch.ones_like(expert_ids_TK, dtype=probs_TE.dtype).reshape(-1)
    )
    fraction_E = counts_E / num_tokens
    mean_prob_E = probs_TE.mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_prob_E)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss ``mean_t(logsumexp(logits_t)^2)`` (ST-MoE): keeps router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class _AttachLosses(torch.autograd.Function):
    """Identity on ``x``; in backward, gives each attached loss the gradient ``weight``.

    This is how the router losses reach the gradients without the user adding them to the loss:
    whenever a gradient flows back through the layer output, ``d(total)/d(loss_i) = weight_i``.
    """

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
    """Return ``x`` unchanged, with ``sum_i weights[i] * losses[i]`` added to what backward differentiates.

    Losses that do not require grad, or whose weight is 0, are skipped.
    """
    kept = [(loss, w) for loss, w in zip(losses, weights, strict=True) if w != 0 and loss.requires_grad]
    if not kept or not torch.is_grad_enabled():
        return x
    return _AttachLosses.apply(x, tuple(w for _, w in kept), *(loss for loss, _ in kept))
