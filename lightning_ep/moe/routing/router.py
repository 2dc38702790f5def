"""Top-k router: logits -> expert ids and combine weights, with the four balancing modes.

Legend: T tokens, H hidden size, E experts, K experts per token, G expert groups.

Scoring (fixed by the model family, see ``lightning_ep.models``):

- ``"softmax"`` (Mixtral, Qwen-MoE, OLMoE): scores are the softmax over the experts; the combine
  weights are the chosen scores, renormalised to sum to one if ``normalize_weights``.
- ``"sigmoid"`` (DeepSeek-V3, GLM-4-MoE): scores are ``sigmoid(logits)``; selection may add an
  ``e_score_correction_bias`` and be group-limited (``group_limited``); the weights are the unbiased
  chosen scores, renormalised if ``normalize_weights``, times ``scaling_factor``.
- ``"topk_softmax"`` (GPT-OSS): top-k of the logits (which may carry a ``bias``), then the softmax
  over the ``K`` chosen logits.

Balancing modes (``MoEConfig.moe_load_balancing``):

- ``"none"`` / ``"aux_loss"``: top-k of the scores, exactly the Hugging Face router; ``"aux_loss"``
  also yields the load-balancing loss.
- ``"sinkhorn"``: in training, top-k of the Sinkhorn-normalised logits (``sinkhorn_log``, no
  correction bias), which spreads tokens evenly without any loss term; the combine weights still come
  from the raw scores. In eval it routes like ``"none"``.
- ``"balanced"`` (DeepSeek-V3's auxiliary-loss-free balancing): a per-expert bias ``b`` is added to
  the scores for selection only, the model's own ``e_score_correction_bias`` where it has one, else
  this library's ``expert_bias`` buffer. The layer counts the tokens each expert received in training
  forwards (not in activation recomputation: nothing counted twice), and ``update_bias`` moves ``b_e``
  by ``rate * sign(mean_load - load_e)`` once per optimizer step; the bias is part of the trained
  model. In the other modes a model's own correction bias selects as the model does, never updated.

A router is frozen (``TopKRouter.frozen``) when none of its parameters requires grad
(``lightning_ep.freeze_routers``, or a PEFT model whose routers are not trained): routing is
unchanged, and its layer reports the losses but attaches none to the gradients (they would push the
hidden states towards a balance the router cannot learn); its ``"balanced"`` bias counts no load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ep.moe.config import LoadBalancing
from lightning_ep.moe.kernels.sinkhorn import fused_sinkhorn_available, sinkhorn_log_fused

Scoring = Literal["softmax", "sigmoid", "topk_softmax"]
SCORINGS: tuple[str, ...] = get_args(Scoring)


@dataclass
class Routing:
    """What the router decided for a batch of tokens.

    Attributes:
        logits_TE: raw router logits in the router dtype (fp32 or fp64), router bias included.
        probs_TE: what the load-balancing loss and the router entropy read: the softmax of ``logits_TE``,
            or for ``"sigmoid"`` the scores over their sum (as DeepSeek-V3's sequence-wise balance loss).
        expert_ids_TK: chosen global expert ids, int64; ``weights_TK``: combine weights, router dtype.
        differs_T: under ``"sinkhorn"`` in training, bool ``[T]``: whether the token's chosen set of
            experts differs from the plain top-k that evaluation and inference pick; ``None`` otherwise.
    """

    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    differs_T: torch.Tensor | None = None


def sinkhorn_log(logits_TE: torch.Tensor, iterations: int, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Log of the Sinkhorn-balanced version of ``softmax``-like scores ``exp(logits)``: float ``[T, E]``
    -> ``[T, E]`` log-scores, whose real rows' ``exp`` has column sums ``N / E`` exactly and row sums ~1.

    Rescales rows to sum to 1 and columns to sum to ``T / E``, ``iterations`` times each, in the log
    domain (large logits cannot overflow); a fixed count, so no host sync. On CUDA in fp32 it is one
    Triton kernel launch (``lightning_ep.moe.kernels.sinkhorn``), padded or not. ``valid_T``: bool
    ``[T]``, ``False`` at padded positions, whose rows take no part in the column sums (which then
    target ``N / E``, ``N`` the real tokens) and whose log-scores are ``-inf``; ``None``: all real.
    """
    num_tokens, num_experts = logits_TE.shape
    if num_tokens == 0:
        return logits_TE
    if fused_sinkhorn_available(logits_TE):
        return sinkhorn_log_fused(logits_TE, iterations, valid_T)  # one launch on CUDA
    if valid_T is None:
        log_col_target: torch.Tensor | float = math.log(num_tokens / num_experts)
    else:
        log_col_target = torch.log(valid_T.sum().clamp_min(1).to(logits_TE.dtype) / num_experts)
    log_u_T = torch.zeros(num_tokens, dtype=logits_TE.dtype, device=logits_TE.device)
    log_v_E = torch.zeros(num_experts, dtype=logits_TE.dtype, device=logits_TE.device)
    for _ in range(iterations):
        log_u_T = -torch.logsumexp(logits_TE + log_v_E[None, :], dim=1)
        if valid_T is not None:  # a padded row weighs nothing in the column sums
            log_u_T = log_u_T.masked_fill(~valid_T, float("-inf"))
        log_v_E = log_col_target - torch.logsumexp(logits_TE + log_u_T[:, None], dim=0)
    return logits_TE + log_u_T[:, None] + log_v_E[None, :]


def group_limited(selection_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``[T, E]`` selection scores -> ``[T, E]``, ``-inf`` outside the ``topk_group`` best of ``n_group`` equal
    groups, each scored by the sum of its two best scores (its best for groups of one expert), as in
    DeepSeek-V3's ``noaux_tc`` routing."""
    num_tokens, num_experts = selection_TE.shape
    grouped_TGX = selection_TE.view(num_tokens, n_group, num_experts // n_group)
    group_scores_TG = grouped_TGX.topk(min(2, grouped_TGX.shape[-1]), dim=-1).values.sum(dim=-1)
    kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    kept_TG.scatter_(1, group_scores_TG.topk(topk_group, dim=-1).indices, True)
    return grouped_TGX.masked_fill(~kept_TG[:, :, None], float("-inf")).view(num_tokens, num_experts)


class TopKRouter(nn.Module):
    """Linear gate + top-k selection. Owns the gate ``weight [E, H]``, the optional logit ``bias [E]``
    (GPT-OSS) and the selection-only buffer ``e_score_correction_bias [E]`` (DeepSeek-V3): the very
    tensors of the Hugging Face router, so that state-dict keys and values are unchanged; and in
    ``"balanced"`` mode without a correction bias, this library's ``expert_bias [E]`` buffer.

    Args:
        normalize_weights: renormalise the top-k weights to sum to one (``"topk_softmax"``'s do).
        router_dtype: fp32 or fp64; logits, scores and Sinkhorn run in it.
        n_group, topk_group: selection keeps ``topk_group`` of ``n_group`` expert groups (``n_group=1``: all).
        scaling_factor: multiplies the combine weights (DeepSeek's ``routed_scaling_factor``).
    """

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
        scoring: Scoring = "softmax",
        bias: nn.Parameter | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        n_group: int = 1,
        topk_group: int = 1,
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        num_experts = weight.shape[0]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts}).")
        if scoring not in SCORINGS:
            raise ValueError(f"TopKRouter(scoring={scoring!r}) is not one of {list(SCORINGS)}.")
        for name, vector in (("bias", bias), ("e_score_correction_bias", e_score_correction_bias)):
            if vector is not None and tuple(vector.shape) != (num_experts,):
                raise ValueError(
                    f"TopKRouter({name}=...) has shape {list(vector.shape)}; it needs one value per expert: "
                    f"[{num_experts}]."
                )
        if n_group < 1 or num_experts % n_group:
            valid = [g for g in range(1, num_experts + 1) if num_experts % g == 0]
            raise ValueError(
                f"TopKRouter(n_group={n_group}) must divide the number of experts ({num_experts}); "
                f"choose one of {valid}."
            )
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"TopKRouter(topk_group={topk_group}) must be between 1 and n_group={n_group}.")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(
                f"TopKRouter(top_k={top_k}) exceeds the {topk_group * (num_experts // n_group)} experts of the "
                f"topk_group={topk_group} groups kept (of {num_experts // n_group} experts each); raise topk_group."
            )
        self.weight = weight
        self.bias = bias
        self.top_k = top_k
        self.num_experts = num_experts
        self.mode = mode
        self.normalize_weights = normalize_weights
        self.router_dtype = router_dtype
        self.sinkhorn_iterations = sinkhorn_iterations
        self.scoring = scoring
        self.n_group = n_group
        self.topk_group = topk_group
        self.scaling_factor = float(scaling_factor)
        self.bias_name: str | None = None  # the selection-only bias buffer's, if any (``selection_bias``)
        zeros_E = torch.zeros(num_experts, dtype=torch.float32, device=weight.device)
        if e_score_correction_bias is not None:
            self.register_buffer("e_score_correction_bias", e_score_correction_bias)
            self.bias_name = "e_score_correction_bias"
        elif mode == "balanced":
            self.register_buffer("expert_bias", zeros_E.clone())  # persistent: trained state, kept in checkpoints
            self.bias_name = "expert_bias"
        if mode == "balanced":
            self.register_buffer("pending_load", zeros_E, persistent=False)  # tokens since the last update_bias

    @property
    def frozen(self) -> bool:
        """Whether no parameter of the router (``weight``, ``bias``) requires grad."""
        return not any(p.requires_grad for p in self.parameters())

    @property
    def selection_bias(self) -> torch.Tensor | None:
        """The selection-only bias ``[E]``: ``e_score_correction_bias``, ``expert_bias`` or ``None``."""
        return None if self.bias_name is None else getattr(self, self.bias_name)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Module.to(dtype) (e.g. Lightning's "bf16-true") must not round the balancing state:
        # token counts and bias steps of 1e-3 need fp32. Devices still follow the module.
        if self.mode != "balanced" or self.bias_name is None:
            return super()._apply(fn, recurse)
        name = self.bias_name
        bias, load = getattr(self, name), self.pending_load
        super()._apply(fn, recurse)
        # After to_empty() there is nothing to keep: fp32 storage on the new device.
        move: Callable[..., torch.Tensor] = torch.empty_like if bias.is_meta else torch.Tensor.to
        setattr(self, name, move(bias, dtype=torch.float32, device=getattr(self, name).device))
        self.pending_load = move(load, device=self.pending_load.device)
        return self

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        """Route ``x_TH`` (any float dtype) in the router dtype, under autocast too. ``valid_T`` (bool
        ``[T]``, ``False`` at padded positions) keeps padded rows out of the Sinkhorn normalisation;
        their choices are whatever their scores give (the caller drops them)."""
        dtype = self.router_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        # Autocast (Lightning's "bf16-mixed") would run this product in bf16 whatever the inputs.
        with torch.autocast(x_TH.device.type, enabled=False):
            logits_TE = F.linear(x_TH.to(dtype), self.weight.to(dtype), bias)
        # scores_TE: what selection ranks and the combine weights are taken from.
        if self.scoring == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        else:
            probs_TE = torch.softmax(logits_TE, dim=-1)
            scores_TE = logits_TE if self.scoring == "topk_softmax" else probs_TE
        differs_T = None
        with torch.no_grad():
            expert_ids_TK = torch.topk(self._selection(logits_TE, scores_TE, valid_T), self.top_k, dim=-1).indices
            if self.mode == "sinkhorn" and self.training:  # what inference would pick instead
                plain_TK = torch.topk(self._plain_selection(scores_TE), self.top_k, dim=-1).indices
                differs_T = (expert_ids_TK.sort(dim=-1).values != plain_TK.sort(dim=-1).values).any(dim=-1)
        weights_TK = scores_TE.gather(1, expert_ids_TK)
        if self.scoring == "topk_softmax":
            weights_TK = torch.softmax(weights_TK, dim=-1)
        elif self.normalize_weights:
            # The floor only guards all-underflowed sigmoid scores; it never binds for softmax.
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if self.scaling_factor != 1.0:
            weights_TK = weights_TK * self.scaling_factor
        return Routing(logits_TE, probs_TE, expert_ids_TK, weights_TK, differs_T)

    def _selection(
        self, logits_TE: torch.Tensor, scores_TE: torch.Tensor, valid_T: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[T, E]`` scores whose top-k are the chosen experts (no gradient flows through them)."""
        if self.mode == "sinkhorn" and self.training:
            selection_TE = sinkhorn_log(logits_TE.detach(), self.sinkhorn_iterations, valid_T)
            if valid_T is not None:  # padded rows are -inf throughout; any finite choice will do
                selection_TE = selection_TE.masked_fill(~valid_T[:, None], 0.0)
            if self.n_group > 1:  # groups are scored by sums of scores, not of log-scores
                selection_TE = group_limited(selection_TE.exp(), self.n_group, self.topk_group)
            return selection_TE
        return self._plain_selection(scores_TE)

    def _plain_selection(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """The selection scores of every mode but training ``"sinkhorn"``: scores + selection bias, group-limited."""
        selection_TE = scores_TE.detach()
        bias = self.selection_bias
        if bias is not None:
            selection_TE = selection_TE + bias.to(selection_TE.dtype)
        if self.n_group > 1:
            selection_TE = group_limited(selection_TE, self.n_group, self.topk_group)
        return selection_TE

    @torch.no_grad()
    def record_load(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Add a training forward's token counts to the pending load of the ``"balanced"`` bias."""
        if self.mode == "balanced":
            self.pending_load += tokens_per_expert_E.to(self.pending_load.dtype)

    @torch.no_grad()
    def update_bias(self, rate: float, load_E: torch.Tensor | None = None) -> None:
        """Move each ``"balanced"`` bias by ``+rate`` (under-loaded) or ``-rate`` (over-loaded) and clear
        the pending counts. ``load_E``: counts to use instead of the pending load (e.g. summed over ranks)."""
        bias = self.selection_bias
        if self.mode != "balanced" or bias is None:
            return
        load = self.pending_load if load_E is None else load_E.to(self.pending_load)
        if load.sum() > 0:
            bias += rate * torch.sign(load.mean() - load).to(bias.dtype)
        self.pending_load.zero_()

    def extra_repr(self) -> str:
        extra = f", scoring={self.scoring!r}" if self.scoring != "softmax" else ""
        if self.n_group > 1:
            extra += f", n_group={self.n_group}, topk_group={self.topk_group}"
        if self.scaling_factor != 1.0:
            extra += f", scaling_factor={self.scaling_factor}"
        return f"experts={self.num_experts}, top_k={self.top_k}, mode={self.mode!r}, dtype={self.router_dtype}{extra}"
