"""One GEMM per expert over consecutive row blocks whose sizes the host knows (large experts, where
cuBLAS's per-expert GEMMs beat one grouped GEMM), and ``CountsOnHost``, a layer's counts copied to
the host for its backward without waiting for them in the forward. fp32 weight gradients of bf16
GEMMs are the GEMM's fp32 accumulator, as in Megatron-Core's gradient-accumulation fusion.

Legend: N rows sorted by expert, K input width, F output width, L experts held here.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ep.moe.dispatch.host import HostCopy


def segment_linear(
    x_NK: torch.Tensor,
    w_LFK: torch.Tensor,
    counts: list[int],
    grad_scale: float = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e].T`` for consecutive row blocks of ``counts[e]`` rows: one
    GEMM per non-empty block, written in place (no split, no ``cat``); in backward one per block for the
    input's gradient and one for the weight's, which the GEMM multiplies by ``grad_scale`` (``alpha``)
    as it writes it (zero for an expert without rows). ``compute_dtype``: the GEMMs' dtype (``None``:
    the weight's); the gradient comes back in the weight's dtype, written so by the GEMM."""
    return _SegmentLinear.apply(x_NK, w_LFK, counts, grad_scale, compute_dtype)


def blocks_of(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, stop)`` of every non-empty block."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, start, start + c))
        start += c
    return out


def segment_mm(g_NF: torch.Tensor, w_LFK: torch.Tensor, blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """``g[rows of e] @ w[e]`` per block, ``[N, K]`` (a forward with ``w`` transposed, or an input's
    gradient); rows in no block are zero."""
    out = g_NF.new_empty(g_NF.shape[0], w_LFK.shape[2])
    covered = blocks[-1][2] if blocks else 0
    if covered < out.shape[0]:
        out[covered:].zero_()
    for e, start, stop in blocks:
        torch.mm(g_NF[start:stop], w_LFK[e], out=out[start:stop])
    return out


def segment_weight_grad(
    g_NF: torch.Tensor,
    x_NK: torch.Tensor,
    blocks: list[tuple[int, int, int]],
    num_experts: int,
    dtype: torch.dtype,
    alpha: float = 1.0,
) -> torch.Tensor:
    """``alpha * g[rows of e].T @ x[rows of e]`` per expert, ``[L, F, K]`` in ``dtype`` (zero for an
    expert without rows). A wider ``dtype`` than the operands' (fp32 from bf16) is the GEMM's own
    output: the fp32 accumulator written without rounding to bf16."""
    out = torch.empty((num_experts, g_NF.shape[1], x_NK.shape[1]), dtype=dtype, device=g_NF.device)
    if len(blocks) < num_experts:
        out.zero_()
    for e, start, stop in blocks:
        _mm_into(out[e], g_NF[start:stop].t(), x_NK[start:stop], alpha)
    return out


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out = alpha * a @ b`` (``beta=0``: the uninitialised ``out`` is never read)."""
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)
    elif a.is_cuda:  # cuBLAS: bf16 operands, fp32 accumulation, written in out's dtype
        torch.addmm(out, a, b, beta=0, alpha=alpha, out_dtype=out.dtype, out=out)
    else:  # the CPU has no mixed-dtype GEMM: the operands widened exactly, the same math
        torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=0, alpha=alpha, out=out)


class CountsOnHost(HostCopy):
    """Rows per local expert, on the host for a backward, without a host sync in the forward: a
    backward runs well after its forward's routing, so waiting for the copy drains nothing."""

    def get(self) -> list[int]:
        """The counts as host integers (waits for the forward's copy on CUDA)."""
        return self.wait().tolist()


class _SegmentLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x_NK: torch.Tensor,
        w_LFK: torch.Tensor,
        counts: list[int],
        grad_scale: float,
        compute_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        blocks = blocks_of(counts)
        w_c = w_LFK if compute_dtype is None else w_LFK.to(compute_dtype)  # kept for backward
        y_NF = segment_mm(x_NK, w_c.transpose(1, 2), blocks)
        ctx.save_for_backward(x_NK, w_c)
        ctx.blocks, ctx.grad_scale, ctx.weight_dtype = blocks, grad_scale, w_LFK.dtype
        return y_NF

    @staticmethod
    def backward(ctx: Any, grad_NF: torch.Tensor) -> tuple[Any, ...]:
        x_NK, w_LFK = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        grad_x = segment_mm(grad_NF, w_LFK, ctx.blocks) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = segment_weight_grad(grad_NF, x_NK, ctx.blocks, w_LFK.shape[0], ctx.weight_dtype, ctx.grad_scale)
        return grad_x, grad_w, None, None, None
