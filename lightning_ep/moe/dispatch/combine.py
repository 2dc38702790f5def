"""The combine step: undo the sort and take the weighted sum over each token's K expert outputs.

Legend: T tokens, K experts per token, H hidden size, N = T * K expert-output rows, sorted by expert.

    out_TH[t] = sum_k weights_TK[t, k] * y_NH[inverse_N[t * K + k]]

Two implementations of ``weighted_combine``:

- a fused Triton kernel on CUDA: forward reads each expert-output row once; backward writes
  ``grad_y`` straight into the sorted layout and the K weight gradients with one read of ``y``.
  Weights stay in their own dtype (fp32 from the router) and every sum is in fp32.
- the torch reference (CPU, or CUDA without Triton): a permutation gather and a batched
  ``[1, K] @ [K, H]`` product; backward gathers the output gradient into the sorted layout and
  scales it (no outer-product GEMM, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

_BLOCK_H = 1024


def fused_combine_available(y_NH: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``y_NH`` (a CUDA tensor, Triton importable, not in a graph
    that ``torch.compile`` traces: there the torch version is compiled instead)."""
    return y_NH.is_cuda and not torch.compiler.is_compiling() and _triton() is not None


def weighted_combine(
    y_NH: torch.Tensor, inverse_N: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """``out_TH`` of the module docstring, differentiable in ``y_NH`` and ``weights_TK`` (``order_N``:
    the inverse of ``inverse_N``). ``[T, H]`` in the dtype of ``y_NH``; the weights' gradient in theirs."""
    if fused_combine_available(y_NH):
        return _FusedCombine.apply(y_NH, weights_TK, inverse_N)
    return _TorchCombine.apply(y_NH, weights_TK, inverse_N, order_N)


def sum_copies(x_NH: torch.Tensor, inverse_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out_TH[t] = sum_k x_NH[inverse_N[t * K + k]]``: the K copies of each token summed, in fp32
    (fp64 for fp64), rounded once to the dtype of ``x_NH``. The adjoint of copying each token to
    its K sorted rows; the combine's kernel with unit weights on CUDA (one pass, no ``[T, K, H]``
    intermediate), a gather and a sum elsewhere."""
    num_tokens = inverse_N.numel() // top_k
    if not fused_combine_available(x_NH) or x_NH.dtype == torch.float64:
        return x_NH.index_select(0, inverse_N).view(num_tokens, top_k, -1).sum(dim=1)
    x_NH, inverse_N = x_NH.contiguous(), inverse_N.contiguous()
    hidden = x_NH.shape[1]
    out_TH = x_NH.new_empty((num_tokens, hidden))
    if num_tokens and hidden:
        grid = (num_tokens, -(-hidden // _BLOCK_H))
        _triton().forward[grid](x_NH, inverse_N, x_NH, out_TH, H=hidden, K=top_k, BLOCK_H=_BLOCK_H, WEIGHTED=False)
    return out_TH


class _TorchCombine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, y_NH: torch.Tensor, weights_TK: torch.Tensor, inverse_N: torch.Tensor, order_N: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = weights_TK.shape
        y_TKH = y_NH.index_select(0, inverse_N).view(num_tokens, top_k, -1)
        ctx.save_for_backward(y_TKH, weights_TK, order_N)
        return torch.bmm(weights_TK.to(y_TKH.dtype).unsqueeze(1), y_TKH).squeeze(1)

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor) -> tuple[Any, ...]:
        y_TKH, weights_TK, order_N = ctx.saved_tensors
        top_k = weights_TK.shape[1]
        grad_TH = grad_TH.contiguous()
        grad_w_TK = torch.bmm(y_TKH, grad_TH.unsqueeze(-1)).squeeze(-1).to(weights_TK.dtype)
        # Sorted pair i belongs to token order_N[i] // K with weight weights_TK.flat[order_N[i]].
        weight_N = weights_TK.reshape(-1).index_select(0, order_N).to(grad_TH.dtype)
        grad_y_NH = grad_TH.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))
        grad_y_NH.mul_(weight_N.unsqueeze(1))
        return grad_y_NH, grad_w_TK, None, None


class _FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_NH: torch.Tensor, weights_TK: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = weights_TK.shape
        hidden = y_NH.shape[1]
        y_NH, weights_TK, inverse_N = y_NH.contiguous(), weights_TK.contiguous(), inverse_N.contiguous()
        out_TH = y_NH.new_empty((num_tokens, hidden))
        if num_tokens:
            grid = (num_tokens, -(-hidden // _BLOCK_H))
            _triton().forward[grid](
                y_NH, inverse_N, weights_TK, out_TH, H=hidden, K=top_k, BLOCK_H=_BLOCK_H, WEIGHTED=True
            )
        ctx.save_for_backward(y_NH, weights_TK, inverse_N)
        return out_TH

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor) -> tuple[Any, ...]:
        y_NH, weights_TK, inverse_N = ctx.saved_tensors
        num_tokens, top_k = weights_TK.shape
        hidden = y_NH.shape[1]
        grad_TH = grad_TH.contiguous()
        grad_y_NH = torch.empty_like(y_NH)
        grad_w_TK = torch.empty((num_tokens, top_k), dtype=torch.float32, device=y_NH.device)
        if num_tokens:
            _triton().backward[(num_tokens,)](
                grad_TH, y_NH, inverse_N, weights_TK, grad_y_NH, grad_w_TK, H=hidden, K=top_k, BLOCK_H=_BLOCK_H
            )
        return grad_y_NH, grad_w_TK.to(weights_TK.dtype), None


def _build_kernels(triton: Any, tl: Any) -> Any:
    @triton.jit
    def combine_forward(
        y_ptr, inv_ptr, w_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr
    ):
        # One program per (token, block of H): out[t, h] = sum_k w[t, k] * y[inv[t*K + k], h]
        # (w = 1 and w_ptr unread unless WEIGHTED).
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + k).to(tl.int64)
            y = tl.load(y_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                acc += tl.load(w_ptr + t * K + k).to(tl.float32) * y
            else:
                acc += y
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def combine_backward(
        g_ptr, y_ptr, inv_ptr, w_ptr, gy_ptr, gw_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        # One program per token: grad_y[inv[t*K + k]] = w[t, k] * g[t]; grad_w[t, k] = <g[t], y[row]>.
        t = tl.program_id(0).to(tl.int64)
        for k in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + k).to(tl.int64)
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                offs = h0 + tl.arange(0, BLOCK_H)
                mask = offs < H
                g = tl.load(g_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
                y = tl.load(y_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(gy_ptr + row * H + offs, (w * g).to(gy_ptr.dtype.element_ty), mask=mask)
                acc += g * y
            tl.store(gw_ptr + t * K + k, tl.sum(acc, axis=0))

    class Kernels:
        forward = combine_forward
        backward = combine_backward

    return Kernels


_triton = lazy_kernels(_build_kernels)
