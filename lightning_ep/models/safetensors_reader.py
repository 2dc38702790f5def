"""Read rectangular blocks of tensors from safetensors files with plain positioned reads.

Why not ``safe_open(...).get_slice``: it memory-maps the file, and on current kernels a page
fault maps a whole page-cache folio (measured: a 64 KiB slice put 4 MiB of neighbouring weights
into the process's resident memory). Reading with ``readinto`` puts exactly the requested bytes
in this process's memory; the kernel's ``/proc/self/io`` ``rchar`` counts them.

The format: 8 bytes little-endian header length ``n``, ``n`` bytes of JSON
``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data
(row-major, little-endian), offsets relative to byte ``8 + n``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from io import FileIO
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, global shape and absolute data offset in bytes."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (reads only its header)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(
                f"{path}: tensor {key!r} has dtype {info['dtype']!r}, which this reader does not know; "
                f"known: {sorted(DTYPES)}."
            )
        offset = 8 + size + info["data_offsets"][0]
        entries[key] = TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]), offset)
    return entries


def read_block(f: FileIO, entry: TensorEntry, box: tuple[slice, ...]) -> torch.Tensor:
    """``tensor[box]`` read from the open file ``f`` (``box``: one ``slice(start, stop)`` per dim).

    Trailing dims the box covers whole join the last partial dim into one contiguous run, so a
    block of whole rows is a single read; the result is a new contiguous CPU tensor.
    """
    shape = entry.shape
    out = torch.empty([s.stop - s.start for s in box], dtype=entry.dtype)
    if out.numel() == 0:
        return out
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]  # row-major, in elements
    partial = len(shape) - 1
    while partial > 0 and box[partial].start == 0 and box[partial].stop == shape[partial]:
        partial -= 1
    starts: Iterable[int]
    if shape:
        run = (box[partial].stop - box[partial].start) * strides[partial]
        starts = (
            sum(i * s for i, s in zip(index, strides)) + box[partial].start * strides[partial]
            for index in itertools.product(*(range(s.start, s.stop) for s in box[:partial]))
        )
    else:  # a 0-dim tensor
        run, starts = 1, iter([0])
    itemsize = entry.dtype.itemsize
    buffer = out.view(-1).view(torch.uint8).numpy().data  # the tensor's own bytes
    run_bytes = run * itemsize
    for i, start in enumerate(starts):
        _read_exactly(f, entry.offset + start * itemsize, buffer[i * run_bytes : (i + 1) * run_bytes])
    return out


def _read_exactly(f: FileIO, position: int, into: memoryview) -> None:
    f.seek(position)
    done = 0
    while done < len(into):  # one read may return fewer bytes (e.g. above 2 GiB on Linux)
        count = f.readinto(into[done:])
        if not count:
            raise EOFError(f"{f.name}: file ends at byte {position + done}; it is truncated.")
        done += count
