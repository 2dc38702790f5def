"""``grouped_weight_grad``: the weight gradients of a grouped GEMM, ``out[e] = g[rows of e].T @ b[rows
of e]``, written in fp32 by one Triton kernel.

Legend: N rows sorted by group, M and K the two operands' widths, L groups.

Why: ``torch._grouped_mm`` writes only its operands' dtype, so fp32 master weights with bf16 GEMMs
get a gradient rounded to bf16 and widened by a second pass. This kernel stores each ``[M, K]``
block's fp32 accumulator as it is (no bf16 rounding, one 4-byte write per element), as
``segments.segment_weight_grad`` does, but with the offsets read on the device (no host sync). One
program per ``(output tile, group)``; a group's tiles run together, so its rows are read from L2.
Rows past the last offset are never read; a group without rows gets zeros.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

_NARROW = (torch.bfloat16, torch.float16)
# Tile sizes and pipeline depth (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), tuned on the benchmarks'
# fine and coarse experts: wider tiles from LARGE_BLOCK elements per expert on.
CONFIG = (128, 128, 64, 4, 3)
LARGE_CONFIG = (128, 256, 64, 8, 3)
LARGE_BLOCK = 1 << 25


def grouped_weight_grad_available(g_NM: torch.Tensor, b_NK: torch.Tensor) -> bool:
    """Whether the kernel runs: CUDA, one bf16/fp16 dtype, rows contiguous, Triton, not ``torch.compile``-traced."""
    return (
        g_NM.is_cuda
        and g_NM.dtype in _NARROW
        and b_NK.dtype == g_NM.dtype
        and g_NM.stride(-1) == 1
        and b_NK.stride(-1) == 1
        and not torch.compiler.is_compiling()
        and _triton() is not None
    )


def grouped_weight_grad(
    g_NM: torch.Tensor, b_NK: torch.Tensor, offsets_L: torch.Tensor, config: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``[L, M, K]`` fp32: ``out[e] = g_NM[s:t].T @ b_NK[s:t]`` for group ``e``'s rows ``s:t`` (``offsets_L``:
    ``torch._grouped_mm``'s int32 ``offs``), if ``grouped_weight_grad_available``. ``config``: the kernel's
    ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)``; ``None`` picks by the block's size."""
    groups, width_m, width_k = offsets_L.shape[0], g_NM.shape[1], b_NK.shape[1]
    if config is None:
        config = LARGE_CONFIG if width_m * width_k >= LARGE_BLOCK else CONFIG
    block_m, block_n, block_k, warps, stages = config
    out = torch.empty((groups, width_m, width_k), dtype=torch.float32, device=g_NM.device)
    if out.numel():
        tiles = -(-width_m // block_m) * -(-width_k // block_n)
        _triton().kernel[(tiles, groups)](
            *(g_NM, b_NK, offsets_L, out, width_m, width_k, g_NM.stride(0), b_NK.stride(0)),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
            num_stages=stages,
        )
    return out


def _build_kernels(triton: Any, tl: Any) -> Any:
    @triton.jit
    def grouped_wgrad(
        g_ptr,
        b_ptr,
        offs_ptr,
        out_ptr,
        M,
        K,
        stride_g,
        stride_b,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Program (tile, e): the [BLOCK_M, BLOCK_N] tile of out[e], summed over e's rows BLOCK_K at a time.
        e = tl.program_id(1)
        tiles_n = tl.cdiv(K, BLOCK_N)
        tile_m, tile_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
        end = tl.load(offs_ptr + e).to(tl.int64)
        cols_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_m, in_n = cols_m < M, cols_n < K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for first in range(start, end, BLOCK_K):
            rows = first + tl.arange(0, BLOCK_K)
            live = (rows < end)[:, None]
            g = tl.load(g_ptr + rows[:, None] * stride_g + cols_m[None, :], mask=live & in_m[None, :], other=0.0)
            b = tl.load(b_ptr + rows[:, None] * stride_b + cols_n[None, :], mask=live & in_n[None, :], other=0.0)
            acc = tl.dot(tl.trans(g), b, acc)
        target = out_ptr + e.to(tl.int64) * M * K + cols_m[:, None].to(tl.int64) * K + cols_n[None, :]
        tl.store(target, acc, mask=in_m[:, None] & in_n[None, :])

    return types.SimpleNamespace(kernel=grouped_wgrad)


_triton = lazy_kernels(_build_kernels)
