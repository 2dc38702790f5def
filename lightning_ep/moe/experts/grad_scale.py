"""Gradient scaling under autograd: ``scale_grad`` (identity forward, scaled backward) and
``with_grad_scale``, which multiplies the gradients of a function's weights, not of its input, in
the fewest elements. Under expert parallelism the experts' gradients are scaled by ``1 / degree``
(``GroupedExperts.grad_scale``).

Legend: N rows, H hidden size, L experts held here, I expert width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in forward; its gradient multiplied by ``scale`` in backward."""
    return _ScaleGrad.apply(x, scale)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.scale, None


def with_grad_scale(
    fn: Callable[..., torch.Tensor], x_NH: torch.Tensor, weights: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """``fn(x_NH, *weights)``, with every weight's gradient multiplied by ``scale`` and ``x_NH``'s not.

    Backward is linear in the incoming gradient, so multiplying the output's gradient by ``scale`` and
    the input's by ``1 / scale`` scales exactly the weights' gradients, touching ``2 N H`` elements
    instead of ``L H I``: chosen when that is fewer and ``scale`` is a power of two (both products exact
    in any float format); otherwise each weight's gradient is multiplied.
    """
    if scale == 1.0 or not torch.is_grad_enabled():
        return fn(x_NH, *weights)
    exact = math.frexp(scale)[0] == 0.5  # a power of two
    if exact and 2 * x_NH.numel() < sum(w.numel() for w in weights):
        y = fn(scale_grad(x_NH, 1.0 / scale), *weights)
        if y.requires_grad:
            # A hook, not scale_grad: the output stays a fresh tensor, not a view (FSDP2 warns
            # about views returned by a module it wraps).
            y.register_hook(lambda grad: grad * scale)
        return y
    return fn(x_NH, *(scale_grad(w, scale) for w in weights))
