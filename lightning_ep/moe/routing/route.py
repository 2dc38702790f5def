"""One MoE layer's routing with everything kept of it (``RouterStats``), in one pure function
(``route``) that ``MoELayer.compile_routing`` compiles whole; and ``RouterLogits``, the tap through
which Hugging Face's ``output_router_logits`` records the logits.

Legend: T tokens, H hidden size, E experts, K experts per token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_ep.moe.routing.losses import load_balancing_loss, z_loss
from lightning_ep.moe.routing.router import TopKRouter


class RouterStats(NamedTuple):
    """What the layer keeps of one routing: the load-balancing and z-losses (0-dim, with grad), the
    router entropy (0-dim, detached), when checked whether every router logit is finite, the selection
    gap (``selection_gap``) and the router logits ``[T, E]`` (with grad; ``MoELayer.router_logits``)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor
    logits_finite: torch.Tensor | None
    selection_gap: torch.Tensor
    logits_TE: torch.Tensor


class RouterLogits(nn.Module):
    """The identity on a layer's ``[T, E]`` router logits (one row per position of the layer's input,
    zeros at padded positions, the shuffle undone), held outside the layer's children and called only
    while it has forward hooks: Hugging Face's ``output_router_logits`` records with one (``hf_compat``)."""

    def __init__(self) -> None:
        super().__init__()
        #: Whether the hooks want this call's logits (``None``: always); set with the hooks.
        self.wanted: Any = None

    def forward(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE

    def active(self) -> bool:
        """Whether a call would be recorded: hooks are installed and they want it."""
        return bool(self._forward_hooks) and (self.wanted is None or self.wanted())


def route(
    gate: TopKRouter,
    x_TH: torch.Tensor,
    check_finite: bool,
    valid_T: torch.Tensor | None = None,
    z_weight_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
    """Route ``x_TH``: ``expert_ids_TK`` (int64), ``weights_TK`` (router dtype) and the ``RouterStats``.

    ``valid_T`` (bool, ``False`` at padded tokens, whose rows are zero): padded tokens take no part
    in the losses, the entropy and Sinkhorn, get combine weight 0, and are spread over the experts
    (token ``t``'s ``k``-th choice is expert ``(t * K + k) % E``, whatever its content), so that
    their content changes nothing and they load no expert more than another. ``z_weight_T``: each
    token's weight in the z-loss (see ``losses.z_loss``).
    """
    routing = gate(x_TH, valid_T)
    probs_TE, expert_ids_TK, weights_TK = routing.probs_TE, routing.expert_ids_TK, routing.weights_TK
    if valid_T is not None:
        num_tokens, top_k = expert_ids_TK.shape
        spread_TK = torch.arange(num_tokens * top_k, device=x_TH.device).view(num_tokens, top_k) % gate.num_experts
        expert_ids_TK = torch.where(valid_T[:, None], expert_ids_TK, spread_TK)
        weights_TK = torch.where(valid_T[:, None], weights_TK, 0.0)
    aux = load_balancing_loss(probs_TE, expert_ids_TK, valid_T)
    zl = z_loss(routing.logits_TE, valid_T, z_weight_T)
    entropy = mean_entropy(probs_TE.detach(), valid_T)
    finite = all_finite(routing.logits_TE) if check_finite else None
    gap = selection_gap(routing.differs_T, valid_T, routing.logits_TE)
    return expert_ids_TK, weights_TK, RouterStats(aux, zl, entropy, finite, gap, routing.logits_TE)


def selection_gap(differs_T: torch.Tensor | None, valid_T: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """0-dim fp32, detached: the fraction of real tokens whose training ``"sinkhorn"`` choice differs
    from the plain top-k that inference picks (0 without ``differs_T``, and for a rank without tokens)."""
    if differs_T is None:
        return torch.zeros((), dtype=torch.float32, device=like.device)
    if valid_T is not None:
        return (differs_T & valid_T).sum().float() / valid_T.sum().clamp_min(1).float()
    return differs_T.sum().float() / max(differs_T.shape[0], 1)


def mean_entropy(probs_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim mean over (real, ``valid_T``) tokens of the entropy (nats) of each row of ``probs_TE``."""
    # entr(p) = -p log p with entr(0) = 0, and no NaN for a rank without tokens.
    entropy_T = torch.special.entr(probs_TE).sum(dim=-1)
    if valid_T is None:
        return entropy_T.sum() / max(probs_TE.shape[0], 1)
    return torch.where(valid_T, entropy_T, 0.0).sum() / valid_T.sum().clamp_min(1)


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool: no NaN or infinity in ``x``."""
    return torch.isfinite(x.detach()).all()
