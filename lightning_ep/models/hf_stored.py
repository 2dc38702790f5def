"""How a Hugging Face folder stores its tensors: ``Stored`` (a tensor's file, key, shape and dtype,
from the safetensors headers), ``Opener`` (reads a block of one, memory-mapped), the folder's
``quantization_config``. The encodings read from them are in ``hf_encodings``, which keys form which
encoding in ``hf_formats``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


__all__ = ["Opener", "Stored", "quantization_config", "stored_tensors"]
