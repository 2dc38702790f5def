"""SwiGLU on the first grouped GEMM's output: ``a = silu(h[:, :I]) * h[:, I:]``.

Legend: N rows, I expert width, F = 2I (gate columns first, then up columns, as Hugging Face
stacks ``gate_up_proj``).

On CUDA a fused Triton kernel: forward reads ``h`` once and writes ``a``; backward reads ``h`` and
the gradient once and writes ``grad_h`` (no saved ``silu(gate)``, no ``cat`` of the halves), every
value computed in fp32 and rounded once. Elsewhere the torch expression ``act_fn(gate) * up`` under
autograd, the reference the kernel is tested against.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

_BLOCK = 1024


def is_silu(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``act_fn`` is SiLU: ``F.silu``, ``nn.SiLU``, or transformers' ``SiLUActivation``
    (what ``ACT2FN["silu"]`` returns; matched by name, this package never imports transformers)."""
    return act_fn is F.silu or isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def fused_swiglu_available(h_NF: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``h_NF`` (a CUDA tensor, Triton importable, not in a graph
    that ``torch.compile`` traces: there the torch version is compiled instead)."""
    return h_NF.is_cuda and not torch.compiler.is_compiling() and _triton() is not None


def swiglu(
    h_NF: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``act_fn(h[:, :I]) * h[:, I:]``; the fused kernel when ``act_fn`` is SiLU on CUDA.

    ``rows``: a one-element integer tensor on ``h``'s device; the fused kernel then leaves the rows at
    or past ``rows[0]`` out (outputs unspecified, here and in backward), without a host sync: the
    grouped GEMMs pass their last offset, past which are a static plan's padding rows.
    """
    if is_silu(act_fn) and fused_swiglu_available(h_NF):
        return _FusedSwiGLU.apply(h_NF, rows)
    gate_NI, up_NI = h_NF.chunk(2, dim=-1)
    return act_fn(gate_NI) * up_NI


def swiglu_backward(
    h_NF: torch.Tensor,
    grad_NI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    scale: float,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``a = swiglu(h)`` for a caller that multiplies weight gradients by ``scale``:
    ``grad_h`` (``[N, F]``), ``scale * grad_h`` and ``scale * a`` (``[N, I]``, ``a`` recomputed from
    ``h``), each computed in fp32 (the kernel) and rounded once; with ``scale == 1`` the second and
    third are ``grad_h`` and ``a``. ``rows``: as in ``swiglu``."""
    if is_silu(act_fn) and fused_swiglu_available(h_NF):
        return _fused_backward(h_NF, grad_NI, rows, scale, write_a=True)
    with torch.enable_grad():
        h = h_NF.detach().requires_grad_(True)
        gate_NI, up_NI = h.chunk(2, dim=-1)
        a_NI = act_fn(gate_NI) * up_NI
        (grad_NF,) = torch.autograd.grad(a_NI, h, grad_NI)
    a_NI = a_NI.detach()
    if scale == 1.0:
        return grad_NF, grad_NF, a_NI
    return grad_NF, grad_NF * scale, a_NI * scale


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_NF: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        h_NF = h_NF.contiguous()
        count, width = h_NF.shape[0], h_NF.shape[1] // 2
        a_NI = h_NF.new_empty((count, width))
        if count:
            _triton().forward[(count, -(-width // _BLOCK))](
                h_NF, a_NI, _limit(rows, h_NF), I=width, BLOCK=_BLOCK, LIMITED=rows is not None
            )
        ctx.save_for_backward(h_NF)
        ctx.rows = rows
        return a_NI

    @staticmethod
    def backward(ctx: Any, grad_NI: torch.Tensor) -> tuple[Any, ...]:
        (h_NF,) = ctx.saved_tensors
        return _fused_backward(h_NF, grad_NI, ctx.rows)[0], None


def _fused_backward(
    h_NF: torch.Tensor, grad_NI: torch.Tensor, rows: torch.Tensor | None, scale: float = 1.0, write_a: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel: ``grad_h``, ``scale * grad_h`` (``grad_h`` itself when ``scale == 1``) and,
    with ``write_a``, ``scale * a`` (else ``h_NF``, not written)."""
    h_NF, grad_NI = h_NF.contiguous(), grad_NI.contiguous()
    count, width = h_NF.shape[0], h_NF.shape[1] // 2
    grad_NF = torch.empty_like(h_NF)
    scaled = scale != 1.0
    scaled_NF = torch.empty_like(h_NF) if scaled else grad_NF
    a_NI = h_NF.new_empty((count, width)) if write_a else h_NF
    if count:
        _triton().backward[(count, -(-width // _BLOCK))](
            *(h_NF, grad_NI, grad_NF, scaled_NF, a_NI, scale, _limit(rows, h_NF)),
            I=width,
            BLOCK=_BLOCK,
            WRITE_A=write_a,
            SCALED=scaled,
            LIMITED=rows is not None,
        )
    return grad_NF, scaled_NF, a_NI


def _limit(rows: torch.Tensor | None, h_NF: torch.Tensor) -> torch.Tensor:
    """The kernels' ``rows_ptr`` argument (never read without ``LIMITED``)."""
    if rows is None:
        return h_NF
    if rows.numel() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != h_NF.device:
        raise ValueError(
            f"swiglu: rows must be a one-element int32 or int64 tensor on {h_NF.device}, got {rows.dtype} "
            f"{list(rows.shape)} on {rows.device}."
        )
    return rows


def _build_kernels(triton: Any, tl: Any) -> Any:
    @triton.jit
    def swiglu_forward(h_ptr, a_ptr, rows_ptr, I: tl.constexpr, BLOCK: tl.constexpr, LIMITED: tl.constexpr):  # noqa: E741
        # One program per (row, block of I); with LIMITED, rows at or past rows_ptr[0] do nothing.
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        if LIMITED:
            mask = mask & (n < tl.load(rows_ptr))
        gate = tl.load(h_ptr + n * (2 * I) + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + n * (2 * I) + I + offs, mask=mask, other=0.0).to(tl.float32)
        silu = gate / (1.0 + tl.exp(-gate))
        tl.store(a_ptr + n * I + offs, (silu * up).to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_backward(
        h_ptr,
        g_ptr,
        gh_ptr,
        sgh_ptr,
        sa_ptr,
        scale,
        rows_ptr,
        I: tl.constexpr,  # noqa: E741
        BLOCK: tl.constexpr,
        WRITE_A: tl.constexpr,
        SCALED: tl.constexpr,
        LIMITED: tl.constexpr,
    ):
        # d/d gate = g * up * sig * (1 + gate * (1 - sig)); d/d up = g * silu(gate). With SCALED also
        # scale * grad_h (sgh); with WRITE_A also (scale *) a, computed as the forward computes it.
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        if LIMITED:
            mask = mask & (n < tl.load(rows_ptr))
        gate = tl.load(h_ptr + n * (2 * I) + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + n * (2 * I) + I + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + n * I + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = g * gate * sig
        tl.store(gh_ptr + n * (2 * I) + offs, grad_gate.to(gh_ptr.dtype.element_ty), mask=mask)
        tl.store(gh_ptr + n * (2 * I) + I + offs, grad_up.to(gh_ptr.dtype.element_ty), mask=mask)
        if SCALED:
            tl.store(sgh_ptr + n * (2 * I) + offs, (grad_gate * scale).to(sgh_ptr.dtype.element_ty), mask=mask)
            tl.store(sgh_ptr + n * (2 * I) + I + offs, (grad_up * scale).to(sgh_ptr.dtype.element_ty), mask=mask)
        if WRITE_A:
            a = gate / (1.0 + tl.exp(-gate)) * up
            if SCALED:
                a = a * scale
            tl.store(sa_ptr + n * I + offs, a.to(sa_ptr.dtype.element_ty), mask=mask)

    return types.SimpleNamespace(forward=swiglu_forward, backward=swiglu_backward)


_triton = lazy_kernels(_build_kernels)
