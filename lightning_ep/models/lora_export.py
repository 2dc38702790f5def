"""PEFT out: a LoRA run, live or checkpointed, as a PEFT adapter folder or as a merged Hugging Face folder.

A transformed PEFT model's state dict keeps PEFT's names except at the experts (``models.peft_lora``:
base weights without ``base_layer.``, factors ``experts.<weight>_lora_A [E, r, in]`` / ``_lora_B
[E, out, r]``). ``peft_state`` turns it into the state dict of ``get_peft_model(base, lora_config)``,
keys and layouts, so that PEFT itself writes the adapter and merges it (``merge_and_unload``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ep.models.peft_lora import check_peft_model, stacked_to_peft

PathLike = str | os.PathLike


def lora_config_to_json(config: Any) -> str:
    """``config`` (a ``LoraConfig``) as the JSON text of PEFT's ``adapter_config.json``."""
    return json.dumps(config.to_dict(), sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v))


def lora_config_from(value: Any) -> Any:
    """A ``LoraConfig`` from itself, its JSON text or dict, or a PEFT adapter folder / ``adapter_config.json``."""
    from peft import LoraConfig, PeftConfig

    if isinstance(value, LoraConfig):
        return copy.deepcopy(value)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        config = PeftConfig.from_peft_type(**json.loads(value))
    elif isinstance(value, (str, os.PathLike)):
        path = Path(value)
        config = PeftConfig.from_pretrained(str(path if path.is_dir() else path.parent))
    elif isinstance(value, Mapping):
        config = PeftConfig.from_peft_type(**dict(value))
    else:
        raise TypeError(
            f"lora_config must be a LoraConfig, its JSON or dict, or an adapter folder; got {type(value).__name__}."
        )
    if not isinstance(config, LoraConfig):
        raise ValueError(f"lora_config: {type(config).__name__} is not a LoraConfig; lightning_ep exports LoRA only.")
    return config


def meta_peft_model(hf_config: Any, lora_config: Any) -> Any:
    """``get_peft_model`` of the Hugging Face model of ``hf_config``, built on the meta device."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_config)
    return get_peft_model(base, copy.deepcopy(lora_config))


def _our_names(peft_model: Any) -> dict[str, tuple[str, str | None]]:
    """``{PEFT state-dict key: (this library's key, "A" / "B" for an expert factor, else None)}``."""
    from peft.tuners.lora import ParamWrapper

    chains: dict[str, str] = {}  # PEFT path of a ParamWrapper -> the experts module's path (no base_layer)
    for path, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):
            chains[path] = path.replace(".base_layer", "")
    roots = set(chains.values())
    names: dict[str, tuple[str, str | None]] = {}
    for key in peft_model.state_dict():
        wrapper, _, rest = key.rpartition(".lora_")
        which = rest.partition(".")[0]
        if wrapper in chains and which in ("A", "B"):
            weight = peft_model.get_submodule(wrapper).parameter_name
            names[key] = (f"{chains[wrapper]}.{weight}_lora_{which}", which)
            continue
        root = next((r for r in roots if key.startswith(r + ".base_layer.")), None)
        names[key] = (root + key[len(root) :].replace(".base_layer", ""), None) if root else (key, None)
    return names


def peft_state(
    state: Mapping[str, Any], peft_model: Any, prefix: str | None, *, adapter_only: bool
) -> dict[str, torch.Tensor]:
    """``state`` (a transformed PEFT model's full state dict, its keys under ``prefix``) as the state dict
    of ``peft_model`` (``adapter_only``: the LoRA factors only); ``ValueError`` on keys or shapes that
    do not match it."""
    from lightning_ep.models.hf_export import detect_prefix

    names = _our_names(peft_model)
    expected = peft_model.state_dict()
    wanted = {k: v for k, v in names.items() if not adapter_only or "lora_" in k}
    ours = {name for name, _ in wanted.values()}
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    if prefix is None:
        prefix = detect_prefix(keys, ours)
    missing = sorted(name for name in ours if prefix + name not in state)
    if missing:
        raise ValueError(
            f"the checkpoint has no {len(missing)} of the weights the LoRA model needs (e.g. {missing[:3]} under "
            f"prefix {prefix!r}); pass the Hugging Face config and LoRA config the run was trained with."
        )
    out: dict[str, torch.Tensor] = {}
    for key, (name, factor) in wanted.items():
        tensor = state[prefix + name]
        if factor is not None:
            name_A = name[: -len("_lora_A")] + "_lora_A"
            A, B = stacked_to_peft(state[prefix + name_A], state[prefix + name_A[:-1] + "B"])
            tensor = A if factor == "A" else B
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{prefix + name}: shape {list(tensor.shape)} does not match the LoRA model's {key} "
                f"{list(expected[key].shape)}; pass the LoRA config the run was trained with (its r, targets)."
            )
        out[key] = tensor
    return out


def export_lora_adapter(
    source: nn.Module | Mapping[str, Any] | PathLike,
    out_dir: PathLike,
    *,
    hf_config_or_folder: Any,
    lora_config: Any = None,
    prefix: str | None = None,
) -> Path:
    """Write the LoRA adapter of a run in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``, by PEFT's ``save_pretrained``), which ``PeftModel.from_pretrained``
    loads. Returns ``out_dir`` as a ``Path``, on every rank. ``source``, ``out_dir``,
    ``hf_config_or_folder`` and ``prefix`` are as for ``export_hf`` (a folder is recorded as the
    adapter's ``base_model_name_or_path``; ``prefix`` precedes the PEFT model's names). ``lora_config``:
    the run's ``LoraConfig`` (or its JSON, dict, or adapter folder); ``None`` takes the live model's.
    """
    from lightning_ep.models import hf_export

    out_dir = Path(out_dir)
    hf_export._check_out_dir(out_dir)
    hf_config = hf_export._hf_config(hf_config_or_folder)
    if lora_config is None and isinstance(source, nn.Module):
        lora_config = check_peft_model(source)
    if lora_config is None:
        raise ValueError(
            "export_lora_adapter: no LoRA config: pass lora_config= (the LoraConfig the run was trained with), or a "
            "live PEFT model as source."
        )
    lora_config = lora_config_from(lora_config)
    if isinstance(hf_config_or_folder, (str, os.PathLike)) and Path(hf_config_or_folder).is_dir():
        lora_config.base_model_name_or_path = str(hf_config_or_folder)
    state = hf_export._gather_full_state(source) if isinstance(source, nn.Module) else None

    def write() -> None:
        full = state if state is not None else hf_export._read_checkpoint(source)  # type: ignore[arg-type]
        peft_model = meta_peft_model(hf_config, lora_config)
        adapter = peft_state(full, peft_model, prefix, adapter_only=True)
        peft_model.load_state_dict(adapter, strict=False, assign=True)
        peft_model.save_pretrained(str(out_dir))

    hf_export.write_on_rank_zero(write, "export_lora_adapter")
    return out_dir


@torch.no_grad()
def merged_state(
    state: Mapping[str, Any], hf_config: Any, lora_config: Any, prefix: str | None, *, merge: bool = True
) -> dict[str, Any]:
    """The plain Hugging Face state dict of a LoRA run: ``state`` loaded into PEFT's model and merged
    by PEFT's ``merge_and_unload`` (each weight plus ``scaling * B @ A``, experts included), or with
    ``merge=False`` the base model without the adapter (PEFT's ``unload``)."""
    peft_model = meta_peft_model(hf_config, lora_config_from(lora_config))
    full = peft_state(state, peft_model, prefix, adapter_only=False)
    peft_model.load_state_dict(full, strict=True, assign=True)
    plain = peft_model.merge_and_unload() if merge else peft_model.unload()
    return dict(plain.state_dict())


__all__ = [
    "export_lora_adapter",
    "lora_config_from",
    "lora_config_to_json",
    "merged_state",
    "meta_peft_model",
    "peft_state",
]
