"""``segment_linear``: one GEMM per expert over consecutive row blocks whose sizes the host knows
(large experts, where cuBLAS's per-expert GEMMs beat one grouped GEMM), in forward and backward.

Legend: N rows sorted by expert, K input width, F output width, L experts held here.
"""

from __future__ import annotations

from typing import Any

import torch


def segment_linear(x_NK: torch.Tensor, w_LFK: torch.Tensor, counts: list[int], grad_scale: float = 1.0) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e].T`` for consecutive row blocks of ``counts[e]`` rows.

    One GEMM per non-empty block, written in place into the output (no split, no ``cat``); in
    backward one GEMM per block for the input's gradient and one for the weight's, which the
    GEMM multiplies by ``grad_scale`` (``alpha``) as it writes it. An expert with no rows gets a
    zero weight gradient.
    """
    return _SegmentLinear.apply(x_NK, w_LFK, counts, grad_scale)


def _blocks(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, stop)`` of every non-empty block."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, start, start + c))
        start += c
    return out


class _SegmentLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x_NK: torch.Tensor, w_LFK: torch.Tensor, counts: list[int], grad_scale: float
    ) -> torch.Tensor:
        blocks = _blocks(counts)
        y_NF = x_NK.new_empty(x_NK.shape[0], w_LFK.shape[1])
        for e, start, stop in blocks:
            torch.mm(x_NK[start:stop], w_LFK[e].t(), out=y_NF[start:stop])
        ctx.save_for_backward(x_NK, w_LFK)
        ctx.blocks, ctx.grad_scale = blocks, grad_scale
        return y_NF

    @staticmethod
    def backward(ctx: Any, grad_NF: torch.Tensor) -> tuple[Any, ...]:
        x_NK, w_LFK = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x_NK)
            for e, start, stop in ctx.blocks:
                torch.mm(grad_NF[start:stop], w_LFK[e], out=grad_x[start:stop])
        if ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(w_LFK)
            if len(ctx.blocks) < w_LFK.shape[0]:
                grad_w.zero_()
            for e, start, stop in ctx.blocks:
                # beta=0: the uninitialised ``out`` is never read.
                torch.addmm(
                    grad_w[e], grad_NF[start:stop].t(), x_NK[start:stop], beta=0, alpha=ctx.grad_scale, out=grad_w[e]
                )
        return grad_x, grad_w, None, None
