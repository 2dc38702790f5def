"""Folders laid out as publishers ship them, written from tiny random models.

- ``write_fp8``: DeepSeek-V3's FP8 release format: every linear weight of the decoder layers in
  ``float8_e4m3fn`` with one scale per ``br x bc`` block in ``weight_scale_inv`` (fp32, or E8M0
  powers of two), partial last blocks where a dimension is not a multiple of the block;
  embeddings, norms, routers and the head stay as they are; ``quantization_config`` as the
  release writes it. Per-expert keys come from ``save_pretrained`` (transformers' own split).
- ``write_compressed_fp8``: llm-compressor's FP8 schemes (compressed-tensors' ``float-quantized``
  format, as RedHatAI's ``*-FP8-dynamic`` / ``*-FP8-BLOCK`` releases ship): each linear weight of the
  decoder layers but the router in ``float8_e4m3fn`` with a bf16 ``weight_scale`` (a multiplier) per
  tensor ``[1]``, per output row ``[R, 1]``, per group of columns or per block.
- ``write_autofp8``: AutoFP8's static per-tensor layout (neuralmagic's Mixtral-8x7B-Instruct-v0.1-FP8):
  scalar fp32 ``weight_scale`` and ``input_scale`` beside each FP8 weight, ``quant_method: "fp8"``
  without ``weight_block_size``.
- ``write_mxfp4``: GPT-OSS's release format: the experts as ``*_blocks`` (two E2M1 values per
  byte, low nibble first) and ``*_scales`` (E8M0 per 32 values), ``[E, out, in/32, 16]``.
- ``add_mtp_layer``: the multi-token-prediction layer DeepSeek-V3 and GLM-4.5 ship as
  ``model.layers.{num_hidden_layers}.*`` (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head``, a whole
  MoE layer with per-expert keys), which transformers' causal-LM classes do not load.

``dequantized_by_hand`` reads such a folder back with loops over blocks and groups written
independently of the library, as the reference where transformers' own dequantization cannot serve.
The 4-bit and integer releases (bitsandbytes, GPTQ, AWQ) are in ``published_int``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state.update({key: f.get_tensor(key) for key in f.keys()})
    return state


def write_shards(state: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """``state`` as ``shards`` safetensors files with an index (one file without), replacing the old ones."""
    for old in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    keys = sorted(state)
    if shards == 1:
        save_file({k: state[k].contiguous() for k in keys}, folder / "model.safetensors")
        return
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k].contiguous() for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))


def edit_config(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}, indent=2))


# --------------------------------------------------------------------------------------------
# FP8, block-scaled
# --------------------------------------------------------------------------------------------


def fp8_quantize(w: torch.Tensor, block: tuple[int, int], e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` as ``float8_e4m3fn`` values and per-block scales ``[ceil(R/br), ceil(C/bc)]``."""
    (rows, cols), (br, bc) = w.shape, block
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    scale = torch.empty(grid, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            s = max(float(tile.abs().max()), 1e-8) / FP8_MAX
            if e8m0:
                s = 2.0 ** math.ceil(math.log2(s))
            scale[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if e8m0 else scale


def fp8_dequantize_by_hand(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    (rows, cols), (br, bc) = q.shape, block
    out = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            s = float(scale[i, j].float())
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (
                q[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float() * s
            )
    return out


def quantized_linear(key: str, tensor: torch.Tensor) -> bool:
    """The weights the releases quantize (DeepSeek-V3's FP8, llm-compressor's, AutoFP8's, GPTQ's, AWQ's): the
    decoder layers' linear weights except the routers."""
    return (
        tensor.ndim == 2
        and ".layers." in key
        and key.endswith(".weight")
        and not key.endswith(("gate.weight", "head.weight"))
    )


def write_fp8(
    model: nn.Module,
    folder: Path,
    block: tuple[int, int] = (16, 16),
    *,
    e8m0: bool = False,
    shards: int = 3,
    mtp: bool = False,
) -> Path:
    """``model`` saved as an FP8 release (see the module docstring); returns ``folder``."""
    model.save_pretrained(folder)
    state = read_folder(folder)
    if mtp:
        state.update(mtp_layer(model, state))
    quantized: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if quantized_linear(key, tensor):
            quantized[key], quantized[key + "_scale_inv"] = fp8_quantize(tensor, block, e8m0)
        else:
            quantized[key] = tensor.to(torch.bfloat16)
    write_shards(quantized, folder, shards)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    edit_config(folder, quantization_config=quant, **({"num_nextn_predict_layers": 1} if mtp else {}))
    return folder


# --------------------------------------------------------------------------------------------
# FP8 with a weight_scale: llm-compressor (compressed-tensors) and AutoFP8
# --------------------------------------------------------------------------------------------

SCHEME_SCALES = ("tensor", "channel", "group", "block")


def scheme_block(strategy: str, shape: tuple[int, int], group: int, block: tuple[int, int]) -> tuple[int, int]:
    """The rows and columns one scale covers under an llm-compressor weight strategy."""
    rows, cols = shape
    return {"tensor": (rows, cols), "channel": (1, cols), "group": (1, group), "block": block}[strategy]


def fp8_scaled(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` in ``float8_e4m3fn`` and its scales (amax / 448 per block, rounded to ``scale_dtype``
    before dividing, as a checkpoint's values are computed from its stored scale)."""
    (rows, cols), (br, bc) = w.shape, block
    scale = torch.empty(math.ceil(rows / br), math.ceil(cols / bc), dtype=scale_dtype)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            scale[i, j] = max(float(tile.abs().max()), 1e-8) / FP8_MAX
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / float(scale[i, j])).to(torch.float8_e4m3fn)
    return q, scale


def write_compressed_fp8(
    model: nn.Module,
    folder: Path,
    strategy: str,
    *,
    group: int = 16,
    block: tuple[int, int] = (16, 16),
    shards: int = 2,
) -> Path:
    """``model`` saved as llm-compressor saves an FP8 scheme (see the module docstring): the scales
    are ``[1]`` per tensor, else the grid of ``scheme_block``; ``quantization_config`` as llm-compressor
    writes it, the head and the router left in bf16 (``ignore``). Returns ``folder``."""
    model.save_pretrained(folder)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in read_folder(folder).items():
        if quantized_linear(key, tensor):
            q, scale = fp8_scaled(tensor, scheme_block(strategy, tensor.shape, group, block), torch.bfloat16)
            out[key], out[key + "_scale"] = q, scale.reshape(1) if strategy == "tensor" else scale
        else:
            out[key] = tensor.to(torch.bfloat16)
    write_shards(out, folder, shards)
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": strategy,
        "group_size": group if strategy == "group" else None,
        "block_structure": list(block) if strategy == "block" else None,
        "observer": "minmax",
        "actorder": None,
        "observer_kwargs": {},
    }
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    quant = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head", "re:.*gate$"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "version": "0.10.2",
    }
    edit_config(folder, quantization_config=quant)
    return folder


def write_autofp8(model: nn.Module, folder: Path, *, shards: int = 2) -> Path:
    """``model`` saved in AutoFP8's static per-tensor layout (see the module docstring)."""
    model.save_pretrained(folder)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in read_folder(folder).items():
        if quantized_linear(key, tensor):
            q, scale = fp8_scaled(tensor, tuple(tensor.shape), torch.float32)
            out[key], out[key + "_scale"] = q, scale.reshape(())
            out[key.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
        else:
            out[key] = tensor.to(torch.bfloat16)
    write_shards(out, folder, shards)
    quant = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    edit_config(folder, quantization_config=quant)
    return folder


# --------------------------------------------------------------------------------------------
# MXFP4 (GPT-OSS experts)
# --------------------------------------------------------------------------------------------


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., out, in]`` (``in`` a multiple of 32) as ``blocks uint8 [..., out, in/32, 16]`` and
    ``scales uint8 [..., out, in/32]``: each group of 32 scaled by a power of two so that its largest
    magnitude fits 6, each value rounded to the nearest E2M1 value."""
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-8)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    values = torch.tensor(E2M1)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    nibbles = (scaled.unsqueeze(-1) - values).abs().argmin(-1).to(torch.uint8)  # nearest; +0 before -0
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def mxfp4_dequantize_by_hand(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., out, in]`` in fp32, one byte at a time: low nibble, then high nibble, times ``2^(s - 127)``."""
    flat_blocks, flat_scales = blocks.reshape(-1, 16), scales.reshape(-1)
    out = torch.empty(flat_blocks.shape[0], 32)
    for g in range(flat_blocks.shape[0]):
        factor = 2.0 ** (int(flat_scales[g]) - 127)
        for i in range(16):
            byte = int(flat_blocks[g, i])
            out[g, 2 * i], out[g, 2 * i + 1] = E2M1[byte & 15] * factor, E2M1[byte >> 4] * factor
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def write_mxfp4(model: nn.Module, folder: Path, *, shards: int = 2) -> Path:
    """A GPT-OSS ``model`` saved as OpenAI's release stores it: MXFP4 experts, the rest in bf16."""
    model.save_pretrained(folder)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in read_folder(folder).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # In memory [E, in, out]; stored [E, out, in/32, 16] (transformers transposes on load).
            state[key + "_blocks"], state[key + "_scales"] = mxfp4_quantize(tensor.transpose(1, 2))
        else:
            state[key] = tensor.to(torch.bfloat16)
    write_shards(state, folder, shards)
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    edit_config(folder, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": not_converted})
    return folder


# --------------------------------------------------------------------------------------------
# Multi-token prediction layers
# --------------------------------------------------------------------------------------------


def mtp_layer(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a multi-token-prediction layer at index ``num_hidden_layers``: a copy of the last
    decoder layer's (per-expert expert keys included) plus ``eh_proj``, ``enorm``, ``hnorm`` and
    ``shared_head``, with random values."""
    n = model.config.num_hidden_layers
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(99)
    layer = {
        mtp + k[len(last) :]: torch.randn(v.shape, generator=gen) * 0.02 for k, v in state.items() if k.startswith(last)
    }
    layer.update(
        {
            mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.02,
            mtp + "enorm.weight": torch.ones(hidden),
            mtp + "hnorm.weight": torch.ones(hidden),
            mtp + "shared_head.norm.weight": torch.ones(hidden),
            mtp + "shared_head.head.weight": torch.randn(model.config.vocab_size, hidden, generator=gen) * 0.02,
        }
    )
    return layer


def add_mtp_layer(model: nn.Module, folder: Path) -> Path:
    """``model`` saved with ``save_pretrained`` plus a multi-token-prediction layer (plain bf16)."""
    model.save_pretrained(folder)
    state = read_folder(folder)
    state.update({k: v.to(torch.bfloat16) for k, v in mtp_layer(model, state).items()})
    write_shards(state, folder, shards=2)
    edit_config(folder, num_nextn_predict_layers=1)
    return folder


# --------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------


def dequantized_by_hand(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors in fp32 under their stored names (``*_blocks`` -> their base name,
    transposed to ``[E, in, out]``), dequantized by the loops above; scales dropped."""
    quant = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    weights = quant.get("config_groups", {}).get("group_0", {}).get("weights", {})
    state = read_folder(folder)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.endswith(("_scale_inv", "_scales", "_scale")):
            continue
        scale = state.get(key + "_scale_inv", state.get(key + "_scale"))
        if scale is not None:
            rows, cols = tensor.shape
            if scale.numel() == 1:
                block = (rows, cols)
            elif weights:
                block = scheme_block(
                    weights["strategy"], (rows, cols), weights["group_size"], weights["block_structure"]
                )
            else:
                block = tuple(quant["weight_block_size"])
            out[key] = fp8_dequantize_by_hand(tensor, scale.reshape(-(-rows // block[0]), -1), block)  # type: ignore[arg-type]
        elif key.endswith("_blocks"):
            base = key[: -len("_blocks")]
            out[base] = mxfp4_dequantize_by_hand(tensor, state[base + "_scales"]).transpose(1, 2).contiguous()
        else:
            out[key] = tensor.float()
    return out
