"""``MoELoadMetric``: the expert load and router statistics of a model's MoE layers summed on the
device over a window, and reduced across ranks with one all-reduce (``MoEMonitor``'s state).

Legend: L MoE layers, E experts per layer, K experts per token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

#: Statistics logged per layer (``<prefix>/layer_<i>/<name>``) and for the model (``<prefix>/<name>``).
STAT_NAMES = (
    "load_imbalance",
    "load_cv",
    "dead_experts",
    "router_entropy",
    "selection_gap",
    "tokens_dropped_frac",
    "aux_loss",
    "z_loss",
)


def _all_reduce_sum(tensor: Tensor, group: Any = None) -> list[Tensor]:
    """A torchmetrics ``dist_sync_fn``: one all-reduce, instead of all-gathers of sizes and values."""
    reduced = tensor.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return [reduced]


class MoELoadMetric(Metric):
    """Expert load and router statistics of ``L`` MoE layers with ``E`` experts each, over a window.

    The whole state is one float64 vector ``stats`` with sum reduction, laid out as
    ``[tokens_LE (L*E) | entropy x tokens (L) | gap x tokens (L) | dropped (L) | aux (L) | z (L) |
    batches (1)]``, so ``compute()`` syncs the ranks with one all-reduce (counts exact up to 2**53).

    ``compute()`` returns ``{"layers": {name: [L]}, "model": {name: 0-dim}, "tokens_per_expert": [L, E],
    "moe_tokens": 0-dim}`` with ``name`` in ``STAT_NAMES``, over all ranks and batches since the last
    ``reset()``:

    - ``load_imbalance``: max over experts / mean over experts of the token counts (1 = even);
    - ``load_cv``: population standard deviation / mean of the token counts;
    - ``dead_experts``: experts that received no token;
    - ``router_entropy``: mean over tokens of the router's entropy in nats (``log E`` at most);
    - ``selection_gap``: under ``"sinkhorn"``, the fraction of tokens whose training choice of experts
      differs from the plain top-k that inference picks (0 in the other modes);
    - ``tokens_dropped_frac``: dropped (token, expert) assignments / routed assignments;
    - ``aux_loss``, ``z_loss``: mean over batches and ranks (unweighted).

    A layer without tokens gets 0 for the first six. Model values: the mean over layers of imbalance,
    CV, entropy and gap; the sum of dead experts and losses; dropped / routed over all layers.
    ``moe_tokens``: token passes through MoE layers. ``kwargs``: torchmetrics ``Metric`` options.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None
    stats: Tensor

    def __init__(self, num_layers: int, num_experts: int, top_k: int, **kwargs: Any) -> None:
        kwargs.setdefault("dist_sync_fn", _all_reduce_sum)
        super().__init__(**kwargs)
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoELoadMetric({name}={value!r}): pass an int >= 1.")
        if top_k > num_experts:
            raise ValueError(f"MoELoadMetric(top_k={top_k}): must not exceed num_experts={num_experts}.")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        size = num_layers * num_experts + 5 * num_layers + 1
        self.add_state("stats", torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        tokens_per_expert_LE: Tensor,
        router_entropy_L: Tensor,
        aux_loss_L: Tensor,
        z_loss_L: Tensor,
        tokens_dropped_L: Tensor | None = None,
        selection_gap_L: Tensor | None = None,
    ) -> None:
        """Add one batch of this rank: token counts ``[L, E]``, mean router entropy over its tokens,
        aux and z losses and (optionally) dropped assignments and the selection gap, each ``[L]``.
        No host sync."""
        L, E = self.num_layers, self.num_experts
        if tuple(tokens_per_expert_LE.shape) != (L, E):
            raise ValueError(
                f"MoELoadMetric.update: tokens_per_expert_LE has shape {tuple(tokens_per_expert_LE.shape)}, "
                f"expected ({L}, {E}); build the metric with the model's layer and expert counts."
            )
        device, dtype = self.stats.device, self.stats.dtype
        tokens_LE = tokens_per_expert_LE.to(device, dtype)
        num_tokens_L = tokens_LE.sum(dim=1) / self.top_k

        def per_layer(values_L: Tensor | None) -> Tensor:
            return tokens_LE.new_zeros(L) if values_L is None else values_L.to(device, dtype).reshape(L)

        parts = [
            tokens_LE.reshape(-1),
            per_layer(router_entropy_L) * num_tokens_L,
            per_layer(selection_gap_L) * num_tokens_L,
            per_layer(tokens_dropped_L),
            per_layer(aux_loss_L),
            per_layer(z_loss_L),
            tokens_LE.new_ones(1),
        ]
        self.stats += torch.cat(parts)

    def compute(self) -> dict[str, Any]:
        """The window's statistics over all ranks (see the class docstring)."""
        L, E = self.num_layers, self.num_experts
        tokens_LE = self.stats[: L * E].view(L, E)
        entropy_x_tokens_L, gap_x_tokens_L, dropped_L, aux_sum_L, z_sum_L = self.stats[L * E : L * E + 5 * L].view(5, L)
        batches = self.stats[-1].clamp_min(1.0)
        routed_L = tokens_LE.sum(dim=1)
        has_tokens_L = routed_L > 0
        safe_routed_L = torch.where(has_tokens_L, routed_L, torch.ones_like(routed_L))
        mean_L = safe_routed_L / E
        zero_L = torch.zeros_like(routed_L)
        layers = {
            "load_imbalance": torch.where(has_tokens_L, tokens_LE.amax(dim=1) / mean_L, zero_L),
            "load_cv": torch.where(has_tokens_L, tokens_LE.std(dim=1, correction=0) / mean_L, zero_L),
            "dead_experts": (tokens_LE == 0).sum(dim=1).to(tokens_LE.dtype),
            "router_entropy": torch.where(has_tokens_L, entropy_x_tokens_L / (safe_routed_L / self.top_k), zero_L),
            "selection_gap": torch.where(has_tokens_L, gap_x_tokens_L / (safe_routed_L / self.top_k), zero_L),
            "tokens_dropped_frac": torch.where(has_tokens_L, dropped_L / safe_routed_L, zero_L),
            "aux_loss": aux_sum_L / batches,
            "z_loss": z_sum_L / batches,
        }
        routed = routed_L.sum()
        sums = ("dead_experts", "aux_loss", "z_loss")
        model = {name: values.sum() if name in sums else values.mean() for name, values in layers.items()}
        model["tokens_dropped_frac"] = torch.where(routed > 0, dropped_L.sum() / routed.clamp_min(1.0), routed * 0)
        return {"layers": layers, "model": model, "tokens_per_expert": tokens_LE, "moe_tokens": routed / self.top_k}
