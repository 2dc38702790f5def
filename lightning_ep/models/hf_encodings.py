"""The encodings a Hugging Face folder stores a weight in, each read one block at a time into the
values it means (the formats are in ``moe.quantized``): ``Plain`` (as used), ``BlockFP8`` (FP8 with
scales per tensor, row, group or block), ``MXFP4``, ``BNB4`` (bitsandbytes 4-bit), ``GPTQ`` and
``AWQ``. Each answers ``shape`` (the weight as the model uses it), ``stored`` (the tensors it reads)
and ``read(opener, box, dtype)`` (the block ``box``, one slice per dim, dequantized in fp32 and cast)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_ep.models.hf_stored import Opener, Stored
from lightning_ep.moe.quantized import (
    MXFP4_GROUP,
    bnb_nested_absmax,
    dequantize_bnb4,
    dequantize_fp8_block,
    dequantize_grouped_int,
    dequantize_mxfp4,
    unpack_awq,
    unpack_int32,
)


@dataclass(frozen=True)
class Plain:
    """A tensor stored as it is used (any dtype; cast on copy)."""

    data: Stored

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def stored(self) -> tuple[Stored, ...]:
        return (self.data,)

    def read(self, opener: Opener, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        return opener.read(self.data, box)


@dataclass(frozen=True)
class BlockFP8:
    """A block-scaled FP8 weight ``[..., R, C]`` and its scales ``[..., ceil(R/br), ceil(C/bc)]``."""

    data: Stored
    scale: Stored
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def stored(self) -> tuple[Stored, ...]:
        return (self.data, self.scale)

    def read(self, opener: Opener, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        (br, bc), rows, cols = self.block, box[-2], box[-1]
        values = opener.read(self.data, box)
        if math.prod(self.scale.shape) == 1:  # one scale for the tensor, stored as a scalar or [1]
            scale = opener.read(self.scale, tuple(slice(0, n) for n in self.scale.shape))
        else:
            grid = (
                *box[:-2],
                slice(rows.start // br, -(-rows.stop // br)),
                slice(cols.start // bc, -(-cols.stop // bc)),
            )
            scale = opener.read(self.scale, grid)
        return dequantize_fp8_block(values, scale, self.block, (rows.start, cols.start), dtype)


@dataclass(frozen=True)
class MXFP4:
    """MXFP4 ``blocks [..., out, G, 16]`` and ``scales [..., out, G]``, used as ``[..., 32 G, out]``."""

    blocks: Stored
    scales: Stored

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, groups, _ = self.blocks.shape
        return (*lead, groups * MXFP4_GROUP, out)

    @property
    def stored(self) -> tuple[Stored, ...]:
        return (self.blocks, self.scales)

    def read(self, opener: Opener, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        *lead, inner, out = box  # the wanted block of [..., in, out]
        g0, g1 = inner.start // MXFP4_GROUP, -(-inner.stop // MXFP4_GROUP)
        blocks = opener.read(self.blocks, (*lead, out, slice(g0, g1), slice(0, MXFP4_GROUP // 2)))
        scales = opener.read(self.scales, (*lead, out, slice(g0, g1)))
        values = dequantize_mxfp4(blocks, scales, dtype)  # [..., Lout, 32 (g1 - g0)]
        first = inner.start - g0 * MXFP4_GROUP
        return values[..., first : first + inner.stop - inner.start].transpose(-1, -2)


@dataclass(frozen=True)
class BNB4:
    """A bitsandbytes 4-bit weight (``Linear4bit``'s state dict): the bytes ``data [ceil(n / 2), 1]`` of
    the flattened ``[R, C]`` weight, its ``absmax`` per ``block`` values (fp32, or 8-bit indices into
    ``nested``'s map and scales when double-quantized) and its ``quant_map`` (16 values)."""

    data: Stored
    absmax: Stored
    logical_shape: tuple[int, ...]
    quant_type: str
    block: int
    quant_map: tuple[float, ...]
    nested: tuple[Stored, Stored] | None = None  # nested_absmax, nested_quant_map
    nested_block: int = 256
    offset: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.logical_shape

    @property
    def stored(self) -> tuple[Stored, ...]:
        return (self.data, self.absmax, *(self.nested or ()))

    def absmax_of(self, opener: Opener, first: int, stop: int) -> torch.Tensor:
        """The fp32 absmax of blocks ``first .. stop - 1``."""
        if self.nested is None:
            return opener.read(self.absmax, (slice(first, stop),)).to(torch.float32)
        scales, table = self.nested
        start = first // self.nested_block * self.nested_block  # from the first block of a nested block
        indices = opener.read(self.absmax, (slice(start, stop),))
        grid = opener.read(scales, (slice(start // self.nested_block, -(-stop // self.nested_block)),))
        nested_map = opener.read(table, (slice(0, table.shape[0]),))
        return bnb_nested_absmax(indices, grid, nested_map, self.nested_block, self.offset)[first - start :]

    def read(self, opener: Opener, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = box
        width, total = self.logical_shape[-1], math.prod(self.logical_shape)
        first, stop = rows.start * width, rows.stop * width  # the flat values of the rows read
        b0, b1 = first // self.block, -(-stop // self.block)
        e0, e1 = b0 * self.block, min(b1 * self.block, total)  # the whole blocks covering them
        packed = opener.read(self.data, (slice(e0 // 2, -(-e1 // 2)), slice(0, 1))).reshape(-1)
        table = torch.tensor(self.quant_map, dtype=torch.float32)
        values = dequantize_bnb4(packed, self.absmax_of(opener, b0, b1), table, self.block)
        return values[first - e0 : stop - e0].reshape(-1, width)[:, cols].to(dtype)


@dataclass(frozen=True)
class GPTQ:
    """A GPTQ linear weight ``[out, in]`` (``moe.quantized``): ``qweight``, ``qzeros``, ``scales`` and
    ``g_idx`` (``None``: input ``i`` in group ``i // group``), ``bits`` a value, the zero points stored
    less one unless ``gptq_v2``."""

    qweight: Stored
    qzeros: Stored
    scales: Stored
    g_idx: Stored | None
    bits: int
    group: int
    stored_minus_one: bool

    @property
    def shape(self) -> tuple[int, ...]:
        rows, out = self.qweight.shape
        return (out, rows * 32 // self.bits)

    @property
    def stored(self) -> tuple[Stored, ...]:
        return (self.qweight, self.qzeros, self.scales, *((self.g_idx,) if self.g_idx else ()))

    def read(self, opener: Opener, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        outs, ins = box
        per = 32 // self.bits  # values an int32
        k0, j0 = ins.start // per, outs.start // per
        packed = opener.read(self.qweight, (slice(k0, -(-ins.stop // per)), outs))
        q = unpack_int32(packed, self.bits, 0)[ins.start - k0 * per : ins.stop - k0 * per]  # [in, out]
        groups_count = self.scales.shape[0]
        zeros = opener.read(self.qzeros, (slice(0, groups_count), slice(j0, -(-outs.stop // per))))
        zeros = unpack_int32(zeros, self.bits, 1)[:, outs.start - j0 * per : outs.stop - j0 * per]
        scales = opener.read(self.scales, (slice(0, groups_count), outs))
        if self.g_idx is not None:
            groups = opener.read(self.g_idx, (ins,))
        else:
            groups = torch.arange(ins.start, ins.stop) // self.group
        return dequantize_grouped_int(q, zeros, scales, groups, self.stored_minus_one, self.bits).to(dtype)


@dataclass(frozen=True)
class AWQ:
    """An AWQ linear weight ``[out, in]`` (``moe.quantized``; ``version: "gemm"``): ``qweight``,
    ``qzeros`` and ``scales``, in groups of ``group`` input features."""

    qweight: Stored
    qzeros: Stored
    scales: Stored
    group: int

    @property
    def shape(self) -> tuple[int, ...]:
        inputs, packed = self.qweight.shape
        return (packed * 8, inputs)

    @property
    def stored(self) -> tuple[Stored, ...]:
        return (self.qweight, self.qzeros, self.scales)

    def read(self, opener: Opener, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        outs, ins = box
        j0, j1 = outs.start // 8, -(-outs.stop // 8)
        g0, g1 = ins.start // self.group, -(-ins.stop // self.group)
        take = slice(outs.start - 8 * j0, outs.stop - 8 * j0)
        q = unpack_awq(opener.read(self.qweight, (ins, slice(j0, j1))))[:, take]
        zeros = unpack_awq(opener.read(self.qzeros, (slice(g0, g1), slice(j0, j1))))[:, take]
        scales = opener.read(self.scales, (slice(g0, g1), outs))
        groups = torch.arange(ins.start, ins.stop) // self.group - g0
        return dequantize_grouped_int(q, zeros, scales, groups, False, 4).to(dtype)


Encoded = Plain | BlockFP8 | MXFP4 | BNB4 | GPTQ | AWQ


__all__ = ["AWQ", "BNB4", "GPTQ", "MXFP4", "BlockFP8", "Encoded", "Plain"]
