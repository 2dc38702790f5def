"""The grouped weight-gradient kernel (``lightning_ep.moe.kernels.grouped_wgrad``) under Triton's CPU
interpreter, against a float64 hand computation per group; where it applies, and that the grouped
MLP's backward on CPU keeps the widened grouped GEMM."""

from __future__ import annotations

import torch
from conftest import run_in_triton_interpreter

from lightning_ep.moe.kernels.grouped_wgrad import grouped_weight_grad_available

_INTERPRETER_CHECK = """
import torch
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter turns a loop bound into a Python int with int() of a one-element array,
# which NumPy 2.4 refuses; this takes the element instead (compiled kernels are not concerned).
_patch = interpreter._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patched

from lightning_ep.moe.kernels import grouped_wgrad

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

g = torch.Generator().manual_seed(0)
# (M, K, rows per group, config): widths off the tile sizes, idle groups first, in the middle and
# last, a group longer than many BLOCK_K steps with a partial last one, no rows at all; the
# interpreter runs fp16 (NumPy has no bf16), whose products fp32 holds exactly.
cases = [
    (48, 40, [0, 5, 0, 70, 3, 0], (32, 32, 16, 4, 2)),
    (24, 16, [130], (16, 16, 16, 4, 2)),
    (64, 64, [0, 0], (32, 32, 16, 4, 2)),
    (40, 24, [9, 33], grouped_wgrad.CONFIG),
    (40, 24, [9, 33], grouped_wgrad.LARGE_CONFIG),
]
for M, K, counts, config in cases:
    padding = 7  # a static plan's rows past the last offset: never read, so NaN there changes nothing
    a = torch.randn(sum(counts) + padding, M, generator=g).half()
    b = torch.randn(sum(counts) + padding, K, generator=g).half()
    a[sum(counts):], b[sum(counts):] = float("nan"), float("nan")
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_wgrad.grouped_weight_grad(a, b, offsets, config)
    assert out.dtype == torch.float32 and out.shape == (len(counts), M, K)
    start = 0
    for e, count in enumerate(counts):
        want = a[start:start + count].double().t() @ b[start:start + count].double()
        start += count
        if count == 0:
            assert torch.count_nonzero(out[e]) == 0, (M, K, counts, e)
        else:  # fp32 accumulation of exact products: fp32 round-off; bf16/fp16 rounding would be 1e-3
            assert rel(out[e], want) < 1e-6, (M, K, counts, e, rel(out[e], want))
# The tile size by the block's size: the wide tiles from LARGE_BLOCK elements per group.
grouped_wgrad.LARGE_BLOCK = 40 * 24
wide = grouped_wgrad.grouped_weight_grad(a, b, offsets, grouped_wgrad.LARGE_CONFIG)
assert torch.equal(grouped_wgrad.grouped_weight_grad(a, b, offsets), wide)
print("ok")
"""


def test_grouped_weight_grad_kernel_against_float64_in_the_triton_interpreter() -> None:
    """The kernel, run by Triton's CPU interpreter (a fresh process: the flag is read at import),
    against a float64 product per group; idle groups zero, padding rows never read."""
    run_in_triton_interpreter("-c", _INTERPRETER_CHECK)


def test_grouped_weight_grad_applies_to_cuda_bf16_or_fp16_rows_only() -> None:
    """On CPU the kernel never runs (the grouped GEMM's gradient is widened instead); fp32 operands,
    mixed dtypes and column-strided operands are refused on any device."""
    rows = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not grouped_weight_grad_available(rows, rows)  # CPU
    if torch.cuda.is_available():
        cuda = rows.cuda()
        assert grouped_weight_grad_available(cuda, cuda)
        assert not grouped_weight_grad_available(cuda.float(), cuda.float())
        assert not grouped_weight_grad_available(cuda, cuda.half())
        assert not grouped_weight_grad_available(cuda.t(), cuda)
