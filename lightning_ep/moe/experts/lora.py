"""LoRA on the routed experts' stacked weights: low-rank factors stacked over experts, sharded with them.

Legend: N routed rows (sorted by expert), H hidden size, I expert width, F = 2I, E experts, L experts
held here (``E / degree`` under expert parallelism), r the adapter's rank.

For an expert weight ``W [E, out, in]`` (``gate_up_proj [E, F, H]``, ``down_proj [E, H, I]``) the
adapter holds ``A [E, r, in]`` and ``B [E, out, r]``. PEFT's ``ParamWrapper`` folds the weight
``W[e] + scaling * B[e] @ A[e]`` (``lightning_ep.models.peft_lora`` converts its layout); here the
low-rank term is added to each GEMM's output, ``x @ W[e].T + scaling * (x @ A[e].T) @ B[e].T``: equal
in exact arithmetic, without a full-size weight gradient for the frozen ``W``. Expert parallelism
shards ``A`` and ``B`` with ``W`` on dim 0, and their gradients take the experts' ``grad_scale``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ep.moe.experts.grouped import GROUPED_MM, GroupedExperts, grouped_mm_supported, with_grad_scale
from lightning_ep.moe.experts.segments import segment_linear
from lightning_ep.moe.kernels.swiglu import swiglu

#: The expert weights an adapter may sit on, in the order the MLP multiplies by them.
ADAPTABLE = ("gate_up_proj", "down_proj")


def lora_names(weight: str) -> tuple[str, str]:
    """The parameter names of the factors ``A`` and ``B`` of ``weight`` on ``LoRAGroupedExperts``."""
    return f"{weight}_lora_A", f"{weight}_lora_B"


@dataclass(frozen=True)
class ExpertLoRA:
    """The adapter of one expert weight ``[E, out, in]``: ``A [E, r, in]``, ``B [E, out, r]`` and the
    factor of ``B @ A`` (PEFT's ``scaling``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA)."""

    A: nn.Parameter
    B: nn.Parameter
    scaling: float


class LoRAGroupedExperts(GroupedExperts):
    """``GroupedExperts`` with LoRA adapters on ``gate_up_proj``, ``down_proj`` or both.

    Owns the frozen (or not) base weights, the very ``Parameter`` objects of the module it replaces,
    and for each adapted weight ``w`` the factors ``{w}_lora_A [E, r, in]`` and ``{w}_lora_B
    [E, out, r]`` (``lora_names``). Arguments as ``GroupedExperts``'s, plus ``adapters``:
    ``{"gate_up_proj" and/or "down_proj": ExpertLoRA}``. ``grouped_mm`` also needs the factors' rows
    16-byte aligned (a rank that is a multiple of 8 in bf16), else ``None`` falls back to the loop.

    Both paths give every factor a gradient (zero for an expert that got no row) multiplied by
    ``grad_scale``; the base weights get one only if they require it (full fine-tuning beside LoRA).
    """

    #: The adapters' GEMMs take the weights cast by ``run`` (``compute_weights``).
    casts_in_gemms = False

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        adapters: Mapping[str, ExpertLoRA],
        *,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__(gate_up_proj, down_proj, act_fn, use_grouped_mm=use_grouped_mm)
        if not adapters or not set(adapters) <= set(ADAPTABLE):
            raise ValueError(
                f"LoRAGroupedExperts(adapters=...) takes adapters on {list(ADAPTABLE)}, got {sorted(adapters)}."
            )
        #: ``{weight name: scaling}`` of the adapted weights, in ``ADAPTABLE`` order.
        self.lora_scaling: dict[str, float] = {}
        for weight in [w for w in ADAPTABLE if w in adapters]:
            adapter = adapters[weight]
            num_experts, out_features, in_features = getattr(self, weight).shape
            rank = adapter.A.shape[1] if adapter.A.ndim == 3 else -1
            shape_A, shape_B = tuple(adapter.A.shape), tuple(adapter.B.shape)
            if shape_A != (num_experts, rank, in_features) or shape_B != (num_experts, out_features, rank):
                raise ValueError(
                    f"the LoRA factors of {weight} {(num_experts, out_features, in_features)} must be A [E, r, in] "
                    f"and B [E, out, r], got A {shape_A} and B {shape_B}."
                )
            for name, factor in zip(lora_names(weight), (adapter.A, adapter.B), strict=True):
                setattr(self, name, factor)
            self.lora_scaling[weight] = float(adapter.scaling)

    @property
    def lora_rank(self) -> dict[str, int]:
        """``{weight name: r}`` of the adapted weights."""
        return {w: getattr(self, lora_names(w)[0]).shape[1] for w in self.lora_scaling}

    def _params(self) -> list[torch.Tensor]:
        # [W1, W2, then A, B of each adapted weight in ADAPTABLE order]
        factors = [getattr(self, name) for weight in self.lora_scaling for name in lora_names(weight)]
        return [self.gate_up_proj, self.down_proj, *factors]

    def _factors(self, weights: Sequence[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """``{weight name: (A, B, scaling)}`` out of ``weights`` (laid out as ``_params``)."""
        adapted = enumerate(self.lora_scaling.items())
        return {weight: (weights[2 * k + 2], weights[2 * k + 3], scaling) for k, (weight, scaling) in adapted}

    def grouped_mm_runs(self, x_NH: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
        return grouped_mm_supported(x_NH, *weights)

    def _mlp(
        self,
        x_NH: torch.Tensor,
        weights: Sequence[torch.Tensor],
        mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The MLP with its adapters, every product ``x @ w.T`` taken by ``mm(x, w)`` (``weights``: laid
        out as ``_params``; ``rows``: as in ``swiglu``)."""
        factors = self._factors(weights)

        def linear(x: torch.Tensor, name: str, w: torch.Tensor) -> torch.Tensor:
            y = mm(x, w)
            if name in factors:
                A, B, scaling = factors[name]
                y = y + scaling * mm(mm(x, A), B)
            return y

        a_NI = swiglu(linear(x_NH, "gate_up_proj", weights[0]), self.act_fn, rows)
        return linear(a_NI, "down_proj", weights[1])

    def expert(self, x_nH: torch.Tensor, e: int, weights: list[torch.Tensor]) -> torch.Tensor:
        return self._mlp(x_nH, weights, lambda x, w: x @ w[e].t())

    def forward(
        self, x_NH: torch.Tensor, counts_L: torch.Tensor, counts_host: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Run each local expert, with its adapters, on its contiguous block of rows, as
        ``GroupedExperts.forward``."""
        return self.run(x_NH, counts_L, self._params(), (0, 1), self._grouped, self._per_expert, counts_host)

    def _grouped(
        self, x_NH: torch.Tensor, counts_L: torch.Tensor, weights: list[torch.Tensor], grad_scale: float
    ) -> torch.Tensor:
        assert GROUPED_MM is not None
        offsets_L = torch.cumsum(counts_L.to(device=x_NH.device), dim=0).to(torch.int32)

        def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return GROUPED_MM(x, w.transpose(-2, -1), offs=offsets_L)

        return with_grad_scale(lambda x, *w: self._mlp(x, w, mm, offsets_L[-1:]), x_NH, weights, grad_scale)

    def _per_expert(
        self, x_NH: torch.Tensor, counts: list[int], weights: list[torch.Tensor], grad_scale: float
    ) -> torch.Tensor:
        # One GEMM per expert and factor; segment_linear folds grad_scale into the weight gradients.
        return self._mlp(x_NH, weights, lambda x, w: segment_linear(x, w, counts, grad_scale))

    @torch.no_grad()
    def reset_lora_parameters(self, init: bool | str = True) -> None:
        """Initialise the factors as PEFT initialises a fresh adapter: ``B = 0``, and ``A`` per expert
        like an ``nn.Linear(in, r)`` weight (``init=True``: Kaiming-uniform, bound ``1 / sqrt(in)``;
        ``"gaussian"``: normal with std ``1 / r``); ``init=False`` makes ``B`` random too (no-op
        adapters are not wanted). Works on DTensors."""
        for weight in self.lora_scaling:
            A, B = (getattr(self, name) for name in lora_names(weight))
            rank, in_features = A.shape[1], A.shape[2]
            if init == "gaussian":
                nn.init.normal_(A, mean=0.0, std=1.0 / rank)
            elif init is True or init is False:
                nn.init.uniform_(A, -1.0 / math.sqrt(in_features), 1.0 / math.sqrt(in_features))
            else:
                raise ValueError(
                    f"LoRAGroupedExperts.reset_lora_parameters(init={init!r}): only True, False and 'gaussian' can "
                    "initialise expert adapters built on the meta device; build the model with real weights for "
                    "an initialisation that reads them."
                )
            if init is False:
                nn.init.uniform_(B, -1.0 / math.sqrt(rank), 1.0 / math.sqrt(rank))
            else:
                nn.init.zeros_(B)

    def extra_repr(self) -> str:
        ranks = ", ".join(f"{w}: r={r} scaling={self.lora_scaling[w]:g}" for w, r in self.lora_rank.items())
        return f"experts={self.num_experts}, lora=({ranks})"


__all__ = ["ADAPTABLE", "ExpertLoRA", "LoRAGroupedExperts", "lora_names"]
