"""``dither_master_weights``: fp32 master weights loaded from a bf16 checkpoint, moved off the bf16 grid.

Under ``bf16-mixed`` the forward reads each fp32 master weight rounded to the nearest bf16. Loaded
from a bf16 checkpoint, every master starts exactly on a bf16 value, at the centre of the interval
of reals that round to it, so its drift stays invisible to the loss until it passes half a bf16
step (``2^-9`` of the weight): at a fine-tuning learning rate most weights never get there, and the
run learns less than fp32 (or ``bf16-true`` with stochastic rounding) does from the same start.

The checkpoint fixes each weight only to within that interval. ``dither_master_weights`` moves every
such master to a point drawn uniformly inside its own interval: the forward's bf16 weights keep their
bits, so the first step is the same, but a later drift ``δ`` changes a weight's bf16 value with a
probability in proportion to ``δ``: on average the forward sees every update, as fp32 would.

The draw of an element depends only on the parameter's name and the element's index in the whole
(unsharded) tensor, through an integer hash: the same masters at any degree, sharding and rank count.
Costs at setup: a few passes over each parameter's local shard, in pieces of ``CHUNK_ELEMENTS``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ep.parallel.mesh import local_block

#: Elements hashed and dithered at a time (bounds the transient tensors to about 200 MiB).
CHUNK_ELEMENTS = 1 << 22
_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2^31: a product with a 32-bit value stays inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of non-negative int64 values below 2^32 (no int64 overflow)."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIER) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIER) & _MASK32
    return x ^ (x >> 16)


def uniform_at(key: int, index: torch.Tensor) -> torch.Tensor:
    """Values in ``(0, 1)`` (float32, 24 random bits, never 0 or 1) that depend only on ``key`` and
    the int64 ``index``: a hash of the index's high and low 32 bits."""
    high = _mix32(((index >> 32) & _MASK32) ^ (key & _MASK32))
    bits = _mix32((index & _MASK32) ^ high) & 0xFFFFFF
    return (bits.to(torch.float32) + 0.5) / float(1 << 24)


def on_bf16_grid(local: torch.Tensor) -> bool:
    """Whether every value of the float32 ``local`` is a bf16 value (one read of it, one host sync)."""
    return bool(torch.equal(local, local.to(torch.bfloat16).to(torch.float32)))


@torch.no_grad()
def dither_(param: torch.Tensor, name: str) -> int:
    """Move each nonzero value of the float32 ``param`` (a DTensor's local shard) to its hashed point
    inside the interval that rounds to it in bf16 (see the module docstring); zeros, infinities and
    NaNs stay. Returns the number of elements moved here."""
    local, offset = local_block(param, "dither_master_weights", name)
    if local.dtype != torch.float32:
        raise TypeError(f"dither_: {name} is {local.dtype}; master weights to dither are float32.")
    shape = tuple(param.shape)
    key = zlib.crc32(name.encode())
    if not local.is_contiguous():
        raise ValueError(f"dither_: {name}'s local shard is not contiguous.")
    flat = local.view(-1)
    # Global strides: element (i0, i1, ...) of the local shard is global index sum((offset_d + i_d) * stride_d).
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    local_shape = tuple(local.shape)
    moved = 0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        stop = min(flat.numel(), start + CHUNK_ELEMENTS)
        linear = torch.arange(start, stop, device=local.device, dtype=torch.int64)
        index = torch.zeros_like(linear)
        for d in range(len(local_shape) - 1, -1, -1):
            index += (linear % local_shape[d] + offset[d]) * strides[d]
            linear = linear // local_shape[d]
        values = flat[start:stop]
        centre = values.to(torch.bfloat16)
        bits = centre.view(torch.int16)
        up = (bits + 1).view(torch.bfloat16).float()  # the next bf16 of larger magnitude (sign and magnitude)
        down = (bits - 1).view(torch.bfloat16).float()  # of smaller magnitude (NaN below a zero)
        centre32 = centre.float()
        low, high = (centre32 + down) / 2, (centre32 + up) / 2  # the rounding interval's ends (ties excluded)
        dithered = low + uniform_at(key, index) * (high - low)
        keep = (centre32 == 0) | ~torch.isfinite(dithered) | (dithered.to(torch.bfloat16) != centre)
        new = torch.where(keep, centre32, dithered)
        moved += int((new != values).sum())
        values.copy_(new)
    return moved


def dither_master_weights(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> tuple[int, int]:
    """Dither (``dither_``) every trainable float32 parameter whose local values all lie on the bf16
    grid (loaded from bf16, or initialised to such values, as norm weights to 1.0); others
    (initialised in fp32, frozen, other dtypes) stay as they are.
    Returns ``(parameters dithered, elements moved)`` on this rank."""
    count = moved = 0
    for name, param in named_parameters:
        local = param.to_local() if isinstance(param, DTensor) else param
        if not param.requires_grad or local.dtype != torch.float32 or local.numel() == 0:
            continue
        if not on_bf16_grid(local) or not bool(local.any()):
            continue
        count += 1
        moved += dither_(param, name)
    return count, moved


__all__ = ["dither_", "dither_master_weights", "on_bf16_grid", "uniform_at"]
