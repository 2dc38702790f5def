"""What ``ExpertParallelStrategy`` adds to Lightning checkpoints: atomic saves, the MoE record and its check.

A save writes ``<path>.partial`` and moves it into place once every rank has written it, so a
process killed mid-save leaves the previous checkpoint untouched and a ``.partial`` one that
``refuse_partial`` refuses by name. Every checkpoint carries, under ``checkpoint["lightning_ep"]``
(in ``meta.pt`` of a sharded checkpoint), plain Python values only::

    {"format": 1,
     "moe_config": dataclasses.asdict(strategy.moe),
     "moe_shape": {"model_type": "mixtral", "num_experts": 8, "top_k": 2, "num_moe_layers": 32},
     "lora_config": "{...}"}   # only for a PEFT LoRA model: its adapter_config.json text

``load_checkpoint`` reads it before any weight is restored and refuses a resume whose MoE
configuration or shape differs, by name, unless ``allow_moe_config_change`` lists every differing
name; ``lightning_ep.moe.config.EXECUTION_FIELDS`` may always differ. A checkpoint without the
record loads unchecked.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ep.models.peft_lora import peft_configs
from lightning_ep.models.registry import MoEShape
from lightning_ep.moe.config import MoEConfig, config_differences
from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.layer import MoELayer

RECORD_KEY = "lightning_ep"
RECORD_FORMAT = 1
SHAPE_FIELDS = MoEShape.RECORDED
PARTIAL_SUFFIX = ".partial"
_METADATA_FILE = "meta.pt"  # where Lightning's ModelParallelStrategy puts a sharded checkpoint's non-tensor state


def partial_path(path: Path) -> Path:
    """Where the checkpoint for ``path`` is written before it is complete."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


def remove(path: Path) -> None:
    """Delete the checkpoint at ``path`` (a folder or a file), if any."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def move_into_place(partial: Path, path: Path) -> None:
    """Replace the checkpoint at ``path`` by the complete one at ``partial`` (one process calls it)."""
    old = path.with_name(path.name + ".old")
    remove(old)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    remove(old)


def refuse_partial(path: Path) -> None:
    """Refuse a checkpoint whose save was interrupted (``<path>.partial``)."""
    if path.name.endswith(PARTIAL_SUFFIX):
        raise RuntimeError(
            f"checkpoint {str(path)!r} is incomplete: the run was interrupted while saving it. Resume from "
            "the previous checkpoint instead (the one without the .partial suffix)."
        )


def moe_shape(model: nn.Module) -> dict[str, Any]:
    """The MoE shape a checkpoint records for ``model`` (``MoEShape.record``)."""
    return MoEShape.of(model).record()


def make_record(config: MoEConfig, model: nn.Module) -> dict[str, Any]:
    """The record saved under ``checkpoint[RECORD_KEY]`` for a run of ``model`` under ``config``; for a
    PEFT LoRA model with its ``LoraConfig`` as JSON, for ``python -m lightning_ep.export``."""
    record: dict[str, Any] = {"format": RECORD_FORMAT, "moe_config": asdict(config), "moe_shape": moe_shape(model)}
    record["frozen_experts"] = frozen_format(model)
    lora = peft_configs(model)
    if lora:
        from lightning_ep.models.lora_export import lora_config_to_json

        record["lora_config"] = lora_config_to_json(next(iter(lora.values())))
    return record


def frozen_format(model: nn.Module) -> str | None:
    """The format ``model`` keeps its frozen expert weights in (``moe.experts.frozen``), ``None`` for none."""
    return next((m.format for m in model.modules() if isinstance(m, FrozenExpertWeight)), None)


def read_record(path: Path, weights_only: bool | None = None) -> dict[str, Any] | None:
    """The record of the checkpoint at ``path`` (a sharded folder or a full file); ``None`` when it has
    none, or when ``path`` is no checkpoint (Lightning's loading says so)."""
    if path.is_dir():
        if not (path / _METADATA_FILE).is_file():
            return None
        checkpoint = torch.load(path / _METADATA_FILE, weights_only=weights_only)
    elif path.is_file():
        # mmap: the tensors are not read, only the pickled structure around them.
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    else:
        return None
    record = checkpoint.get(RECORD_KEY) if isinstance(checkpoint, dict) else None
    return record if isinstance(record, dict) else None


def check_allowed(names: str | Sequence[str]) -> tuple[str, ...]:
    """Validate ``ExpertParallelStrategy(allow_moe_config_change=...)``: ``MoEConfig`` field names
    or ``SHAPE_FIELDS``; a single string is one name."""
    argument = f"ExpertParallelStrategy(allow_moe_config_change={names!r})"
    if isinstance(names, str):
        names = (names,)
    if isinstance(names, bool) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{argument}: pass a list of MoEConfig field names, e.g. ['moe_load_balancing'].")
    known = [*(f.name for f in fields(MoEConfig)), *SHAPE_FIELDS]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{argument}: {unknown} are not MoEConfig fields or MoE shape entries; choose from {known}.")
    return tuple(names)


def check_record(
    record: dict[str, Any] | None, config: MoEConfig, model: nn.Module, *, allowed: Sequence[str], path: Path
) -> None:
    """Refuse (``ValueError`` naming each field, both values and the fix) to resume ``model`` under
    ``config`` from a checkpoint whose ``record`` differs in the math or the MoE shape, unless
    ``allowed`` names the difference."""
    if record is None:
        return
    saved_format, now_format = record.get("frozen_experts"), frozen_format(model)
    if saved_format != now_format:  # the state dict's expert keys differ: nothing could be loaded
        saved_words, now_words = (f or "the parameters' dtype" for f in (saved_format, now_format))
        raise ValueError(
            f"checkpoint {str(path)!r} keeps its frozen expert weights in {saved_words}, this run in {now_words}; "
            f"resume with ExpertParallelStrategy(frozen_experts={saved_format!r}). To change the format, export the "
            "checkpoint (python -m lightning_ep.export) and start from that folder."
        )
    saved_config = record.get("moe_config", {})
    differences = {  # name: (label, saved, this run's)
        name: (f"MoEConfig.{name}", saved, now)
        for name, (saved, now) in config_differences(saved_config, config, math_only=True).items()
    }
    shape = moe_shape(model)
    for name, saved in record.get("moe_shape", {}).items():
        if shape.get(name) != saved:
            differences[name] = (f"the model's {name}", saved, shape.get(name))
    refused = {name: values for name, values in differences.items() if name not in allowed}
    if not refused:
        return
    listed = ", ".join(f"{label}={saved!r} (this run: {now!r})" for label, saved, now in refused.values())
    raise ValueError(
        f"checkpoint {str(path)!r} was saved with another MoE configuration: {listed}. Resume with the MoEConfig "
        "and model it was saved with; to change them on purpose (e.g. another balancing mode for the next phase "
        f"of training), pass ExpertParallelStrategy(allow_moe_config_change={list(refused)!r})."
    )


@contextmanager
def saved_bias_keys(record: dict[str, Any] | None, layers: Sequence[MoELayer]) -> Generator[None, None, None]:
    """While loading a checkpoint saved under another (allowed) balancing mode, give the routers the
    ``gate.expert_bias`` keys the checkpoint has: leaving ``"balanced"``, a stand-in buffer takes the
    saved bias and is dropped after; entering it, the bias is not persistent while loading (it keeps
    its initial zeros)."""
    saved_mode = (record or {}).get("moe_config", {}).get("moe_load_balancing")
    if saved_mode is None:
        yield
        return
    added, hidden = [], []
    for layer in layers:
        gate = layer.gate
        saved_has = saved_mode == "balanced" and not hasattr(gate, "e_score_correction_bias")
        has = gate.bias_name == "expert_bias"
        if saved_has and not has:
            gate.register_buffer("expert_bias", torch.zeros(gate.num_experts, device=gate.weight.device))
            added.append(gate)
        elif has and not saved_has:
            # Kept, so the router still works (loading an optimizer state may take a step), but unsaved.
            gate.register_buffer("expert_bias", gate.get_buffer("expert_bias"), persistent=False)
            hidden.append(gate)
    try:
        yield
    finally:
        for gate in added:
            del gate.expert_bias
        for gate in hidden:
            gate.register_buffer("expert_bias", gate.get_buffer("expert_bias"), persistent=True)


def different_model_error(path: Path, error: BaseException) -> ValueError | None:
    """The clear error for a checkpoint whose weights do not fit the model (``error`` is what
    Lightning's or DCP's loading raised), or ``None`` when ``error`` is about something else."""
    failures = getattr(error, "failures", None)  # DCP: {rank: (exception, traceback)}
    text = str(next(iter(failures.values()))[0]) if failures else str(error)
    if not any(s in text for s in ("Size mismatch", "Missing key", "Unexpected key", "size mismatch")):
        return None
    return ValueError(
        f"checkpoint {str(path)!r} was saved from a different model ({text}). Resume with the model "
        "configuration it was saved from; to start a new model from its weights, export it with "
        "`python -m lightning_ep.export` and load the matching parameters yourself."
    )
