"""``cast_for_compute``: a weight cast to the matmuls' dtype (fp32 master weights, bf16 GEMMs) whose
backward widens the gradient back with one vectorized Triton kernel on CUDA.

Under plain autograd the backward of ``w.to(dtype)`` is ``grad.to(w.dtype)``, a widening cast that
torch runs through its generic copy loop, one element at a time, well below the narrowing cast's
bandwidth. The kernel streams it in blocks, with the same bits (a widening cast is exact); elsewhere
(CPU, no Triton, a strided gradient, a traced graph, other dtypes) torch's cast runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

_BLOCK = 4096
_NARROW = (torch.bfloat16, torch.float16)


def cast_for_compute(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w.to(dtype)`` under autograd; the gradient comes back in ``w.dtype`` (see the module docstring)."""
    if w.dtype == dtype or torch.compiler.is_compiling() or not w.requires_grad or not torch.is_grad_enabled():
        return w.to(dtype)  # ``w`` itself when already in ``dtype``
    return _CastForCompute.apply(w, dtype)


def widen(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad.to(dtype)``, by the Triton kernel when it widens a contiguous bf16/fp16 CUDA tensor to fp32."""
    applies = dtype == torch.float32 and grad.dtype in _NARROW and grad.is_contiguous() and grad.is_cuda
    if not applies or torch.compiler.is_compiling() or _triton() is None:
        return grad.to(dtype)
    return widen_with_kernel(grad)


def widen_with_kernel(grad: torch.Tensor) -> torch.Tensor:
    """A contiguous bf16/fp16 ``grad`` as fp32, by the Triton kernel (on CUDA, or on CPU tensors under
    Triton's interpreter)."""
    out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    count = grad.numel()
    if count:
        _triton().widen[(-(-count // _BLOCK),)](grad, out, count, BLOCK=_BLOCK)
    return out


class _CastForCompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.source_dtype = w.dtype
        return w.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return widen(grad, ctx.source_dtype), None


def _build_kernels(triton: Any, tl: Any) -> Any:
    @triton.jit
    def widen_kernel(x_ptr, out_ptr, count, BLOCK: tl.constexpr):
        # One program per block of BLOCK elements; the load and the store are contiguous vectors.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float32), mask=mask)

    return types.SimpleNamespace(widen=widen_kernel)


_triton = lazy_kernels(_build_kernels)
