"""Fine-tuning from a Hugging Face folder without any rank holding the whole model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Attribute the strategy reads on the model: the folder to load each rank's slices from.
PRETRAINED_ATTR = "lightning_ep_pretrained"


def from_pretrained(folder: str | Path, **config_overrides: Any) -> nn.Module:
    """Build the model of a Hugging Face folder on the meta device, marked for sharded loading.

    Use it in ``configure_model``. ``ExpertParallelStrategy`` transforms and shards the model,
    allocates only each rank's shards, and reads exactly those slices from the folder
    (``models.hf_io.load_pretrained_sharded``), dequantizing FP8 and MXFP4 weights. The parameters
    take the dtype of the Trainer's precision, not the config's: fp32 master weights under
    ``bf16-mixed`` and ``32-true``, bf16 under ``bf16-true``.

    ``folder``: a local Hugging Face model folder (``config.json`` + ``*.safetensors``);
    ``config_overrides``: fields to change in the loaded config (e.g. ``router_jitter_noise=0.0``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"from_pretrained(folder={str(folder)!r}): no config.json there; pass a folder written by "
            "save_pretrained (a local path: nothing is downloaded)."
        )
    config = AutoConfig.from_pretrained(folder, **config_overrides)
    if getattr(config, "quantization_config", None) is not None:
        # FP8 / MXFP4 weights are dequantized into the model's dtype as they are read: the model in
        # memory is not quantized, and a save_pretrained of it must not claim it is.
        delattr(config, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    setattr(model, PRETRAINED_ATTR, str(folder))
    return model


def published_fp8_block(model: nn.Module) -> tuple[int, int]:
    """The FP8 block that keeps the scales of the folder ``model`` is marked to load from, for its
    routed experts kept in FP8 (``frozen_experts="fp8"``): the folder's blocks or groups
    (``weight_block_size``, or compressed-tensors' ``block_structure`` / ``group_size``), one row
    (``1 x`` the widest expert input) where it scales each row (compressed-tensors' ``channel``
    strategy, FBGEMM's FP8); else ``moe.quantized.FP8_BLOCK`` (which holds per-tensor scales exactly)."""
    from lightning_ep.models.hf_formats import fp8_blocks
    from lightning_ep.models.hf_stored import quantization_config
    from lightning_ep.moe.quantized import FP8_BLOCK

    folder = getattr(model, PRETRAINED_ATTR, None)
    quant = quantization_config(Path(folder)) if folder is not None else {}
    blocks = fp8_blocks(quant)
    if blocks:
        return blocks[0]
    groups = (quant.get("config_groups") or {}).values()
    per_row = quant.get("quant_method") == "fbgemm_fp8" or any(
        (g.get("weights") or {}).get("strategy") == "channel" for g in groups
    )
    widths = [
        int(t.shape[-1])
        for name, t in [*model.named_parameters(), *model.named_modules()]
        if name.rpartition(".")[2] in ("gate_up_proj", "down_proj") and len(getattr(t, "shape", ())) == 3
    ]
    return (1, max(widths)) if per_row and widths else FP8_BLOCK
