"""Top-k router: logits -> expert ids and combine weights, with the four balancing modes.

Legend: T tokens, H hidden size, E experts, K experts per token.

Balancing modes (``MoEConfig.moe_load_balancing``):

- ``"none"`` / ``"aux_loss"``: softmax over the experts, top-k, top-k weights renormalised to sum
  to one: exactly Mixtral's ``MixtralTopKRouter``. ``"aux_loss"`` additionally yields the
  load-balancing loss (the layer attaches it to the gradients).
- ``"sinkhorn"``: in training, experts are chosen by top-k of the Sinkhorn-normalised scores (a
  fixed number of iterations towards a token x expert matrix whose rows sum to 1 and whose
  columns sum to ``T / E``), which spreads tokens evenly without any loss term; the combine
  weights still come from the softmax of the raw logits. In eval it routes like ``"none"``.
- ``"balanced"``: auxiliary-loss-free balancing (DeepSeek-V3). A per-expert bias ``b`` is added to
  the probabilities for *selection only*; combine weights come from the unbiased softmax. The
  layer counts the tokens each expert received during training forwards (not during activation
  recomputation, so checkpointing and gradient accumulation do not double count), and
  ``update_bias`` moves ``b_e`` by ``rate * sign(mean_load - load_e)`` once per optimizer step.
  The bias is used in training and in eval: it is part of the trained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ep.moe.config import LoadBalancing


@dataclass
class Routing:
    """What the router decided for a batch of tokens.

    Attributes:
        logits_TE: raw router logits in the router dtype (fp32 or fp64).
        probs_TE: softmax of ``logits_TE``.
        expert_ids_TK: chosen global expert ids, int64.
        weights_TK: combine weights in the router dtype.
    """

    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor


def sinkhorn_log(logits_TE: torch.Tensor, iterations: int) -> torch.Tensor:
    """Log of the Sinkhorn-balanced version of ``softmax``-like scores ``exp(logits)``.

    Alternately rescales rows to sum to 1 and columns to sum to ``T / E``, in the log domain so
    large logits cannot overflow. A fixed iteration count keeps it free of host syncs.

    Args:
        logits_TE: float ``[T, E]``.
        iterations: number of row + column rescalings.
    Returns:
        ``[T, E]`` log-scores; ``exp`` of it has column sums ``T / E`` exactly and row sums ~1.
    """
    num_tokens, num_experts = logits_TE.shape
    log_col_target = math.log(num_tokens / num_experts)
    log_u_T = torch.zeros(num_tokens, dtype=logits_TE.dtype, device=logits_TE.device)
    log_v_E = torch.zeros(num_experts, dtype=logits_TE.dtype, device=logits_TE.device)
    for _ in range(iterations):
        log_u_T = -torch.logsumexp(logits_TE + log_v_E[None, :], dim=1)
        log_v_E = log_col_target - torch.logsumexp(logits_TE + log_u_T[:, None], dim=0)
    return logits_TE + log_u_T[:, None] + log_v_E[None, :]


class TopKRouter(nn.Module):
    """Linear gate + top-k selection. Owns the gate ``weight [E, H]`` (and ``expert_bias [E]`` in
    ``"balanced"`` mode); the parameter is adopted from the Hugging Face router so state-dict keys
    and values are unchanged.

    Args:
        weight: the gate weight ``[E, H]``; the very same ``Parameter`` is kept.
        top_k: experts per token ``K``.
        mode: balancing mode.
        normalize_weights: renormalise the top-k weights to sum to one (Mixtral always does).
        router_dtype: fp32 or fp64; logits, softmax and Sinkhorn run in it.
        sinkhorn_iterations: iterations of ``sinkhorn_log``.
    """

    expert_bias: torch.Tensor
    pending_load: torch.Tensor

    def __init__(
        self,
        weight: nn.Parameter,
        *,
        top_k: int,
        mode: LoadBalancing,
        normalize_weights: bool = True,
        router_dtype: torch.dtype = torch.float32,
        sinkhorn_iterations: int = 30,
    ) -> None:
        super().__init__()
        num_experts = weight.shape[0]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts}).")
        self.weight = weight
        self.top_k = top_k
        self.num_experts = num_experts
        self.mode = mode
        self.normalize_weights = normalize_weights
        self.router_dtype = router_dtype
        self.sinkhorn_iterations = sinkhorn_iterations
        if mode == "balanced":
            # Persistent: the bias is trained state and must survive checkpoints.
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=weight.device))
            # Not persistent: tokens counted since the last ``update_bias``.
            self.register_buffer(
                "pending_load",
                torch.zeros(num_experts, dtype=torch.float32, device=weight.device),
                persistent=False,
            )

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Module.to(dtype) (e.g. Lightning's "bf16-true") must not round the balancing state:
        # token counts and bias steps of 1e-3 need fp32. Devices still follow the module.
        if self.mode != "balanced":
            return super()._apply(fn, recurse)
        bias, load = self.expert_bias, self.pending_load
        super()._apply(fn, recurse)
        if bias.is_meta:  # to_empty(): nothing to keep; fp32 storage on the new device
            self.expert_bias = torch.empty_like(bias, device=self.expert_bias.device)
            self.pending_load = torch.empty_like(load, device=self.pending_load.device)
        else:
            self.expert_bias = bias.to(device=self.expert_bias.device)
            self.pending_load = load.to(device=self.pending_load.device)
        return self

    def forward(self, x_TH: torch.Tensor) -> Routing:
        """Route ``x_TH`` (any float dtype); everything inside runs in the router dtype."""
        logits_TE = F.linear(x_TH.to(self.router_dtype), self.weight.to(self.router_dtype))
        probs_TE = torch.softmax(logits_TE, dim=-1)
        if self.mode == "sinkhorn" and self.training:
            with torch.no_grad():
                selection_TE = sinkhorn_log(logits_TE.detach(), self.sinkhorn_iterations)
            expert_ids_TK = torch.topk(selection_TE, self.top_k, dim=-1).indices
            weights_TK = probs_TE.gather(1, expert_ids_TK)
        elif self.mode == "balanced":
            with torch.no_grad():
                selection_TE = probs_TE.detach() + self.expert_bias.to(probs_TE.dtype)
            expert_ids_TK = torch.topk(selection_TE, self.top_k, dim=-1).indices
            weights_TK = probs_TE.gather(1, expert_ids_TK)
        else:
            weights_TK, expert_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.normalize_weights:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return Routing(logits_TE, probs_TE, expert_ids_TK, weights_TK)

    @torch.no_grad()
    def record_load(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Add a training forward's token counts to the pending load of the ``"balanced"`` bias."""
        if self.mode == "balanced":
            self.pending_load += tokens_per_expert_E.to(self.pending_load.dtype)

    @torch.no_grad()
    def update_bias(self, rate: float, load_E: torch.Tensor | None = None) -> None:
        """Move the ``"balanced"`` bias towards equal load and clear the pending counts.

        Args:
            rate: step size; each bias moves by ``+rate`` (under-loaded) or ``-rate`` (over-loaded).
            load_E: counts to use instead of the pending load (e.g. summed over ranks by the caller).
        """
        if self.mode != "balanced":
            return
        load = self.pending_load if load_E is None else load_E.to(self.pending_load)
        if load.sum() > 0:
            self.expert_bias += rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, mode={self.mode!r}, dtype={self.router_dtype}"
