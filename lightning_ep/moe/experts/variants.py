"""Routed experts in layouts other than ``GroupedExperts``'s: GPT-OSS's clamped SwiGLU with biases.

Legend: N routed rows (sorted by expert), H hidden size, I expert width, F = 2I, L experts held here
(all experts on one process, ``E / degree`` under expert parallelism).

GPT-OSS stores its experts transposed with respect to the default layout and interleaves gate and
up columns: ``gate_up_proj [E, H, 2I]`` (column ``2j`` is gate unit ``j``, column ``2j + 1`` up unit
``j``), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``. Expert
``e`` computes, for a row ``x``::

    h = x @ gate_up_proj[e] + gate_up_proj_bias[e]
    gate, up = min(h[0::2], limit), clamp(h[1::2], -limit, limit)
    y = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_ep.moe.dispatch.rows import block_of_rows
from lightning_ep.moe.experts.grad_scale import with_grad_scale
from lightning_ep.moe.experts.grouped import GROUPED_MM, RoutedExperts


class InterleavedGLUExperts(RoutedExperts):
    """GPT-OSS's routed experts. Owns ``gate_up_proj``, ``gate_up_proj_bias``, ``down_proj`` and
    ``down_proj_bias``: the very same ``Parameter`` objects, under the same names, as the Hugging
    Face ``GptOssExperts`` module it replaces.

    Args:
        gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias: as in the module docstring.
        alpha: the sigmoid's slope in the gate (``config.swiglu_alpha``, 1.702).
        limit: the clamp of gate (from above) and up (both sides) (``config.swiglu_limit``, 7.0).

    ``use_grouped_mm``, ``grad_scale`` (on biases too) and ``compute_dtype`` as in ``GroupedExperts``.
    """

    transposed_weights = True

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        gate_up_proj_bias: nn.Parameter,
        down_proj: nn.Parameter,
        down_proj_bias: nn.Parameter,
        *,
        alpha: float,
        limit: float,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__(use_grouped_mm)
        if gate_up_proj.ndim != 3 or gate_up_proj.shape[2] % 2:
            raise ValueError(
                f"gate_up_proj must be [E, H, 2I] with interleaved gate/up columns, got {tuple(gate_up_proj.shape)}."
            )
        num_experts, hidden, two_i = gate_up_proj.shape
        expected = {
            "gate_up_proj_bias": (gate_up_proj_bias, (num_experts, two_i)),
            "down_proj": (down_proj, (num_experts, two_i // 2, hidden)),
            "down_proj_bias": (down_proj_bias, (num_experts, hidden)),
        }
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"expert weights do not match: gate_up_proj {tuple(gate_up_proj.shape)} needs {name} "
                    f"{shape}, got {tuple(tensor.shape)}."
                )
        self.gate_up_proj = gate_up_proj
        self.gate_up_proj_bias = gate_up_proj_bias
        self.down_proj = down_proj
        self.down_proj_bias = down_proj_bias
        self.alpha = float(alpha)
        self.limit = float(limit)

    def glu(self, h_NF: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU on interleaved ``[..., 2I]`` pre-activations -> ``[..., I]``."""
        gate = h_NF[..., 0::2].clamp(max=self.limit)
        up = h_NF[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, x_nH: torch.Tensor, e: int, weights: list[torch.Tensor]) -> torch.Tensor:
        w1_LHF, b1_LF, w2_LIH, b2_LH = weights
        return self.glu(x_nH @ w1_LHF[e] + b1_LF[e]) @ w2_LIH[e] + b2_LH[e]

    def forward(
        self, x_NH: torch.Tensor, counts_L: torch.Tensor, counts_host: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Run each local expert on its contiguous block of rows, as ``GroupedExperts.forward``."""
        params = [self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias]
        return self.run(x_NH, counts_L, params, (0, 2), self._grouped, self._loop, counts_host)

    def _grouped(
        self, x_NH: torch.Tensor, counts_L: torch.Tensor, weights: list[torch.Tensor], grad_scale: float
    ) -> torch.Tensor:
        assert GROUPED_MM is not None
        offsets_L = torch.cumsum(counts_L.to(device=x_NH.device), dim=0).to(torch.int32)
        # The expert of every row, by binary search (no host sync); rows past the last offset
        # (a padded dispatch) take the last expert's bias: the GEMMs leave them out anyway.
        expert_N = block_of_rows(offsets_L, torch.arange(x_NH.shape[0], device=x_NH.device, dtype=offsets_L.dtype))

        def mlp(x_NH: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
            w1_LHF, b1_LF, w2_LIH, b2_LH = weights
            h_NF = GROUPED_MM(x_NH, w1_LHF, offs=offsets_L) + b1_LF[expert_N]
            return GROUPED_MM(self.glu(h_NF).contiguous(), w2_LIH, offs=offsets_L) + b2_LH[expert_N]

        return with_grad_scale(mlp, x_NH, weights, grad_scale)

    def _loop(
        self, x_NH: torch.Tensor, counts: list[int], weights: list[torch.Tensor], grad_scale: float
    ) -> torch.Tensor:
        # Every expert runs, even on zero rows, so each weight slice gets a zero gradient, not none.
        def run(x_NH: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.expert(x_nH, e, list(w)) for e, x_nH in enumerate(torch.split(x_NH, counts))])

        return with_grad_scale(run, x_NH, weights, grad_scale)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, alpha={self.alpha}, limit={self.limit}"
