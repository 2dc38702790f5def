"""Triton kernels built on first use, and only where Triton is installed (it ships with CUDA builds
of torch; CPU builds have none, and the fast paths then take their torch fallbacks)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def lazy_kernels(build: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    """A cached ``() -> build(triton, triton.language)``, or ``() -> None`` without Triton. ``build``
    holds the ``@triton.jit`` functions, so that importing a kernel module never imports Triton."""

    @functools.cache
    def kernels() -> Any:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    return kernels
