"""The quantized weight formats that publishers ship, dequantized one block of a tensor at a time.

- **FP8, block-scaled** (DeepSeek-V3/R1, Qwen3's FP8 releases; transformers' ``FineGrainedFP8Config``):
  a ``float8_e4m3fn`` weight ``[..., R, C]`` beside ``weight_scale_inv [..., ceil(R/br), ceil(C/bc)]``,
  one scale per ``br x bc`` block (``weight_block_size``; the last blocks may be partial). The value
  is ``w[r, c] * scale_inv[r // br, c // bc]``; scales are fp32/bf16 or E8M0 exponents. The same
  formula serves the FP8 weights that llm-compressor (``compressed-tensors``), AutoFP8, ModelOpt and
  FBGEMM write with a ``weight_scale`` (a multiplier despite the name): one scale per tensor (the
  block is the whole matrix), per output row (blocks of ``1 x C``), per group or per block.
- **MXFP4** (GPT-OSS's experts; ``Mxfp4Config``): ``<name>_blocks uint8 [..., out, G, 16]``, two
  E2M1 values per byte (low nibble first), and ``<name>_scales uint8 [..., out, G]``, one E8M0
  exponent per 32 values; transformers keeps the result transposed, ``[..., in, out]``.

- **NF4** (QLoRA's 4-bit NormalFloat, as bitsandbytes and torchao define its 16 values): weights
  kept frozen (``moe.experts.frozen``), one fp32 ``absmax`` per 64 values along the input features,
  two value indices a byte (low nibble first).
- **GPTQ** (AutoGPTQ / GPTQModel releases, ``quant_method: "gptq"``): a linear weight ``[out, in]``
  as ``qweight int32 [in * bits / 32, out]`` (``32 / bits`` values of ``bits`` bits an int32 along
  ``in``, lowest bits first), ``qzeros int32 [groups, out * bits / 32]`` packed likewise along ``out``,
  ``scales [groups, out]`` and ``g_idx [in]`` (each input feature's group; a permutation's groups
  under act-order); ``w[o, i] = scales[g, o] * (q[i, o] - z[g, o])`` with ``g = g_idx[i]``, where the
  original (``checkpoint_format: "gptq"``) layout stores ``z - 1`` (``z = (stored + 1) mod 2^bits``)
  and ``"gptq_v2"`` stores ``z``.
- **AWQ** (AutoAWQ's ``version: "gemm"`` releases): ``qweight int32 [in, out / 8]``, 4-bit values
  packed along ``out`` in the order ``AWQ_ORDER`` (nibble ``k`` of an int32 holds output
  ``8 c + AWQ_ORDER[k]``), ``qzeros int32 [in / group, out / 8]`` likewise, ``scales [in / group, out]``;
  ``w[o, i] = (q[i, o] - z[g, o]) * scales[g, o]`` with ``g = i // group``.
- **bitsandbytes 4-bit** (``load_in_4bit`` releases, as ``Linear4bit`` saves them): a weight
  ``[R, C]`` flattened and cut into blocks of ``blocksize`` values, two 4-bit indices a byte (the
  first value in the high nibble), each value ``quant_map[index] * absmax[block]``; with double
  quantization the absmax are themselves 8-bit indices: ``nested_quant_map[i] * nested_absmax[block
  of 256] + offset``, in fp32. NF4's ``quant_map`` is the NF4 table above.

The dequantizers take the stored slice covering the wanted block and return exactly that block, the
products computed in fp32 as transformers computes them, then cast to ``dtype``. The quantizers, for
weights published in higher precision and kept frozen in a low-precision format
(``moe.experts.frozen``): ``quantize_fp8`` follows transformers' ``Fp8Quantize`` (scale ``448 / amax``
per block); ``quantize_mxfp4`` the OCP MX rule (shared exponent ``floor(log2(amax)) - 2``, elements
rounded to the nearest E2M1 value, ties to the even one, magnitudes above 6 clamped), which neither
transformers (its MXFP4 quantizer needs the GPU ``triton_kernels`` package) nor torch offers on CPU.
"""

from __future__ import annotations

import torch

#: The 16 values of an E2M1 nibble (sign bit, two exponent bits, one mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per E8M0 scale
#: The 16 NF4 values (QLoRA's quantiles of N(0, 1) scaled to [-1, 1], with an exact 0; bitsandbytes' table).
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_GROUP = 64  # values per fp32 absmax, QLoRA's block size
FP8_BLOCK = (128, 128)  # rows and columns per scale, as DeepSeek-V3 ships its weights
FP8_MAX = 448.0  # the largest float8_e4m3fn value


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
    scale = scale_values(scale_inv)
    if scale.numel() == 1:  # one scale for the whole tensor, stored as a scalar or [1]
        scale = scale.reshape([1] * weight.ndim)
    device = scale.device
    row_block = torch.arange(r0, r0 + rows, device=device) // br - r0 // br  # each row's scale row in the slice
    col_block = torch.arange(c0, c0 + cols, device=device) // bc - c0 // bc
    scale = scale.index_select(-2, row_block).index_select(-1, col_block)
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
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    packed = blocks.to(torch.uint8).long()
    values = torch.stack((lut[packed & 0x0F], lut[packed >> 4]), dim=-1)  # [..., G, 16, 2]
    values = values.reshape(*blocks.shape[:-1], MXFP4_GROUP)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)


def dequantize_bnb4(packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, block: int) -> torch.Tensor:
    """bitsandbytes' 4-bit ``packed`` bytes (first value in the high nibble) as fp32 values, flat: value
    ``i`` is ``quant_map[index] * absmax[i // block]``, from the first value of a block on."""
    indices = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(-1).long()
    values = quant_map.to(torch.float32)[indices]
    scales = absmax.to(torch.float32).repeat_interleave(block)[: values.numel()]
    return values[: scales.numel()] * scales


def bnb_nested_absmax(
    indices: torch.Tensor, nested_absmax: torch.Tensor, nested_map: torch.Tensor, nested_block: int, offset: float
) -> torch.Tensor:
    """bitsandbytes' double-quantized block scales in fp32 (``indices`` from a multiple of
    ``nested_block`` on): ``nested_map[index] * nested_absmax[i // nested_block] + offset``."""
    values = nested_map.to(torch.float32)[indices.long()]
    scales = nested_absmax.to(torch.float32).repeat_interleave(nested_block)[: values.numel()]
    return values * scales + torch.tensor(offset, dtype=torch.float32)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``32 / bits`` unsigned values of ``bits`` bits in each int32 of ``packed`` (lowest bits
    first), laid out along ``dim`` (``packed.shape[dim] * 32 / bits`` of them), as int64."""
    dim = dim % packed.ndim
    shifts = torch.arange(0, 32, bits, device=packed.device).view(-1, *([1] * (packed.ndim - dim - 1)))
    values = (packed.to(torch.int64).unsqueeze(dim + 1) >> shifts) & (2**bits - 1)
    return values.flatten(dim, dim + 1)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output of each nibble of an AWQ int32, lowest bits first


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's 4-bit values ``[..., 8 n]`` from ``packed int32 [..., n]``, in output order."""
    values = unpack_int32(packed, 4, -1).unflatten(-1, (-1, 8))
    inverse = torch.tensor(AWQ_ORDER, device=packed.device).argsort()
    return values[..., inverse].flatten(-2)


def dequantize_grouped_int(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor, stored_minus_one: bool, bits: int
) -> torch.Tensor:
    """GPTQ's and AWQ's values ``[out, in]`` in fp32 from unpacked ``q [in, out]``, zero points
    ``zeros [G, out]`` (as stored: ``z - 1`` when ``stored_minus_one``), ``scales [G, out]`` and each
    input's group ``groups [in]``: ``scales[g, o] * (q[i, o] - z[g, o])``."""
    if stored_minus_one:
        zeros = (zeros + 1) & (2**bits - 1)
    index = groups.long()
    return (scales.to(torch.float32)[index] * (q - zeros[index]).to(torch.float32)).t()


def nibbles_swapped(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` uint8 with each byte's two 4-bit halves exchanged (bitsandbytes' order <-> ours)."""
    return (packed << 4) | (packed >> 4)


@torch.no_grad()
def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data float8_e4m3fn [..., R, C], scale_inv float32 [..., ceil(R/br), ceil(C/bc)])`` of ``w``:
    each block divided by ``amax / 448`` (a block of zeros by 1), rounded to the nearest e4m3 value."""
    br, bc = block
    rows, cols = w.shape[-2:]
    grid_r, grid_c = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(*w.shape[:-2], grid_r * br, grid_c * bc, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    tiles = padded.unflatten(-1, (grid_c, bc)).unflatten(-3, (grid_r, br))  # [..., gr, br, gc, bc]
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    data = (tiles * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    data = data.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].contiguous()
    return data, (1.0 / scale).to(torch.float32)


@torch.no_grad()
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks uint8 [..., G, 16], scales uint8 [..., G])`` of ``w [..., 32 G]`` (groups of 32 along
    the last dim): the OCP MX rule of the module docstring."""
    if w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4: the last dim of {list(w.shape)} must be a multiple of {MXFP4_GROUP}.")
    groups = w.to(torch.float32).unflatten(-1, (-1, MXFP4_GROUP))  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2, -127.0)
    exponent = exponent.clamp(-127, 127)
    scaled = torch.ldexp(groups, -exponent.to(torch.int32)[..., None]).clamp(-6.0, 6.0)
    positive = torch.tensor(E2M1_VALUES[:8], device=w.device)  # 0, 0.5, ..., 6: codes 0-7
    distance = (scaled.abs()[..., None] - positive).abs()  # [..., G, 32, 8]
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    odd = torch.arange(8, device=w.device) % 2  # odd codes have mantissa 1: a tie goes to the even code
    code = torch.argmin(torch.where(nearest, odd, 2), dim=-1)
    code = code + 8 * (scaled < 0).to(code.dtype) * (code > 0).to(code.dtype)  # sign bit; +0 for zeros
    pairs = code.to(torch.uint8).unflatten(-1, (MXFP4_GROUP // 2, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NF4 ``codes uint8 [..., G, 32]`` and ``absmax float32 [..., G]`` as values ``[..., 64 G]`` in
    ``dtype``: value ``2 i`` of a group is byte ``i``'s low nibble's NF4 value, times the group's
    ``absmax``, in fp32."""
    if codes.shape[:-1] != absmax.shape or codes.shape[-1] != NF4_GROUP // 2:
        raise ValueError(
            f"dequantize_nf4: codes {list(codes.shape)} and absmax {list(absmax.shape)} do not form NF4 groups "
            f"([..., G, {NF4_GROUP // 2}] and [..., G])."
        )
    lut = torch.tensor(NF4_VALUES, dtype=torch.float32, device=codes.device)
    packed = codes.long()
    values = torch.stack((lut[packed & 0x0F], lut[packed >> 4]), dim=-1)  # [..., G, 32, 2]
    values = values.reshape(*codes.shape[:-1], NF4_GROUP) * absmax.to(torch.float32).unsqueeze(-1)
    return values.reshape(*codes.shape[:-2], -1).to(dtype)


@torch.no_grad()
def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [..., G, 32], absmax float32 [..., G])`` of ``w [..., 64 G]`` (groups of 64 along
    the last dim): each group divided by its largest magnitude (a group of zeros by 1) and every value
    given the index of the nearest NF4 value (the lower index on a tie)."""
    if w.shape[-1] % NF4_GROUP:
        raise ValueError(f"quantize_nf4: the last dim of {list(w.shape)} must be a multiple of {NF4_GROUP}.")
    groups = w.to(torch.float32).unflatten(-1, (-1, NF4_GROUP))  # [..., G, 64]
    absmax = groups.abs().amax(dim=-1)
    scaled = groups / torch.where(absmax > 0, absmax, 1.0).unsqueeze(-1)
    table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=w.device)
    code = torch.argmin((scaled.unsqueeze(-1) - table).abs(), dim=-1)  # the first of equal distances
    pairs = code.to(torch.uint8).unflatten(-1, (NF4_GROUP // 2, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous(), absmax


__all__ = [
    "AWQ_ORDER",
    "E2M1_VALUES",
    "FP8_BLOCK",
    "MXFP4_GROUP",
    "NF4_GROUP",
    "NF4_VALUES",
    "bnb_nested_absmax",
    "dequantize_bnb4",
    "dequantize_fp8_block",
    "dequantize_grouped_int",
    "dequantize_mxfp4",
    "dequantize_nf4",
    "nibbles_swapped",
    "quantize_fp8",
    "quantize_mxfp4",
    "quantize_nf4",
    "scale_values",
    "unpack_awq",
    "unpack_int32",
]
