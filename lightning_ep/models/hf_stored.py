"""How a Hugging Face folder stores its tensors (``Stored``), read one block at a time (``Opener``),
and their encodings (``Plain``, ``BlockFP8``, ``MXFP4``; the formats are in ``moe.quantized``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_ep.moe.quantized import MXFP4_GROUP, dequantize_fp8_block, dequantize_mxfp4

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FP8_SCALE = "_scale_inv"  # a weight `x.weight` has its scales at `x.weight_scale_inv`
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# Static-FP8 companions of a weight that a dequantized model has no use for.
ACTIVATION_SCALES = (".input_scale", ".activation_scale")


@dataclass(frozen=True)
class Stored:
    """One tensor of the folder: its file, key, shape and safetensors dtype name (``"F8_E4M3"``)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str


class Opener:
    """Reads blocks of stored tensors with ``safe_open(...).get_slice`` (memory-mapped). A file stays
    open until the bytes read through it pass ``MAPPED_BYTES`` or another file is read; closing it
    unmaps the pages read, so a rank holds at most about ``MAPPED_BYTES`` of the folder at a time."""

    MAPPED_BYTES = 256 << 20

    def __init__(self) -> None:
        self._file: Path | None = None
        self._manager: Any = None
        self._handle: Any = None
        self._read = 0

    def read(self, stored: Stored, box: tuple[slice, ...]) -> torch.Tensor:
        """A copy of ``tensor[box]`` (``box``: one ``slice(start, stop)`` per dim)."""
        if self._file != stored.file or self._read > self.MAPPED_BYTES:
            self.close()
            from safetensors import safe_open

            self._manager = safe_open(str(stored.file), framework="pt")
            self._handle, self._file = self._manager.__enter__(), stored.file
        view = self._handle.get_slice(stored.key)
        block = view[...] if not stored.shape else view[box]
        self._read += block.numel() * block.element_size()
        return block

    def close(self) -> None:
        if self._manager is not None:
            self._manager.__exit__(None, None, None)
        self._file, self._manager, self._handle, self._read = None, None, None, 0


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
        grid = (*box[:-2], slice(rows.start // br, -(-rows.stop // br)), slice(cols.start // bc, -(-cols.stop // bc)))
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


Encoded = Plain | BlockFP8 | MXFP4


def stored_tensors(folder: Path) -> dict[str, Stored]:
    """Key -> ``Stored`` for every tensor of the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    if (folder / INDEX_FILE).is_file():
        names = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
    elif (folder / SINGLE_FILE).is_file():
        names = [SINGLE_FILE]
    else:
        raise ValueError(
            f"load_pretrained_sharded(folder={str(folder)!r}): the folder holds neither {SINGLE_FILE} nor "
            f"{INDEX_FILE}; pass a Hugging Face model folder (safetensors weights)."
        )
    tensors: dict[str, Stored] = {}
    for name in names:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                view = f.get_slice(key)
                tensors[key] = Stored(folder / name, key, tuple(view.get_shape()), view.get_dtype())
    return tensors


def quantization_config(folder: Path) -> dict[str, Any]:
    """The ``quantization_config`` of the folder's ``config.json`` (empty when there is none)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return {}
    return dict(json.loads(config_file.read_text()).get("quantization_config") or {})


def encode(tensors: Mapping[str, Stored], quant: Mapping[str, Any]) -> tuple[dict[str, Encoded], list[str]]:
    """The folder's tensors as logical values, each weight with its scales under the weight's key
    (``x.weight`` for ``x.weight`` + ``x.weight_scale_inv``), and the unused static activation scales."""
    encoded: dict[str, Encoded] = {}
    activation_scales: list[str] = []
    block = quant.get("weight_block_size")
    for key, stored in tensors.items():
        if key.endswith(FP8_SCALE) and key[: -len(FP8_SCALE)] in tensors:
            continue  # read with its weight
        if key.endswith(MXFP4_SCALES) and key[: -len(MXFP4_SCALES)] + MXFP4_BLOCKS in tensors:
            continue
        if key.endswith(ACTIVATION_SCALES) and quant.get("quant_method") == "fp8":
            activation_scales.append(key)
        elif key.endswith(MXFP4_BLOCKS) and key[: -len(MXFP4_BLOCKS)] + MXFP4_SCALES in tensors:
            base = key[: -len(MXFP4_BLOCKS)]
            encoded[base] = MXFP4(stored, tensors[base + MXFP4_SCALES])
        elif key + FP8_SCALE in tensors:
            scale = tensors[key + FP8_SCALE]
            encoded[key] = BlockFP8(stored, scale, _fp8_block(stored, scale, block))
        else:
            encoded[key] = Plain(stored)
    return encoded, activation_scales


def _fp8_block(weight: Stored, scale: Stored, block: Any) -> tuple[int, int]:
    """The rows and columns one scale covers, checked against the stored grid."""
    if len(weight.shape) < 2:
        raise ValueError(
            f"load_pretrained_sharded: {weight.key!r} {list(weight.shape)} has scales {scale.key!r} but is not a "
            "matrix; block-scaled FP8 weights are [..., rows, cols]."
        )
    rows, cols = weight.shape[-2:]
    if math.prod(scale.shape) == 1:  # one scale for the whole tensor
        return rows, cols
    if block is None:
        raise ValueError(
            f"load_pretrained_sharded: {weight.key!r} has block scales {list(scale.shape)} but the folder's "
            "config.json has no quantization_config.weight_block_size; add the block size the weights were "
            'quantized with, e.g. "weight_block_size": [128, 128].'
        )
    br, bc = (int(b) for b in block)
    grid = (*weight.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"load_pretrained_sharded: {scale.key!r} is {list(scale.shape)} but {weight.key!r} "
            f"{list(weight.shape)} in blocks of {[br, bc]} needs a grid of {list(grid)}; the scales do not belong "
            "to this weight or weight_block_size is wrong."
        )
    return br, bc


__all__ = [
    "MXFP4",
    "BlockFP8",
    "Encoded",
    "Opener",
    "Plain",
    "Stored",
    "encode",
    "quantization_config",
    "stored_tensors",
]
