"""Hugging Face checkpoints in and out of expert-parallel, FSDP2-sharded models.

- ``load_pretrained_sharded(model, folder)``: every rank reads from a ``save_pretrained`` folder
  only the rows its own shards hold (positioned reads, see ``safetensors_reader``), fusing
  per-expert on-disk matrices (Mixtral, the Qwen-MoE, OLMoE and DeepSeek-V3 families) into the
  in-memory ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` on the fly; fused on-disk
  tensors (GPT-OSS, biases included) are sliced like any other.
- ``export_hf(source, out_dir, hf_config_or_folder=...)`` (defined in ``hf_export``): a live
  sharded model, a Lightning checkpoint (sharded DCP directory or full file) or a state dict,
  written as a folder that ``AutoModelForCausalLM.from_pretrained`` loads on one process.

Legend: E experts, I expert intermediate size, H hidden size; a fused expert weight is
``[E, R, C]`` and is stored per expert as parts ``[R_p, C]`` stacked along the rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_ep.models.hf_export import LIBRARY_BUFFERS, PathLike, detect_prefix, export_hf
from lightning_ep.models.registry import FAMILIES, supported_model_types
from lightning_ep.models.safetensors_reader import TensorEntry, read_block, read_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _DiskLayout:
    """Where a state-dict key lives in ``save_pretrained`` files (from ``MoEFamily.disk_*``)."""

    renames: tuple[tuple[str, str], ...] = ()
    # (fused path inside the block, per-expert part paths with "{e}")
    experts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> _DiskLayout:
        supported_model_types()  # imports (registers) the adapters
        family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))  # type: ignore[arg-type]
        if family is None:  # not an MoE family we adapt: on-disk keys are the in-memory keys
            return cls()
        experts = ((family.gate_up_proj, family.disk_gate_up_proj), (family.down_proj, family.disk_down_proj))
        return cls(family.disk_renames, tuple((fused, parts) for fused, parts in experts if parts))

    def disk_key(self, key: str) -> str:
        for old, new in self.renames:
            key = key.replace(old, new)
        return key

    def expert_keys(self, key: str) -> Callable[[int], list[str]] | None:
        """For a fused expert weight, ``e -> [on-disk key of each part of expert e]``."""
        for fused, parts in self.experts:
            if key.endswith("." + fused):
                return _per_expert_keys(self.disk_key(key[: -len(fused)]), parts)
        return None


def _per_expert_keys(block: str, parts: tuple[str, ...]) -> Callable[[int], list[str]]:
    def keys_of(e: int) -> list[str]:
        return [block + part.format(e=e) for part in parts]

    return keys_of


class _Folder:
    """Keys, files and shapes of the safetensors weights of a ``save_pretrained`` folder.

    Only the files' headers are read.
    """

    def __init__(self, folder: Path) -> None:
        if (folder / INDEX_FILE).is_file():
            names = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        elif (folder / SINGLE_FILE).is_file():
            names = [SINGLE_FILE]
        else:
            raise ValueError(
                f"load_pretrained_sharded(folder={str(folder)!r}): the folder holds neither {SINGLE_FILE} "
                f"nor {INDEX_FILE}; pass a folder written by save_pretrained (safetensors, the default)."
            )
        self.entry: dict[str, TensorEntry] = {}
        for name in names:
            self.entry.update(read_header(folder / name))
        self.shape = {key: entry.shape for key, entry in self.entry.items()}


@dataclass(frozen=True)
class _Read:
    """Copy ``tensor[src]`` of the file into ``dst`` (a view of this rank's local shard)."""

    tensor: TensorEntry
    src: tuple[slice, ...]
    dst: torch.Tensor


@torch.no_grad()
def load_pretrained_sharded(model: nn.Module, folder: PathLike) -> nn.Module:
    """Fill a sharded model's weights from a Hugging Face ``save_pretrained`` folder, each rank
    reading only the rows of the shards it holds.

    ``model`` is typically built on the meta device, then ``lightning_ep.transform(model, config,
    mesh=mesh)``, ``lightning_ep.shard_model(model, mesh)`` and
    ``lightning_ep.models.init.materialize(model, device)``: its parameters are DTensors placed
    ``Shard``/``Replicate`` on their meshes (dense ``Shard(0)`` over ``"shard"`` or
    ``("replicate", "shard")``; experts ``Shard(1)`` on ``edp`` and ``Shard(0)`` on ``ep``, uneven
    shards included). Plain (unsharded) tensors are filled whole, so one process works too.

    For every parameter and persistent buffer, the rank computes its local block's global offset
    from the mesh and placements and reads exactly that block from the safetensors file (one
    positioned read per contiguous run, no memory map: see ``safetensors_reader``). Fused experts
    are assembled from the on-disk per-expert matrices given by the model family's table
    (Mixtral: ``...block_sparse_moe.experts.{e}.w1`` ``[I, H]`` = gate rows, then ``w3`` = up rows
    of ``gate_up_proj [E, 2I, H]``; ``w2`` ``[H, I]`` is ``down_proj[e]``; the Qwen-MoE family:
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``). Besides its own
    shards, a rank's host memory holds one block being read at a time, never the full model. No
    collective is called. Tied weights are read once; this library's ``expert_bias`` buffers keep
    their values (Hugging Face checkpoints have none).

    Args:
        model: a materialised Hugging Face model, sharded or not, transformed or not, wrapped by
            PEFT's LoRA or not (the adapters keep their initial values).
        folder: a folder written by ``save_pretrained`` (``model.safetensors`` or several shard
            files with ``model.safetensors.index.json``), from a model of the same config.
    Returns:
        ``model``, its weights equal to the folder's.
    Raises:
        FileNotFoundError: ``folder`` is not a directory.
        ValueError: no safetensors weights in ``folder``; its ``config.json`` names another
            ``model_type``; a weight is missing, has another shape, or matches no parameter;
            a parameter is placed other than ``Shard``/``Replicate``.
        RuntimeError: the model is still on the meta device.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"load_pretrained_sharded(folder={str(folder)!r}): no such directory; pass a folder written "
            "by save_pretrained."
        )
    _check_model_type(model, folder)
    weights = _Folder(folder)
    layout = _DiskLayout.of(model)
    reads: list[_Read] = []
    claimed: set[str] = set()
    for names, tensor in _tensors_to_load(model):
        reads.extend(_plan_tensor(names, tensor, weights, layout, claimed, folder))
    unexpected = sorted(set(weights.entry) - claimed)
    if unexpected:
        raise ValueError(
            f"load_pretrained_sharded: {len(unexpected)} weights in {folder} match no parameter of the "
            f"{type(model).__name__}, e.g. {unexpected[:3]}; the folder was saved from a different model. "
            f"Build the model from the folder's config: AutoConfig.from_pretrained({str(folder)!r})."
        )
    _read_all(reads)
    return model


def _check_model_type(model: nn.Module, folder: Path) -> None:
    config_file = folder / "config.json"
    mine = getattr(getattr(model, "config", None), "model_type", None)
    if not config_file.is_file() or mine is None:
        return
    theirs = json.loads(config_file.read_text()).get("model_type")
    if theirs is not None and theirs != mine:
        raise ValueError(
            f"load_pretrained_sharded: {config_file} has model_type={theirs!r} but the model is a "
            f"{mine!r} ({type(model).__name__}); pass a folder saved from a {mine} model."
        )


def _tensors_to_load(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """State-dict entries grouped by tensor identity (tied weights: one tensor, several names),
    without this library's buffers, which Hugging Face checkpoints do not have."""
    library = {name for name, _ in model.named_buffers() if name.rpartition(".")[2] in LIBRARY_BUFFERS}
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in library or not isinstance(tensor, torch.Tensor) or _is_adapter(name):
            continue
        groups.setdefault(id(tensor), ([], tensor))[0].append(_base_name(name))
    return list(groups.values())


_PEFT_PREFIX = "base_model.model."


def _is_adapter(name: str) -> bool:
    """A PEFT LoRA factor (``q_proj.lora_A.default.weight``, an expert's ``gate_up_proj_lora_A``):
    not in a base model's folder; it keeps its initial values."""
    return any(part.startswith("lora_") or "_lora_" in part for part in name.split("."))


def _base_name(name: str) -> str:
    """The Hugging Face name of a parameter of a PEFT-wrapped model: without PEFT's
    ``base_model.model.`` prefix and the ``base_layer`` its LoRA layers wrap."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def _local_shard(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's block of ``tensor`` (a view to write into) and its offset in the global tensor."""
    if not isinstance(tensor, DTensor):
        return tensor.detach(), (0,) * tensor.ndim
    if not all(isinstance(p, (Shard, Replicate)) for p in tensor.placements):
        raise ValueError(
            f"load_pretrained_sharded: {name!r} is placed {tuple(tensor.placements)} on mesh "
            f"{tensor.device_mesh.mesh_dim_names}; only Shard and Replicate placements hold one "
            "contiguous block of the global tensor. Shard the model with lightning_ep.shard_model."
        )
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"load_pretrained_sharded: local shard of {name!r} is {list(local.shape)} but its placements "
            f"{tuple(tensor.placements)} give {list(shape)}; please report this with your torch version."
        )
    return local, tuple(offset)


def _plan_tensor(
    names: list[str],
    tensor: torch.Tensor,
    weights: _Folder,
    layout: _DiskLayout,
    claimed: set[str],
    folder: Path,
) -> list[_Read]:
    """The reads that fill this rank's block of ``tensor``; checks the on-disk shapes."""
    if tensor.is_meta:
        raise RuntimeError(
            f"load_pretrained_sharded: {names[0]!r} is on the meta device; allocate the model first "
            "with lightning_ep.models.init.materialize(model, device) (after transform and shard_model)."
        )
    local, offset = _local_shard(names[0], tensor)
    looked: list[str] = []
    for name in names:
        for key in dict.fromkeys((layout.disk_key(name), name)):
            looked.append(key)
            if key in weights.shape:
                if weights.shape[key] != tuple(tensor.shape):
                    raise ValueError(
                        f"load_pretrained_sharded: {key!r} in {weights.entry[key].file.name} has shape "
                        f"{list(weights.shape[key])} but the model's {name!r} is {list(tensor.shape)}; "
                        f"the model was built from another config. {_rebuild_hint(folder)}"
                    )
                claimed.add(key)
                # A tied alias may be stored too (e.g. lm_head.weight next to embed_tokens.weight).
                claimed.update(k for alias in names for k in (layout.disk_key(alias), alias) if k in weights.shape)
                box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
                return [_Read(weights.entry[key], box, local)]
        expert_keys = layout.expert_keys(name)
        if expert_keys is not None:
            looked.extend(expert_keys(0))
            if expert_keys(0)[0] in weights.shape:
                return _plan_experts(name, tuple(tensor.shape), local, offset, expert_keys, weights, claimed)
    raise ValueError(
        f"load_pretrained_sharded: {folder} has no weight for the model's {names[0]!r} (looked for "
        f"{looked}); the folder was saved from a different model. {_rebuild_hint(folder)}"
    )


def _plan_experts(
    name: str,
    shape: tuple[int, ...],
    local: torch.Tensor,
    offset: tuple[int, ...],
    expert_keys: Callable[[int], list[str]],
    weights: _Folder,
    claimed: set[str],
) -> list[_Read]:
    """Reads that fill the local block ``[Le, Lr, Lc]`` at ``(e0, r0, c0)`` of a fused expert weight
    ``[E, R, C]`` from per-expert parts ``[R_p, C]`` (expert ``e`` = its parts stacked on rows)."""
    num_experts, rows, cols = shape
    keys_E = [expert_keys(e) for e in range(num_experts)]
    for keys in keys_E:
        for key in keys:
            if key not in weights.shape:
                raise ValueError(
                    f"load_pretrained_sharded: the folder has no {key!r}, needed for the model's {name!r} "
                    f"{list(shape)} (experts 0..{num_experts - 1}); it was saved from a model with fewer "
                    f"experts. {_rebuild_hint(weights.entry[keys_E[0][0]].file.parent)}"
                )
        shapes = [weights.shape[key] for key in keys]
        if any(len(s) != 2 or s[1] != cols for s in shapes) or sum(s[0] for s in shapes) != rows:
            stacked = [num_experts, sum(s[0] for s in shapes), *shapes[0][1:]]
            raise ValueError(
                f"load_pretrained_sharded: the per-expert weights {keys} have shapes "
                f"{[list(s) for s in shapes]}, which stack to {stacked}, but the model's {name!r} "
                f"is {list(shape)}; the model was built from another config. "
                f"{_rebuild_hint(weights.entry[keys[0]].file.parent)}"
            )
        claimed.update(keys)
    e0, r0, c0 = offset
    local_experts, local_rows, local_cols = local.shape
    reads = []
    for e in range(e0, e0 + local_experts):
        base = 0  # first row of this part inside expert e's [R, C]
        for key in keys_E[e]:
            part_rows = weights.shape[key][0]
            lo, hi = max(r0, base), min(r0 + local_rows, base + part_rows)
            if lo < hi:
                src = (slice(lo - base, hi - base), slice(c0, c0 + local_cols))
                reads.append(_Read(weights.entry[key], src, local[e - e0, lo - r0 : hi - r0]))
            base += part_rows
    return reads


def _rebuild_hint(folder: Path) -> str:
    return (
        f"Build the model from the folder's own config (AutoConfig.from_pretrained({str(folder)!r})), "
        "or pass the folder this model's config came from."
    )


def _read_all(reads: list[_Read]) -> None:
    """Run the reads, file by file; each reads exactly its block (see ``safetensors_reader``)."""
    ordered = sorted(reads, key=lambda r: (str(r.tensor.file), r.tensor.offset))
    for file, group in groupby(ordered, key=lambda r: r.tensor.file):
        with open(file, "rb", buffering=0) as f:
            for read in group:
                if read.dst.numel():
                    read.dst.copy_(read_block(f, read.tensor, read.src))


__all__ = ["detect_prefix", "export_hf", "load_pretrained_sharded"]
