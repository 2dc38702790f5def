"""The quantized weight formats that publishers ship, dequantized one block of a tensor at a time.

- **FP8, block-scaled** (DeepSeek-V3/R1; transformers' ``FineGrainedFP8Config``): a
  ``float8_e4m3fn`` weight ``[..., R, C]`` beside ``weight_scale_inv [..., ceil(R/br), ceil(C/bc)]``,
  one scale per ``br x bc`` block (``weight_block_size``; the last blocks may be partial). The value
  is ``w[r, c] * scale_inv[r // br, c // bc]``; scales are fp32/bf16 or E8M0 exponents.
- **MXFP4** (GPT-OSS's experts; ``Mxfp4Config``): ``<name>_blocks uint8 [..., out, G, 16]``, two
  E2M1 values per byte (low nibble first), and ``<name>_scales uint8 [..., out, G]``, one E8M0
  exponent per 32 values; transformers keeps the result transposed, ``[..., in, out]``.

Both take the stored slice covering the wanted block and return exactly that block, the products
computed in fp32 as transformers computes them, then cast to ``dtype``.
"""

from __future__ import annotations

import torch

#: The 16 values of an E2M1 nibble (sign bit, two exponent bits, one mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per E8M0 scale


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: E8M0 (``float8_e8m0fnu``, or ``uint8`` exponent bytes) as ``2^(s - 127)``."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], first: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The block ``[..., r0 : r0 + Lr, c0 : c0 + Lc]`` of a block-scaled FP8 weight, dequantized to
    ``[..., Lr, Lc]`` in ``dtype``, from its stored values ``weight [..., Lr, Lc]`` and ``scale_inv``,
    the grid's scales from row ``r0 // br`` and column ``c0 // bc`` on (``block = (br, bc)``,
    ``first = (r0, c0)``).
    """
    (br, bc), (r0, c0) = block, first
    rows, cols = weight.shape[-2:]
    scale = scale_values(scale_inv).repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    top, left = r0 - (r0 // br) * br, c0 - (c0 // bc) * bc
    scale = scale[..., top : top + rows, left : left + cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks uint8 [..., G, 16]`` and ``scales uint8 [..., G]`` as values ``[..., 32 G]`` in
    ``dtype``, in the stored orientation: value ``2 i`` of a group is byte ``i``'s low nibble, times
    ``2^(scale - 127)``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(
            f"dequantize_mxfp4: blocks {list(blocks.shape)} and scales {list(scales.shape)} do not form MXFP4 "
            f"groups ([..., G, {MXFP4_GROUP // 2}] and [..., G])."
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    packed = blocks.to(torch.uint8).long()
    values = torch.stack((lut[packed & 0x0F], lut[packed >> 4]), dim=-1)  # [..., G, 16, 2]
    values = values.reshape(*blocks.shape[:-1], MXFP4_GROUP)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)


__all__ = ["E2M1_VALUES", "MXFP4_GROUP", "dequantize_fp8_block", "dequantize_mxfp4", "scale_values"]
