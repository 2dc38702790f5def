"""The grouped-GEMM SwiGLU MLP of ``GroupedExperts`` as one autograd function, with the weights'
gradient scale folded into its backward.

Legend: N rows sorted by expert, H hidden size, I expert width, F = 2I, L local experts.

    h = x @ w1[e].T;  a = act(h[:, :I]) * h[:, I:];  y = a @ w2[e].T     (the rows of expert e)

Scaling the weights' gradients (``GroupedExperts.grad_scale``) under plain autograd costs two passes
over ``[N, H]`` gradients (``with_grad_scale``). Here the SwiGLU backward writes ``grad_scale * grad_h``
and ``grad_scale * a`` (``a`` recomputed, not saved: ``N x I`` fewer elements kept) for the weight
gradients beside the unscaled ``grad_h`` for the input's. A power-of-two scale gives exactly the
autograd path's gradients; another is applied before the one rounding of ``grad_h`` and ``a``.

Master weights in another dtype than the rows (``compute_dtype``) are cast inside, the cast kept for
backward. Their gradients come back in their own dtype, accumulated in fp32 and never rounded to
bf16: on CUDA by one Triton kernel over all experts (``kernels.grouped_wgrad``, no host sync), or,
with the rows per expert on the host (``CountsOnHost``), by one cuBLAS GEMM per expert
(``segments.segment_weight_grad``; input gradients per expert too). Elsewhere (CPU, no Triton) the
grouped GEMM's gradient is widened (``kernels.cast.widen``: the bits of autograd through ``w.to(bf16)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_ep.moe.experts.segments import CountsOnHost, blocks_of, segment_mm, segment_weight_grad
from lightning_ep.moe.kernels.cast import widen
from lightning_ep.moe.kernels.grouped_wgrad import grouped_weight_grad, grouped_weight_grad_available
from lightning_ep.moe.kernels.swiglu import swiglu, swiglu_backward

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mlp(
    x_NH: torch.Tensor,
    offsets_L: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    grad_scale: float,
    compute_dtype: torch.dtype | None = None,
    backward_counts: CountsOnHost | None = None,
) -> torch.Tensor:
    """``y_NH``, differentiable in ``x_NH``, ``w1_LFH`` and ``w2_LHI``; the weights' gradients come
    out multiplied by ``grad_scale``, the input's does not.

    ``x_NH``: rows sorted by expert, in the GEMMs' dtype. ``offsets_L``: int32 inclusive prefix sums of
    the rows per expert (``grouped_mm``'s ``offs``); rows past the last (a static plan's padding) are
    left out by the SwiGLU as by the GEMMs (outputs unspecified, input gradients zero or unspecified).
    ``w1_LFH``: ``[L, 2I, H]``, gate rows then up rows; ``w2_LHI``: ``[L, H, I]``. ``compute_dtype``:
    the GEMMs' dtype when the weights are kept in another (``None``: ``x_NH``'s). ``backward_counts``:
    the rows per expert for the backward's per-expert GEMMs (``None``: grouped GEMMs).
    """
    dtype = compute_dtype or x_NH.dtype
    return _GroupedMLP.apply(x_NH, offsets_L, w1_LFH, w2_LHI, act_fn, grad_scale, dtype, backward_counts)


def grouped_mlp_forward(
    x_NH: torch.Tensor,
    offsets_L: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h_NF, y_NH)``: the first GEMM's output and the MLP's, under whatever autograd mode is on."""
    assert GROUPED_MM is not None
    h_NF = GROUPED_MM(x_NH, w1_LFH.transpose(-2, -1), offs=offsets_L)
    a_NI = swiglu(h_NF, act_fn, offsets_L[-1:])  # a fused kernel for SiLU on CUDA; rows past the GEMMs' left out
    return h_NF, GROUPED_MM(a_NI, w2_LHI.transpose(-2, -1), offs=offsets_L)


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x_NH: torch.Tensor,
        offsets_L: torch.Tensor,
        w1_LFH: torch.Tensor,
        w2_LHI: torch.Tensor,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        grad_scale: float,
        dtype: torch.dtype,
        backward_counts: CountsOnHost | None,
    ) -> torch.Tensor:
        w1_c, w2_c = w1_LFH.to(dtype), w2_LHI.to(dtype)  # the weights themselves when already in dtype
        with torch.autocast(x_NH.device.type, enabled=False):  # every operand is in dtype already
            h_NF, y_NH = grouped_mlp_forward(x_NH, offsets_L, w1_c, w2_c, act_fn)
        ctx.save_for_backward(x_NH, offsets_L, w1_c, w2_c, h_NF)
        ctx.act_fn, ctx.grad_scale, ctx.backward_counts = act_fn, grad_scale, backward_counts
        ctx.weight_dtypes = (w1_LFH.dtype, w2_LHI.dtype)
        return y_NH

    @staticmethod
    def backward(ctx: Any, grad_NH: torch.Tensor) -> tuple[Any, ...]:
        assert GROUPED_MM is not None
        x_NH, offsets_L, w1_LFH, w2_LHI, h_NF = ctx.saved_tensors
        need_x, _, need_w1, need_w2 = ctx.needs_input_grad[:4]
        grad_NH = grad_NH.contiguous()
        blocks = blocks_of(ctx.backward_counts.get()) if ctx.backward_counts is not None else None

        def input_grad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return GROUPED_MM(g, w, offs=offsets_L) if blocks is None else segment_mm(g, w, blocks)

        def weight_grad(g: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            # The K dimension (rows) is grouped: one [F, H] / [H, I] block per expert.
            if blocks is None:
                if dtype == torch.float32 and grouped_weight_grad_available(g, a):
                    return grouped_weight_grad(g, a, offsets_L)
                return widen(GROUPED_MM(g.t(), a, offs=offsets_L), dtype)
            return segment_weight_grad(g, a, blocks, w1_LFH.shape[0], dtype)

        grad_NI = input_grad(grad_NH, w2_LHI)
        scale = ctx.grad_scale if need_w1 or need_w2 else 1.0
        grad_NF, scaled_grad_NF, scaled_a_NI = swiglu_backward(h_NF, grad_NI, ctx.act_fn, scale, offsets_L[-1:])
        grad_w1 = weight_grad(scaled_grad_NF, x_NH, ctx.weight_dtypes[0]) if need_w1 else None
        grad_w2 = weight_grad(grad_NH, scaled_a_NI, ctx.weight_dtypes[1]) if need_w2 else None
        grad_x = input_grad(grad_NF, w1_LFH) if need_x else None
        return grad_x, None, grad_w1, grad_w2, None, None, None, None
