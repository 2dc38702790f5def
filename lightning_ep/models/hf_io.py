"""Hugging Face checkpoints in and out of expert-parallel, FSDP2-sharded models.

- ``load_pretrained_sharded(model, folder)``: ``hf_layout`` maps the folder onto the model,
  ``hf_stored`` reads its tensors, ``quantized`` holds the formats.
- ``export_hf`` (``hf_export``): a live model, a Lightning checkpoint or a state dict, as a folder.

Legend: E experts, I expert intermediate size, H hidden size; a fused expert weight is
``[E, R, C]`` and may be stored per expert as parts ``[R_p, C]`` stacked along the rows.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_ep.models.hf_encodings import AWQ, BNB4, GPTQ, MXFP4, BlockFP8, Encoded
from lightning_ep.models.hf_export import LIBRARY_BUFFERS, PathLike, detect_prefix, export_hf
from lightning_ep.models.hf_layout import FolderLayout, Source, Stacked, Whole, layout, source_keys, source_shape
from lightning_ep.models.hf_stored import Opener
from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.quantized import NF4_GROUP, NF4_VALUES, nibbles_swapped, scale_values
from lightning_ep.parallel.mesh import local_block

# Rows of a block dequantized and copied at a time: bounds the transient fp32 copy of a large block.
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class _Read:
    """Copy the block ``box`` of the stored value ``source`` into ``dst`` (a view of a local shard)."""

    source: Encoded
    box: tuple[slice, ...]
    dst: torch.Tensor


@torch.no_grad()
def load_pretrained_sharded(model: nn.Module, folder: PathLike) -> nn.Module:
    """Fill a sharded model's weights from a Hugging Face folder, each rank reading only the blocks of
    the shards it holds (DTensors placed ``Shard`` / ``Replicate``, uneven shards included; plain
    tensors are filled whole, so one process works too).

    The folder may be laid out as its publisher ships it:

    - per-expert keys (Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``) or fused ones, named and
      fused by transformers' conversion rules for the model (``hf_layout``);
    - FP8 weights with ``weight_scale_inv`` or ``weight_scale`` (per tensor, row, group or block),
      MXFP4 experts (``*_blocks`` / ``*_scales``), bitsandbytes 4-bit weights (``*.absmax``,
      ``*.quant_state.*``) and GPTQ and AWQ layers (``*.qweight``, ``*.qzeros``, ``*.scales``, ``*.g_idx``),
      dequantized on the rank that owns the block into the model's dtype, at most ``CHUNK_BYTES`` of
      rows at a time (other quantized formats are refused by name: ``hf_formats.check_readable``);
    - weights transformers ignores for the architecture (multi-token-prediction layers, the class's
      ``_keys_to_ignore_on_load_unexpected``): skipped, and named in one warning on rank 0.

    Each rank reads exactly its local block of every parameter and persistent buffer (and the scales
    covering it; for a frozen expert weight quantized here, the whole FP8 blocks covering its rows:
    ``FrozenExpertWeight.value_region``) with ``safetensors``' ``get_slice``; its host memory holds
    the block being read and at most ``hf_stored.Opener.MAPPED_BYTES`` of mapped file pages, never a
    full tensor. No collective is called. Tied weights are read once; ``expert_bias`` buffers and PEFT
    LoRA factors keep their values.

    Args:
        model: a materialised Hugging Face model, sharded or not, transformed or not, PEFT's or not.
        folder: a Hugging Face folder (``model.safetensors``, or shards with
            ``model.safetensors.index.json``) of a model with the same config.
    Returns:
        ``model``, its weights equal to the folder's (dequantized).
    Raises:
        FileNotFoundError: ``folder`` is not a directory.
        ValueError: no safetensors weights in ``folder``; its ``config.json`` names another
            ``model_type`` or a quantization this loader does not read; a weight is missing, has
            another shape, or belongs to no parameter; scales that do not fit their weight; a
            parameter placed other than ``Shard``/``Replicate``.
        RuntimeError: the model is still on the meta device.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"load_pretrained_sharded(folder={str(folder)!r}): no such directory; pass a Hugging Face model "
            "folder (config.json and safetensors weights)."
        )
    config_file = folder / "config.json"
    mine = getattr(getattr(model, "config", None), "model_type", None)
    if mine is not None and config_file.is_file():
        theirs = json.loads(config_file.read_text()).get("model_type")
        if theirs is not None and theirs != mine:
            raise ValueError(
                f"load_pretrained_sharded: {config_file} has model_type={theirs!r} but the model is a "
                f"{mine!r} ({type(model).__name__}); pass a folder saved from a {mine} model."
            )
    tensors, frozen = _tensors_to_load(model)
    get_base_model = getattr(model, "get_base_model", None)  # PEFT's: its conversion rules and config apply
    hf_model = get_base_model() if callable(get_base_model) else model
    found = layout(hf_model, folder, [name for names, _ in [*tensors, *frozen] for name in names])
    reads = [read for names, tensor in tensors for read in _plan_tensor(names, tensor, found)]
    frozen_reads = [_plan_frozen(names[0], weight, found) for names, weight in frozen]
    requantized = [name for (name, _), (_, again) in zip(frozen, frozen_reads, strict=True) if again]
    if found.unmatched:
        unexpected = sorted(found.unmatched)
        raise ValueError(
            f"load_pretrained_sharded: {len(unexpected)} weights in {folder} match no parameter of the "
            f"{type(model).__name__}, e.g. {unexpected[:3]}; the folder was saved from a different model "
            f"(or a newer layout this transformers does not know). "
            f"Build the model from the folder's config: AutoConfig.from_pretrained({str(folder)!r})."
        )
    ignored = found.ignored_line()  # one warning, on rank 0, naming the folder's weights the model does not use
    rank_zero = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if ignored is not None and rank_zero:
        warnings.warn(ignored, stacklevel=2)
    if requantized and rank_zero:
        weight = frozen[0][1]
        warnings.warn(
            f"load_pretrained_sharded: {folder} stores {len(requantized)} expert weights (e.g. {requantized[0][0]!r}) "
            f"quantized otherwise than the model keeps them ({weight.format}"
            + (f", blocks of {list(weight.block)}" if weight.format == "fp8" else "")
            + "): they are dequantized and quantized again, and their values change by that rounding. Keep them "
            "as published with frozen_experts set to the folder's format.",
            stacklevel=2,
        )
    _read_all(reads)
    with closing(Opener()) as opener:
        for load, _ in frozen_reads:
            load(opener)
    return model


def _hf_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _tensors_to_load(
    model: nn.Module,
) -> tuple[list[tuple[list[str], torch.Tensor]], list[tuple[list[str], FrozenExpertWeight]]]:
    """State-dict entries grouped by tensor identity (tied weights: several names), without this
    library's buffers and LoRA factors, which Hugging Face folders do not have; a PEFT-wrapped model's
    names lose ``base_model.model.`` and ``base_layer``. Then the frozen expert weights kept quantized,
    under the name of the weight each holds."""
    library = {name for name, _ in model.named_buffers() if name.rpartition(".")[2] in LIBRARY_BUFFERS}
    frozen = [(name, m) for name, m in model.named_modules() if isinstance(m, FrozenExpertWeight)]
    library.update(f"{name}.{buffer}" for name, m in frozen for buffer, _ in m.named_buffers())
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        # A LoRA factor: ``q_proj.lora_A.default.weight``, an expert's ``gate_up_proj_lora_A``.
        adapter = any(part.startswith("lora_") or "_lora_" in part for part in name.split("."))
        if name in library or not isinstance(tensor, torch.Tensor) or adapter:
            continue
        groups.setdefault(id(tensor), ([], tensor))[0].append(_hf_name(name))
    return list(groups.values()), [([_hf_name(name)], m) for name, m in frozen]


def _plan_tensor(names: list[str], tensor: torch.Tensor, found: FolderLayout) -> list[_Read]:
    """The reads that fill this rank's block of ``tensor``; checks the stored shapes."""
    if tensor.is_meta:
        raise RuntimeError(
            f"load_pretrained_sharded: {names[0]!r} is on the meta device; allocate the model first "
            "with lightning_ep.models.init.materialize(model, device) (after transform and shard_model)."
        )
    local, offset = local_block(tensor, "load_pretrained_sharded", names[0])
    name = next((n for n in names if n in found.sources), None)
    if name is None:
        raise ValueError(
            f"load_pretrained_sharded: {found.folder} has no weight for the model's {names[0]!r} (looked for "
            f"{names} after transformers' renaming and fusion of the folder's keys); the folder was saved from "
            f"a different model. {_rebuild_hint(found.folder)}"
        )
    source = found.sources[name]
    box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
    if isinstance(source, Whole):
        if source.source.shape != tuple(tensor.shape):
            raise ValueError(
                f"load_pretrained_sharded: {source_keys(source)[0]!r} in {source.source.stored[0].file.name} has shape "
                f"{list(source.source.shape)} but the model's {name!r} is {list(tensor.shape)}; the model was "
                f"built from another config. {_rebuild_hint(found.folder)}"
            )
        return [_Read(source.source, box, local)]
    return _plan_experts(name, tuple(tensor.shape), local, box, source, found.folder)


def _plan_experts(
    name: str, shape: tuple[int, ...], local: torch.Tensor, box: tuple[slice, ...], source: Stacked, folder: Path
) -> list[_Read]:
    """Reads that fill the local block ``[Le, Lr, Lc]`` at ``box`` of a fused expert weight
    ``[E, R, C]`` from per-expert parts ``[R_p, C]`` (expert ``e`` = its parts stacked on rows)."""
    num_experts = shape[0]
    parts_shapes = [p.shape for p in source.parts[0]]
    stacked = source_shape(source)
    if len(source.parts) != num_experts:
        raise ValueError(
            f"load_pretrained_sharded: {folder} stores {name!r} for {len(source.parts)} experts (e.g. "
            f"{source_keys(source)[0]!r}) but the model's is {list(shape)}; it was saved from a model with "
            f"{'fewer' if len(source.parts) < num_experts else 'more'} experts. {_rebuild_hint(folder)}"
        )
    if stacked != tuple(shape) or any(len(s) != 2 for s in parts_shapes):
        keys = [part.stored[0].key for part in source.parts[0]]
        raise ValueError(
            f"load_pretrained_sharded: the per-expert weights {keys} have shapes {[list(s) for s in parts_shapes]}, "
            f"which stack to {list(stacked)}, but the model's {name!r} is {list(shape)}; the model was built "
            f"from another config. {_rebuild_hint(folder)}"
        )
    for parts in source.parts:
        if [p.shape for p in parts] != parts_shapes:
            raise ValueError(
                f"load_pretrained_sharded: the per-expert weights of {name!r} differ in shape between experts "
                f"({[list(p.shape) for p in parts]} vs {[list(s) for s in parts_shapes]}); the folder is damaged."
            )
    reads = []
    expert_box, row_box, col_box = box
    for e in range(expert_box.start, expert_box.stop):
        base = 0  # first row of this part inside expert e's [R, C]
        for part in source.parts[e]:
            part_rows = part.shape[0]
            lo, hi = max(row_box.start, base), min(row_box.stop, base + part_rows)
            if lo < hi:
                dst = local[e - expert_box.start, lo - row_box.start : hi - row_box.start]
                reads.append(_Read(part, (slice(lo - base, hi - base), col_box), dst))
            base += part_rows
    return reads


def _plan_frozen(name: str, weight: FrozenExpertWeight, found: FolderLayout) -> tuple[Callable[[Opener], None], bool]:
    """The load of this rank's experts of a frozen weight kept quantized: the folder's FP8 blocks, MXFP4
    bytes or bitsandbytes NF4 bytes (nibbles swapped) copied as they are when they are in the weight's
    format, else each expert read in fp32 (dequantized if stored so) and quantized, one expert at a
    time; and whether the folder stored them quantized otherwise (so that their values change)."""
    source = found.sources.get(name)
    if source is None:
        raise ValueError(
            f"load_pretrained_sharded: {found.folder} has no weight for the model's {name!r}; the folder was saved "
            f"from a different model. {_rebuild_hint(found.folder)}"
        )
    first = _frozen_first_expert(weight)
    held = weight.held()
    count = next(iter(held.values())).shape[0]
    _, rows, cols = weight.shape
    if isinstance(source, Whole) and source.source.shape != tuple(weight.shape):
        raise ValueError(
            f"load_pretrained_sharded: {source_keys(source)[0]!r} has shape {list(source.source.shape)} but the "
            f"model's {name!r} is {list(weight.shape)}; the model was built from another config. "
            f"{_rebuild_hint(found.folder)}"
        )
    raw = _raw_parts(source, weight)
    if raw is not None:

        def copy(opener: Opener) -> None:
            for e in range(count):
                for part, row0, part_rows in raw[first + e]:
                    _copy_raw(opener, part, weight, e, first + e, row0, part_rows)

        return copy, False
    # Each expert's rows (or columns) that this rank quantizes: all of them unless its bytes are split.
    dim, start, stop = weight.value_region()
    region = [slice(0, rows), slice(0, cols)]
    region[dim - 1] = slice(start, stop)
    device = next(iter(held.values())).device
    buffer = torch.empty(1, *(r.stop - r.start for r in region), dtype=torch.float32, device=device)
    plans = [
        _plan_experts(name, tuple(weight.shape), buffer, (slice(e, e + 1), *region), source, found.folder)
        if isinstance(source, Stacked)
        else [_Read(source.source, (slice(e, e + 1), *region), buffer)]
        for e in range(first, first + count)
    ]

    def quantize(opener: Opener) -> None:
        for e, reads in enumerate(plans):
            _read_all(reads)
            weight.store_(buffer, e)

    parts = [source.source] if isinstance(source, Whole) else [p for parts in source.parts for p in parts]
    return quantize, any(isinstance(p, (BlockFP8, MXFP4, BNB4, GPTQ, AWQ)) for p in parts)


def _frozen_first_expert(weight: FrozenExpertWeight) -> int:
    """The global index of this rank's first expert of ``weight``."""
    name, buffer = next(iter(weight.named_buffers()))
    return local_block(buffer, "load_pretrained_sharded", name)[1][0]


def _raw_parts(source: Source, weight: FrozenExpertWeight) -> list[list[tuple[Encoded, int, int]]] | None:
    """Per expert, ``(stored part, first row, rows)`` to copy as they are into ``weight``'s format, or
    ``None`` when the folder's encoding is not that format (or its blocks do not line up)."""
    experts: list[tuple[Encoded, ...]]
    if isinstance(source, Whole):
        experts = [(source.source,)] * weight.shape[0]
    else:
        experts = [tuple(parts) for parts in source.parts]
    out: list[list[tuple[Encoded, int, int]]] = []
    for parts in experts:
        row0, rows = 0, list[tuple[Encoded, int, int]]()
        for part in parts:
            part_rows = part.shape[-2]
            if weight.format == "fp8":
                aligned = row0 % weight.block[0] == 0 and (part_rows % weight.block[0] == 0 or part is parts[-1])
                if not (isinstance(part, BlockFP8) and part.data.dtype == "F8_E4M3"):  # the bytes the weight keeps
                    return None
                if not (_same_grid(part, weight.block) and aligned):
                    return None
            elif weight.format == "nf4":
                if not (isinstance(part, BNB4) and _nf4_as_ours(part)) or weight.transposed:
                    return None  # bitsandbytes' NF4 of [out, in] blocks of 64 along ``in`` is ours
            elif not (weight.format == "mxfp4" and isinstance(part, MXFP4) and isinstance(source, Whole)):
                return None
            elif not weight.transposed:  # GPT-OSS's [E, in, out] is the one MXFP4 layout published
                return None
            rows.append((part, row0, part_rows))
            row0 += part_rows
        out.append(rows)
    return out


def _nf4_as_ours(part: BNB4) -> bool:
    """Whether a bitsandbytes 4-bit matrix holds this library's NF4: the NF4 table, blocks of 64 that
    each lie within a row (bitsandbytes runs them over the flattened matrix)."""
    table = torch.tensor(NF4_VALUES, dtype=torch.float32).tolist()
    return (
        part.quant_type == "nf4"
        and part.block == NF4_GROUP
        and part.shape[-1] % NF4_GROUP == 0
        and (list(part.quant_map) == table)
    )


def _same_grid(part: BlockFP8, block: tuple[int, int]) -> bool:
    """Whether each of ``block``'s blocks over a matrix of ``part`` lies within one of ``part``'s scale
    blocks (the same grid, a coarser one, or one scale for the matrix), so that its scales carry over."""
    single = math.prod(part.scale.shape) == 1
    if len(part.shape) == 3 and len(part.scale.shape) != 3 and not single:  # a grid per expert is needed
        return False
    return all(p % b == 0 or p >= n for p, b, n in zip(part.block, block, part.shape[-2:]))


def _copy_raw(
    opener: Opener, part: Encoded, weight: FrozenExpertWeight, local: int, expert: int, row0: int, rows: int
) -> None:
    """Copy the stored bytes of ``part`` (rows ``row0 ..`` of expert ``expert``) that this rank holds
    (``held_rows``) into local expert ``local``."""
    held, spans = weight.held(), weight.held_rows()
    lead = (slice(expert, expert + 1),) if len(part.shape) == 3 else ()  # a fused [E, R, C] tensor, or one expert's
    if isinstance(part, BlockFP8):
        (a, b), (g0, g1) = spans["data"], spans["scale_inv"]
        lo, hi = max(a, row0), min(b, row0 + rows)
        if lo < hi:
            data = opener.read(part.data, (*lead, slice(lo - row0, hi - row0), slice(0, weight.shape[2])))
            held["data"][local, lo - a : hi - a] = data.reshape(hi - lo, -1).view(torch.uint8)
        (br, bc), (pbr, pbc) = weight.block, part.block
        grid0, grid_rows = row0 // br, -(-rows // br)
        lo, hi = max(g0, grid0), min(g1, grid0 + grid_rows)
        if lo < hi:
            if math.prod(part.scale.shape) == 1:
                scale = opener.read(part.scale, tuple(slice(0, n) for n in part.scale.shape)).reshape(1, 1)
            else:
                box = (*lead, *(slice(0, n) for n in part.scale.shape[len(lead) :]))
                scale = opener.read(part.scale, box).reshape(-(-rows // pbr), -1)
            # The part's scale block holding each of this weight's blocks (the same grid, or a coarser one).
            at_rows = torch.arange(lo - grid0, hi - grid0) * br // pbr
            at_cols = torch.arange(held["scale_inv"].shape[-1]) * bc // pbc
            held["scale_inv"][local, lo - g0 : hi - g0] = scale_values(scale)[at_rows][:, at_cols]
    elif isinstance(part, BNB4):  # into NF4 [E, out, in / 64, 32]: each row is whole blocks of 64
        (a, b), width = spans["codes"], part.shape[-1]
        lo, hi = max(a, row0), min(b, row0 + rows)
        if lo < hi:
            flat = slice((lo - row0) * width // 2, (hi - row0) * width // 2)
            packed = opener.read(part.data, (flat, slice(0, 1))).reshape(hi - lo, width // NF4_GROUP, -1)
            held["codes"][local, lo - a : hi - a] = nibbles_swapped(packed)
            first = (lo - row0) * width // NF4_GROUP
            absmax = part.absmax_of(opener, first, first + (hi - lo) * width // NF4_GROUP)
            held["absmax"][local, lo - a : hi - a] = absmax.reshape(hi - lo, -1)
    else:
        assert isinstance(part, MXFP4)
        a, b = spans["blocks"]  # the output features held here, dim 1 of both
        if a == b:
            return
        blocks = opener.read(part.blocks, (*lead, slice(a, b), *(slice(0, n) for n in part.blocks.shape[2:])))
        scales = opener.read(part.scales, (*lead, slice(a, b), *(slice(0, n) for n in part.scales.shape[2:])))
        held["blocks"][local], held["scales"][local] = blocks[0], scales[0]


def _rebuild_hint(folder: Path) -> str:
    return (
        f"Build the model from the folder's own config (AutoConfig.from_pretrained({str(folder)!r})), "
        "or pass the folder this model's config came from."
    )


def _read_all(reads: list[_Read]) -> None:
    """Run the reads in file order, at most ``CHUNK_BYTES`` of rows at a time."""
    with closing(Opener()) as opener:
        for read in sorted(reads, key=lambda r: (str(r.source.stored[0].file), r.source.stored[0].key)):
            if read.dst.numel() == 0:
                continue
            if not read.box:  # a 0-dim tensor
                read.dst.copy_(read.source.read(opener, (), read.dst.dtype))
                continue
            first = read.box[0]
            step = max(1, CHUNK_BYTES // max(1, read.dst[0].numel() * 4))  # rows, at 4 bytes (fp32) an element
            for start in range(first.start, first.stop, step):
                stop = min(start + step, first.stop)
                sub = (slice(start, stop), *read.box[1:])
                read.dst[start - first.start : stop - first.start].copy_(read.source.read(opener, sub, read.dst.dtype))


__all__ = ["detect_prefix", "export_hf", "load_pretrained_sharded"]
