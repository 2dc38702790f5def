"""``export_hf``: a trained expert-parallel model, live or checkpointed, as a Hugging Face folder.

Legend: E experts, I expert intermediate size, H hidden size.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Persistent buffers this library adds to Hugging Face modules ("balanced" mode's router bias).
LIBRARY_BUFFERS = ("expert_bias",)
# Files of a Hugging Face folder, besides weights and config.json, that export_hf copies along.
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)

PathLike = str | os.PathLike


def export_hf(
    source: nn.Module | Mapping[str, Any] | PathLike,
    out_dir: PathLike,
    *,
    hf_config_or_folder: Any,
    prefix: str | None = None,
    lora_config: Any = None,
    merge_lora: bool = True,
) -> Path:
    """Write a trained model as a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained``
    loads on one process.

    ``source`` is one of:

    - a live model, sharded or not (the Hugging Face model, or a ``LightningModule`` holding it).
      Under a process group every rank must call ``export_hf``: the full state dict is gathered to
      rank 0's CPU and rank 0 writes (``write_on_rank_zero``).
    - a checkpoint written by Lightning's ``ModelParallelStrategy.save_checkpoint`` (so by
      ``ExpertParallelStrategy``): a sharded DCP directory (``.metadata``, ``*.distcp``, ``meta.pt``;
      without a top-level ``"state_dict"`` it is read as a plain model state dict) or a full
      ``torch.save`` file, read on one process without a process group (the file with
      ``torch.load(weights_only=True, mmap=True)``). Optimizer states are not read.
    - a state dict, or a checkpoint dict with a ``"state_dict"`` entry.

    Keys are ``prefix`` + the Hugging Face names with global shapes, e.g. ``"model."`` +
    ``"model.layers.0.mlp.experts.gate_up_proj"`` (``[E, 2I, H]``); keys outside the prefix are
    ignored. This library's ``gate.expert_bias`` buffers (``"balanced"`` mode) are dropped, since the
    Hugging Face router has no such bias: where one is non-zero, some selections may change, and a
    warning says so.

    The model is built from the config on the meta device, takes the tensors (``strict``, re-tying
    tied embeddings) and is written with ``save_pretrained`` (per-expert on-disk keys where the family
    has them), with the tokenizer and generation files of ``hf_config_or_folder``; a model of a
    quantized release (FP8, MXFP4) in bf16, without ``quantization_config``.

    Args:
        out_dir: the folder to write (created if needed).
        hf_config_or_folder: the ``PretrainedConfig`` the model was built from, its ``config.json``,
            or the Hugging Face folder holding it.
        prefix: what precedes the Hugging Face names in the keys (``"model."`` for ``self.model``);
            ``None`` detects it (``detect_prefix``).
        lora_config: for a run of a PEFT LoRA model, its ``LoraConfig`` (or its JSON, dict, or an adapter
            folder): the adapter is merged by PEFT's ``merge_and_unload`` (``models.lora_export``).
            ``None`` takes a live model's own; ``python -m lightning_ep.export`` reads a checkpoint's.
        merge_lora: ``False`` writes the base model of a LoRA run instead, without its adapter
            (PEFT's ``unload``), e.g. for ``PeftModel.from_pretrained`` beside an exported adapter.
    Returns:
        ``out_dir`` as a ``Path``, on every rank.
    Raises:
        TypeError: ``source`` or ``hf_config_or_folder`` has an unsupported type.
        FileNotFoundError: a path that does not exist.
        NotADirectoryError: ``out_dir`` is an existing file (``save_pretrained`` would write nothing).
        ValueError: a directory that is not a DCP checkpoint, a file ``torch.load(weights_only=True)``
            refuses, a wrong or ambiguous prefix, or keys and shapes that do not match the config.
        RuntimeError: on ranks other than 0, when rank 0 failed.
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    config = _hf_config(hf_config_or_folder)
    if not isinstance(source, (nn.Module, Mapping, str, os.PathLike)):
        raise TypeError(
            f"export_hf(source=...) must be a model, a state dict or a checkpoint path, got {type(source).__name__}."
        )
    if lora_config is None and isinstance(source, nn.Module):
        from lightning_ep.models.peft_lora import check_peft_model

        lora_config = check_peft_model(source)
    state = _gather_full_state(source) if isinstance(source, nn.Module) else None

    def write() -> None:
        full = state if state is not None else _read_checkpoint(source)  # type: ignore[arg-type]
        full = _dequantize_frozen(full)
        names_prefix = prefix
        if lora_config is not None:
            from lightning_ep.models.lora_export import merged_state

            full, names_prefix = merged_state(full, config, lora_config, prefix, merge=merge_lora), ""
        _write_folder(full, out_dir, config, names_prefix, hf_config_or_folder)

    write_on_rank_zero(write, "export_hf")
    return out_dir


def write_on_rank_zero(write: Callable[[], None], name: str) -> None:
    """Run ``write`` on rank 0 (or in a process alone), then broadcast how it went: rank 0 raises its own
    error, the other ranks a ``RuntimeError`` naming ``name`` and quoting it."""
    distributed = dist.is_available() and dist.is_initialized()
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            write()
        except Exception as err:  # re-raised below, after telling the other ranks
            error = err
    if distributed:
        message = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(message, src=0)
        if error is None and message[0] is not None:
            raise RuntimeError(f"{name} failed on rank 0: {message[0]}")
    if error is not None:
        raise error


def _check_out_dir(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that is, or lies under, an existing file (``save_pretrained`` only logs it)."""
    existing = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == out_dir else f" lies under {str(existing)!r}, which"
        raise NotADirectoryError(
            f"export_hf(out_dir={str(out_dir)!r}){where} is an existing file, not a folder; pass a folder to "
            "write (it is created if needed), or remove the file."
        )


def _hf_config(value: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(value, PretrainedConfig):
        return copy.deepcopy(value)
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if path.is_file() or (path / "config.json").is_file():
            try:
                return AutoConfig.from_pretrained(str(path))
            except (OSError, ValueError) as err:  # not JSON, no model_type, a type transformers lacks
                reason = " ".join(str(err).split())
                raise ValueError(
                    f"export_hf(hf_config_or_folder={str(value)!r}): transformers cannot read it as a model "
                    f"config ({reason}); pass the Hugging Face folder the model was built from or its config.json."
                ) from err
        raise FileNotFoundError(
            f"export_hf(hf_config_or_folder={str(value)!r}): neither a folder with a config.json nor a "
            "config JSON file; pass the Hugging Face folder the model was built from, its config.json, "
            "or a PretrainedConfig."
        )
    raise TypeError(
        f"export_hf(hf_config_or_folder=...) must be a PretrainedConfig, a folder or a config.json path, "
        f"got {type(value).__name__}."
    )


def _gather_full_state(model: nn.Module) -> dict[str, Any] | None:
    """The full state dict on rank 0's CPU (collective under a process group); ``None`` elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0 else None


def _read_checkpoint(source: Mapping[str, Any] | PathLike) -> dict[str, Any]:
    """A flat ``{key: tensor}`` from a state dict, a checkpoint dict, a DCP directory or a file."""
    if isinstance(source, Mapping):
        inner = source.get("state_dict")
        return dict(inner if isinstance(inner, Mapping) else source)
    path = Path(source)
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise ValueError(
                f"export_hf(source={str(path)!r}): the directory has no .metadata file, so it is not a "
                "torch.distributed.checkpoint (DCP) checkpoint; pass the directory that "
                "ModelParallelStrategy.save_checkpoint wrote (.metadata, *.distcp, meta.pt) or a full "
                "checkpoint file."
            )
        return _read_dcp(path)
    if path.is_file():
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"export_hf(source={str(path)!r}): torch.load(weights_only=True) refuses this file "
                f"({str(err).splitlines()[0]}). If you trust it, load it yourself with "
                "torch.load(path, weights_only=False) and pass checkpoint['state_dict'] as source."
            ) from err
        if not isinstance(loaded, Mapping):
            raise ValueError(
                f"export_hf(source={str(path)!r}): the file holds a {type(loaded).__name__}, not a "
                "checkpoint dict or a state dict."
            )
        return _read_checkpoint(loaded)
    raise FileNotFoundError(
        f"export_hf(source={str(path)!r}): no such file or directory; pass a Lightning checkpoint "
        "(a file, or a sharded checkpoint directory), a state dict or a model."
    )


def _read_dcp(path: Path) -> dict[str, Any]:
    """The tensors of a DCP checkpoint's ``"state_dict"`` (or of a plain model state dict), and the extra
    states of frozen expert weights kept quantized, loaded whole without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    planned = metadata.planner_data or {}
    paths = {fqn: tuple(planned.get(fqn, (fqn,))) for fqn in metadata.state_dict_metadata}
    lightning = any(p[0] == "state_dict" and len(p) >= 2 for p in paths.values())
    state: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if lightning and paths[fqn][0] != "state_dict":
            continue  # optimizer states, loops
        keys = paths[fqn][1:] if lightning else paths[fqn]
        if isinstance(meta, TensorStorageMetadata) and len(keys) == 1:
            state[str(keys[0])] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata) and len(keys) == 2 and str(keys[0]).endswith("._extra_state"):
            state.setdefault(str(keys[0]), {})[str(keys[1])] = None  # loaded as the object saved
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no_dist.*|.*single process.*")
        dcp.load({"state_dict": state} if lightning else state, checkpoint_id=str(path), no_dist=True)
    return state


def _write_folder(
    state: dict[str, Any], out_dir: Path, config: Any, prefix: str | None, hf_config_or_folder: Any
) -> None:
    from transformers import AutoModelForCausalLM

    if getattr(config, "quantization_config", None) is not None:
        # A model loaded from an FP8 / MXFP4 folder holds dequantized weights: write them in bf16.
        delattr(config, "quantization_config")
        config.dtype = torch.bfloat16
        state = {k: v.to(torch.bfloat16) if torch.is_floating_point(v) else v for k, v in state.items()}
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    expected = {key: tuple(t.shape) for key, t in hf_model.state_dict().items()}
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    if prefix is None:
        prefix = detect_prefix(keys, expected)
    state = {k[len(prefix) :]: state[k] for k in keys if k.startswith(prefix)}
    if not state:
        raise ValueError(
            f"export_hf(prefix={prefix!r}): no checkpoint key starts with it; the keys look like "
            f"{sorted(keys)[:3]}. Pass the attribute path of the {config.model_type} model inside your "
            "LightningModule followed by a dot (e.g. 'model.'), or prefix=None to detect it."
        )
    lora = [k for k in state if ".lora_" in k or "_lora_A" in k]
    if lora:
        raise ValueError(
            f"export_hf: the checkpoint holds LoRA factors (e.g. {lora[0]!r}); pass lora_config= (the LoraConfig it "
            "was trained with) to merge them, or export the adapter with python -m lightning_ep.export ... --adapter."
        )
    state = _drop_library_buffers(state, expected)
    _check_keys(state, expected, config, hf_config_or_folder)
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()
    hf_model.save_pretrained(out_dir)
    if isinstance(hf_config_or_folder, (str, os.PathLike)) and Path(hf_config_or_folder).is_dir():
        for name in COMPANION_FILES:
            if (Path(hf_config_or_folder) / name).is_file():
                shutil.copy2(Path(hf_config_or_folder) / name, out_dir / name)


def detect_prefix(keys: list[str] | set[str], hf_keys: Mapping[str, Any] | set[str]) -> str:
    """The prefix ``p`` (empty or ending with a dot) such that the most ``keys`` are ``p + name`` with
    ``name`` in ``hf_keys``; ``ValueError`` when no key matches or several prefixes tie."""
    counts: Counter[str] = Counter()
    for key in keys:
        for start in (0, *(i + 1 for i, ch in enumerate(key) if ch == ".")):
            if key[start:] in hf_keys:
                counts[key[:start]] += 1
    if not counts:
        raise ValueError(
            f"export_hf: no checkpoint key ends with a parameter name of the model built from the config "
            f"(e.g. {sorted(hf_keys)[:2]}); the checkpoint keys look like {sorted(keys)[:3]}. Pass the "
            "config the model was trained with."
        )
    best = max(counts.values())
    tied = sorted(p for p, c in counts.items() if c == best)
    if len(tied) > 1:
        raise ValueError(
            f"export_hf: the checkpoint holds {best} weights of the model under each of the prefixes "
            f"{tied}; pass prefix= (--prefix on the command line) to choose one."
        )
    return tied[0]


def _dequantize_frozen(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each frozen expert weight kept quantized (``moe.experts.frozen``: its buffers
    ``<w>.<name>`` and its ``<w>._extra_state``) as ``<w>`` in fp32, exactly its values."""
    from lightning_ep.moe.experts.frozen import BUFFERS, dequantize_stored

    out = dict(state)
    for key, extra in state.items():
        if not key.endswith("._extra_state") or not isinstance(extra, dict) or "format" not in extra:
            continue
        weight = key.removesuffix("._extra_state")
        stored = {name: torch.as_tensor(out.pop(f"{weight}.{name}")) for name in BUFFERS[str(extra["format"])]}
        block = (int(extra["block"][0]), int(extra["block"][1]))
        out[weight] = dequantize_stored(extra["format"], bool(extra["transposed"]), block, stored, torch.float32)
        del out[key]
    return out


def _drop_library_buffers(state: dict[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    dropped = [k for k in state if k not in expected and k.rpartition(".")[2] in LIBRARY_BUFFERS]
    biased = [k for k in dropped if bool(state[k].detach().abs().max() > 0)]
    if biased:
        largest = max(float(state[k].detach().abs().max()) for k in biased)
        warnings.warn(
            f"export_hf: dropped {len(dropped)} 'balanced'-mode expert biases ({len(biased)} non-zero, "
            f"e.g. {biased[0]!r}, largest |b| = {largest:.3g}); the Hugging Face router has no such bias, "
            "so the exported model selects experts by the unbiased router probabilities and may route "
            "some tokens differently from the trained model.",
            stacklevel=4,
        )
    return {k: v for k, v in state.items() if k not in dropped}


def _check_keys(
    state: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], config: Any, hf_config_or_folder: Any
) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [
        f"{k}: checkpoint {list(state[k].shape)} vs config {list(expected[k])}"
        for k in sorted(set(state) & set(expected))
        if tuple(state[k].shape) != expected[k]
    ]
    if missing or unexpected or mismatched:
        is_path = isinstance(hf_config_or_folder, (str, os.PathLike))
        source = repr(str(hf_config_or_folder)) if is_path else "a PretrainedConfig"
        raise ValueError(
            f"export_hf: the checkpoint does not match the {config.model_type} model of "
            f"hf_config_or_folder={source}: {len(missing)} missing (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]}), {len(mismatched)} shape mismatches "
            f"(e.g. {mismatched[:3]}). Pass the config the model was trained with (or the right prefix=)."
        )


__all__ = ["COMPANION_FILES", "LIBRARY_BUFFERS", "detect_prefix", "export_hf"]
