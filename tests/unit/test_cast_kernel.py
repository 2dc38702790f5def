"""``lightning_ep.moe.kernels.cast``: the weight cast for the matmuls and its widening backward.

The kernel runs in Triton's CPU interpreter here (a fresh interpreter: the flag is read at import);
the CUDA twin is in ``tests/gpu/test_fast_paths_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_triton_interpreter

from lightning_ep.moe.kernels.cast import cast_for_compute, widen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_for_compute_is_the_cast_with_the_gradient_in_the_weights_dtype(dtype) -> None:
    w = torch.randn(4, 6, 8, requires_grad=True)
    ref = w.detach().clone().requires_grad_(True)
    out = cast_for_compute(w, dtype)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))
    upstream = torch.randn(4, 6, 8).to(dtype)
    out.backward(upstream)
    ref.to(dtype).backward(upstream)
    assert w.grad is not None and w.grad.dtype == torch.float32 and torch.equal(w.grad, ref.grad)
    assert cast_for_compute(w, torch.float32) is w  # no cast, no new node
    with torch.no_grad():
        assert not cast_for_compute(w, dtype).requires_grad


def test_widen_takes_torch_cast_where_the_kernel_does_not_apply() -> None:
    x = torch.randn(6, 10).bfloat16()
    assert torch.equal(widen(x, torch.float32), x.float())  # CPU
    assert torch.equal(widen(x.t(), torch.float32), x.t().float())  # strided
    assert widen(x, torch.float64).dtype == torch.float64  # another pair of dtypes


_CHECK = """
import torch
from lightning_ep.moe.kernels.cast import widen_with_kernel

for dtype in (torch.bfloat16, torch.float16):
    for numel in (0, 1, 4095, 4096 * 2 + 5):
        x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 100).to(dtype)
        if numel:
            x[-1] = float("-inf")
        got = widen_with_kernel(x.view(-1, 1) if numel else x)
        assert got.dtype == torch.float32 and torch.equal(got.view(-1), x.float()), (dtype, numel)
print("ok")
"""


def test_widening_kernel_equals_torch_cast_in_the_triton_interpreter() -> None:
    run_in_triton_interpreter("-c", _CHECK)
