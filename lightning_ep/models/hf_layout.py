"""Where each weight of a Hugging Face model lives in a published folder, and how it is encoded.

Resolved from the folder's safetensors headers alone (no tensor data is read):

- **Names and fusion**, by transformers' own conversion rules for the model
  (``get_model_conversion_mapping``): its renamings (Mixtral's ``block_sparse_moe`` -> ``mlp``) and
  its converters that stack per-expert matrices (``MergeModulelist(dim=0)``) and concatenate gate
  and up (``Concatenate(dim=1)``).
- **Encodings** (``hf_encodings``, chosen by ``hf_formats``): plain, scaled FP8 (per tensor, row,
  group or block), MXFP4, bitsandbytes 4-bit, GPTQ, AWQ; a folder quantized otherwise (bitsandbytes'
  8-bit, packed int4 or NVFP4, ...) is refused by name.
- **Keys the model does not use** and transformers ignores: multi-token-prediction layers past
  ``num_hidden_layers`` (DeepSeek-V3, GLM-4.5/4.6), the class's ``_keys_to_ignore_on_load_unexpected``,
  and a static FP8 scheme's activation and KV-cache scales.

The result maps every state-dict name to a ``Whole`` stored tensor or to ``Stacked`` per-expert
parts; ``hf_io.load_pretrained_sharded`` reads from it only the blocks a rank holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from lightning_ep.models.hf_encodings import Encoded
from lightning_ep.models.hf_formats import check_readable, encode
from lightning_ep.models.hf_stored import quantization_config, stored_tensors


@dataclass(frozen=True)
class Whole:
    """A state-dict tensor stored whole under one key."""

    source: Encoded


@dataclass(frozen=True)
class Stacked:
    """A fused expert weight ``[E, R, C]`` stored per expert: ``parts[e]`` stacked on rows is ``[e]``."""

    parts: tuple[tuple[Encoded, ...], ...]


Source = Whole | Stacked


@dataclass
class FolderLayout:
    """The folder's weights arranged by the model's state-dict names."""

    folder: Path
    sources: dict[str, Source]
    ignored: dict[str, list[str]] = field(default_factory=dict)  # reason -> folder keys
    unmatched: list[str] = field(default_factory=list)  # folder keys that belong to no parameter

    def ignored_line(self) -> str | None:
        """One short line naming what the folder holds that the model does not use, or ``None``."""
        if not self.ignored:
            return None
        parts = [f"{len(keys)} {reason} (e.g. {keys[0]!r})" for reason, keys in self.ignored.items()]
        total = sum(len(keys) for keys in self.ignored.values())
        head = f"load_pretrained_sharded: ignored {total} weights of {self.folder} that the model does not use"
        return f"{head}, as transformers does: {'; '.join(parts)}."


@dataclass(frozen=True)
class _Rules:
    """transformers' conversion rules for one model, split as its loader applies them."""

    renamings: tuple[Any, ...]
    converters: tuple[Any, ...]
    base_prefix: str

    @classmethod
    def of(cls, hf_model: nn.Module) -> _Rules:
        from transformers import PreTrainedModel

        if not isinstance(hf_model, PreTrainedModel):
            return cls((), (), "")
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        transforms = get_model_conversion_mapping(hf_model)
        converters = tuple(t for t in transforms if isinstance(t, WeightConverter))
        renamings = tuple(t for t in transforms if not isinstance(t, WeightConverter))
        return cls(renamings, converters, str(getattr(hf_model, "base_model_prefix", "")))

    def target(self, key: str, names: Mapping[str, Any]) -> tuple[str, tuple[int, int] | None]:
        """``key``'s state-dict name and, for a per-expert key that a converter fuses, its
        ``(expert, part)``; ``None`` for a key stored whole."""
        for renaming in self.renamings:
            key, _ = renaming.rename_source_key(key)
        name, where = key, None
        for converter in self.converters:
            fused, pattern = converter.rename_source_key(key)
            if pattern is not None:
                name, where = fused, _expert_and_part(key, converter, pattern)
                break
        if self.base_prefix and name not in names:  # a base-model folder in a head model, or the reverse
            with_prefix, without = f"{self.base_prefix}.{name}", name.removeprefix(self.base_prefix + ".")
            name = with_prefix if with_prefix in names else without if without in names else name
        return name, where


def _expert_and_part(key: str, converter: Any, pattern: str) -> tuple[int, int]:
    """The expert and part of a per-expert key, once the converter is checked to only stack and concatenate."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])]
    if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        raise ValueError(
            f"load_pretrained_sharded: the folder's {key!r} is converted by transformers with {ops}, which this "
            "loader does not apply (it stacks per-expert matrices and concatenates their parts on rows); load the "
            "folder with transformers and save it with save_pretrained first."
        )
    found = re.search(pattern.replace("*.", r"(\d+)\."), key)
    if found is None:
        raise ValueError(
            f"load_pretrained_sharded: cannot find the expert index of {key!r} in transformers' pattern {pattern!r}."
        )
    return int(found.group(1)), list(converter.source_patterns).index(pattern)


def _ignorable(name: str, hf_model: nn.Module) -> str | None:
    """Why transformers ignores a folder key the model has no parameter for, or ``None``."""
    patterns = list(getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(re.search(p, name) for p in [*patterns, r"rotary_emb\.inv_freq"]):
        return f"weights {type(hf_model).__name__} lists in _keys_to_ignore_on_load_unexpected"
    config = getattr(hf_model, "config", None)
    mtp = getattr(config, "num_nextn_predict_layers", None) or getattr(config, "num_mtp_layers", None) or 0
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if mtp and layer is not None and int(layer.group(1)) >= int(getattr(config, "num_hidden_layers", 0)):
        return "multi-token-prediction weights"
    return None


def layout(hf_model: nn.Module, folder: Path, names: Iterable[str]) -> FolderLayout:
    """Map the folder's weights onto ``names`` (state-dict names of ``hf_model``, PEFT prefixes removed);
    ``ValueError`` for a folder without safetensors weights, scales that do not fit their weight, a
    conversion this loader does not apply, or per-expert parts with gaps."""
    wanted = dict.fromkeys(names)
    quant = quantization_config(folder)
    check_readable(quant, folder)
    encoded, activation_scales = encode(stored_tensors(folder), quant)
    rules = _Rules.of(hf_model)
    result = FolderLayout(folder, {})
    if activation_scales:
        result.ignored["static FP8 activation scales"] = activation_scales
    experts: dict[str, dict[int, dict[int, Encoded]]] = {}
    for key, value in encoded.items():
        name, where = rules.target(key, wanted)
        if name not in wanted:
            reason = _ignorable(name, hf_model)
            if reason is None:
                result.unmatched.append(key)
            else:
                result.ignored.setdefault(reason, []).append(key)
        elif where is None:
            result.sources[name] = Whole(value)
        else:
            expert, part = where
            experts.setdefault(name, {}).setdefault(expert, {})[part] = value
    for name, by_expert in experts.items():
        count, parts = max(by_expert) + 1, max(len(p) for p in by_expert.values())
        gaps = [(e, p) for e in range(count) for p in range(parts) if p not in by_expert.get(e, {})]
        if gaps:
            raise ValueError(
                f"load_pretrained_sharded: {folder} stores {name!r} per expert but part {gaps[0][1]} of expert "
                f"{gaps[0][0]} is missing; the folder is incomplete or saved from another model."
            )
        result.sources[name] = Stacked(tuple(tuple(by_expert[e][p] for p in range(parts)) for e in range(count)))
    return result


def source_shape(source: Source) -> tuple[int, ...]:
    """The shape the model sees: a whole tensor's, or ``[E, sum of part rows, C]``."""
    if isinstance(source, Whole):
        return source.source.shape
    first = source.parts[0]
    return (len(source.parts), sum(p.shape[0] for p in first), *first[0].shape[1:])


def source_keys(source: Source) -> list[str]:
    """The folder keys a source reads."""
    encoded = [source.source] if isinstance(source, Whole) else [p for parts in source.parts for p in parts]
    return [stored.key for value in encoded for stored in value.stored]


__all__ = ["FolderLayout", "Source", "Stacked", "Whole", "layout", "source_keys", "source_shape"]
