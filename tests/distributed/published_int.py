"""4-bit and integer releases, written from tiny random models (``published`` has the FP8 and MXFP4
ones), each writer held to the publishing tool's own bytes recorded in ``tests/data``:

- ``write_bnb4``: a bitsandbytes ``load_in_4bit`` release (as transformers 4.x saved Mixtral and
  Qwen-MoE with per-expert linear layers): every linear weight of the decoder layers, routers included,
  quantized as bitsandbytes' ``quantize_4bit`` quantizes it (NF4 or FP4, blocks of 64, double
  quantization; ``bnb4_quantize``, held to bitsandbytes' own bytes in ``tests/data``) and saved as
  its ``Linear4bit`` saves it (the state packed beside the bytes).
- ``write_gptq``: a GPTQ release (AutoGPTQ's layout: Qwen's ``*-GPTQ-Int4``, TheBloke's Mixtral): the
  linear weights of the decoder layers but the routers as ``qweight`` / ``qzeros`` / ``scales`` /
  ``g_idx``, 4 or 8 bits, groups in order or act-order, zero points stored less one (``gptq``) or not
  (``gptq_v2``); ``gptq_pack`` is held to AutoGPTQ's own bytes in ``tests/data``.
- ``write_awq``: an AWQ release (AutoAWQ's ``gemm`` layout: TheBloke's and casperhansen's Mixtral): the
  same layers as ``qweight [in, out / 8]`` (outputs packed in AWQ's interleaved order), ``qzeros``,
  ``scales``; ``awq_pack`` is held to AutoAWQ's own bytes in ``tests/data``.

Each has its dequantization by hand (``*_dequantized``), written from the format, as the reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from published import edit_config, quantized_linear, read_folder, write_shards
from safetensors import safe_open
from torch import nn

# --------------------------------------------------------------------------------------------
# bitsandbytes 4-bit
# --------------------------------------------------------------------------------------------

#: bitsandbytes' own output for one weight (``tests/data/make_bnb4_reference.py``): its bytes, state
#: and dequantization, and its 4-bit and 8-bit maps, which ``write_bnb4`` quantizes with.
BNB4_REFERENCE = Path(__file__).resolve().parents[1] / "data" / "bnb4_reference.safetensors"


def bnb4_reference() -> dict[str, torch.Tensor]:
    with safe_open(str(BNB4_REFERENCE), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def bnb4_quantize(
    w: torch.Tensor, quant_type: str = "nf4", block: int = 64, double: bool = True
) -> dict[str, torch.Tensor]:
    """``w`` quantized as bitsandbytes' ``quantize_4bit`` quantizes it and saved as its ``Linear4bit``
    saves it, under ``weight`` and ``weight.<state>`` (``tests/unit/test_published_int_layouts.py`` checks
    this equals bitsandbytes' own bytes): the flattened weight in blocks of ``block``, each scaled by
    ``1 / absmax`` and given the index of the bucket of the sorted 4-bit map its value falls in, two
    indices a byte (the first in the high nibble); with ``double``, the absmax less their mean in
    blocks of 256, each value the nearest of the 8-bit dynamic map after scaling by its block's amax."""
    reference = bnb4_reference()
    table = reference[f"{quant_type}_double.weight.quant_map"]
    flat = w.reshape(-1).float()
    full = flat.numel() // block * block  # whole blocks, then a partial one (divided, not multiplied)
    blocks = flat[:full].unflatten(0, (-1, block))
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1)
    if full < flat.numel():
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax, scaled = torch.cat([absmax, last[None]]), torch.cat([scaled, (flat[full:] / last).clamp(-1, 1)])
    if scaled.numel() % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])
    order = torch.argsort(table)
    sorted_table = table[order]
    index = order[torch.bucketize(scaled, (sorted_table[:-1] + sorted_table[1:]) / 2)].to(torch.uint8)
    state: dict[str, object] = {
        "quant_type": quant_type,
        "blocksize": block,
        "dtype": str(w.dtype).removeprefix("torch."),
        "shape": list(w.shape),
    }
    out = {"weight": ((index[0::2] << 4) | index[1::2]).unsqueeze(1), "weight.quant_map": table}
    if double:
        nested_map = reference["nf4_double.weight.nested_quant_map"]
        offset = absmax.mean()
        centred = absmax - offset
        groups = [centred[i : i + 256] for i in range(0, centred.numel(), 256)]
        nested_absmax = torch.stack([g.abs().max() for g in groups])
        codes = torch.cat([(g / m)[:, None].sub(nested_map).abs().argmin(dim=1) for g, m in zip(groups, nested_absmax)])
        out["weight.absmax"] = codes.to(torch.uint8)
        out["weight.nested_absmax"], out["weight.nested_quant_map"] = nested_absmax, nested_map
        state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=offset.item())
    else:
        out["weight.absmax"] = absmax
    out[f"weight.quant_state.bitsandbytes__{quant_type}"] = torch.tensor(
        list(json.dumps(state).encode()), dtype=torch.uint8
    )
    return out


def bnb4_dequantize_by_hand(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """bitsandbytes' 4-bit weight ``key`` of ``tensors`` dequantized from its format as documented:
    value ``i`` is ``quant_map[index i] * absmax[i // blocksize]`` (index ``2 j`` the high nibble of byte
    ``j``), a double-quantized absmax ``b`` being ``nested_quant_map[code b] * nested_absmax[b // 256]
    + offset``; fp32 products, as bitsandbytes' kernels compute them."""
    state_key = next(k for k in tensors if k.startswith(f"{key}.quant_state.bitsandbytes__"))
    state = json.loads(bytes(tensors[state_key].tolist()).decode())
    absmax = tensors[f"{key}.absmax"]
    if "nested_offset" in state:
        blocks = torch.arange(absmax.numel()) // state["nested_blocksize"]
        scaled = tensors[f"{key}.nested_quant_map"][absmax.long()] * tensors[f"{key}.nested_absmax"][blocks]
        absmax = scaled + torch.tensor(state["nested_offset"], dtype=torch.float32)
    count = math.prod(state["shape"])
    packed = tensors[key].reshape(-1).long()
    indices = torch.stack((packed >> 4, packed & 15), dim=1).reshape(-1)[:count]
    values = tensors[f"{key}.quant_map"][indices] * absmax[torch.arange(count) // state["blocksize"]]
    return values.reshape(state["shape"])


def _bnb_target(key: str, tensor: torch.Tensor) -> bool:
    """The weights transformers' ``load_in_4bit`` quantizes: every linear layer's but the head's."""
    return tensor.ndim == 2 and ".layers." in key and key.endswith(".weight")


def write_bnb4(
    model: nn.Module, folder: Path, *, quant_type: str = "nf4", double: bool = True, shards: int = 2
) -> Path:
    """``model`` saved as a bitsandbytes 4-bit release (see the module docstring); returns ``folder``."""
    model.save_pretrained(folder)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in read_folder(folder).items():
        if _bnb_target(key, tensor):
            quantized = bnb4_quantize(tensor, quant_type, double=double)
            out.update({key + name.removeprefix("weight"): value for name, value in quantized.items()})
        else:
            out[key] = tensor
    write_shards(out, folder, shards)
    quant = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": quant_type,
        "bnb_4bit_use_double_quant": double,
        "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": None,
    }
    edit_config(folder, quantization_config=quant)
    return folder


def bnb4_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors in fp32 under their stored names, its 4-bit weights dequantized by hand
    (``bnb4_dequantize_by_hand``)."""
    state = read_folder(folder)
    weights = [k[: -len(".quant_state.bitsandbytes__nf4")] for k in state if k.endswith(("__nf4", "__fp4"))]
    out = {key: bnb4_dequantize_by_hand(state, key) for key in weights}
    return {
        **{k: v.float() for k, v in state.items() if not any(k.startswith(w + ".") or k == w for w in weights)},
        **out,
    }


# --------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------

#: AutoGPTQ's own packing and dequantization of four layers (``tests/data/make_gptq_reference.py``).
GPTQ_REFERENCE = Path(__file__).resolve().parents[1] / "data" / "gptq_reference.safetensors"


def gptq_reference() -> dict[str, torch.Tensor]:
    with safe_open(str(GPTQ_REFERENCE), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values [n, m]`` (ints below ``2^bits``) packed ``32 / bits`` to an int32 along dim 0, lowest bits first."""
    per = 32 // bits
    grouped = values.to(torch.int64).unflatten(0, (-1, per))
    packed = sum(grouped[:, k] << (bits * k) for k in range(per))
    return torch.as_tensor(packed).to(torch.uint32).view(torch.int32)


def gptq_pack(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int, v2: bool = False
) -> dict[str, torch.Tensor]:
    """A GPTQ layer's tensors from ``q [out, in]`` (its values on the grid), ``zeros [out, G]``,
    ``scales [out, G]`` and ``g_idx [in]``, as AutoGPTQ's ``QuantLinear.pack`` writes them:
    ``qweight`` packs ``q`` along ``in``, ``qzeros`` packs the zero points (less one, as the original
    format stores them, unless ``v2``) along ``out``, ``scales [G, out]``."""
    stored_zeros = (zeros.to(torch.int64) - (0 if v2 else 1)) & (2**bits - 1)
    return {
        "qweight": _pack(q.t(), bits),
        "qzeros": _pack(stored_zeros, bits).t().contiguous(),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def gptq_quantize(
    w: torch.Tensor, bits: int = 4, group: int = 32, act_order: bool = False, v2: bool = False
) -> dict[str, torch.Tensor]:
    """``w [out, in]`` quantized with asymmetric min-max scales (fp16) and zero points per group of
    ``group`` input features (a random permutation's groups under ``act_order``), then ``gptq_pack``."""
    out_features, in_features = w.shape
    g_idx = torch.arange(in_features) // group
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))]
    maxq = 2**bits - 1
    scales = torch.empty(out_features, in_features // group, dtype=torch.float16)
    zeros = torch.empty(out_features, in_features // group, dtype=torch.int64)
    for g in range(in_features // group):
        cols = w[:, g_idx == g].float()
        low, high = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
        scales[:, g] = ((high - low) / maxq).clamp(min=1e-4)
        zeros[:, g] = torch.round(-low / scales[:, g].float()).clamp(0, maxq).long()
    scale_i, zero_i = scales.float()[:, g_idx], zeros[:, g_idx]
    q = (torch.round(w.float() / scale_i) + zero_i).clamp(0, maxq).long()
    return gptq_pack(q, zeros, scales, g_idx, bits, v2)


def gptq_dequantize_by_hand(tensors: dict[str, torch.Tensor], layer: str, bits: int, v2: bool = False) -> torch.Tensor:
    """GPTQ layer ``layer`` of ``tensors`` as ``[out, in]`` fp32 values, by loops over input features
    written from the format: ``scales[g, o] * (q[i, o] - z[g, o])``, ``g = g_idx[i]``."""
    per, mask = 32 // bits, 2**bits - 1
    qweight = tensors[f"{layer}.qweight"].to(torch.int64) & 0xFFFFFFFF
    qzeros = tensors[f"{layer}.qzeros"].to(torch.int64) & 0xFFFFFFFF
    scales, g_idx = tensors[f"{layer}.scales"].float(), tensors[f"{layer}.g_idx"].tolist()
    out_features = qweight.shape[1]
    zeros = torch.stack([(qzeros[:, o // per] >> (bits * (o % per))) & mask for o in range(out_features)], dim=1)
    zeros = zeros if v2 else (zeros + 1) & mask
    columns = []
    for i, g in enumerate(g_idx):
        q = (qweight[i // per] >> (bits * (i % per))) & mask
        columns.append(scales[g] * (q - zeros[g]).float())
    return torch.stack(columns, dim=1)


def write_gptq(
    model: nn.Module, folder: Path, *, bits: int = 4, group: int = 32, act_order: bool = False, v2: bool = False
) -> Path:
    """``model`` saved as a GPTQ release (see the module docstring); returns ``folder``."""
    model.save_pretrained(folder)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in read_folder(folder).items():
        if quantized_linear(key, tensor):
            layer = key.removesuffix(".weight")
            quantized = gptq_quantize(tensor, bits, group, act_order, v2)
            out.update({f"{layer}.{name}": value for name, value in quantized.items()})
        else:
            out[key] = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
    write_shards(out, folder, shards=2)
    quant = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": act_order,
        "sym": False,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
        "damp_percent": 0.01,
        "true_sequential": True,
    }
    edit_config(folder, quantization_config=quant, dtype="float16")
    return folder


def gptq_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors in fp32 under their stored names, its GPTQ layers dequantized by hand
    (``gptq_dequantize_by_hand``) under ``<layer>.weight``."""
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    state = read_folder(folder)
    layers = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    v2 = quant["checkpoint_format"] == "gptq_v2"
    out = {f"{layer}.weight": gptq_dequantize_by_hand(state, layer, quant["bits"], v2) for layer in layers}
    parts = (".qweight", ".qzeros", ".scales", ".g_idx")
    return {**{k: v.float() for k, v in state.items() if not k.endswith(parts)}, **out}


# --------------------------------------------------------------------------------------------
# AWQ
# --------------------------------------------------------------------------------------------

#: AutoAWQ's own packing and dequantization of two layers (``tests/data/make_awq_reference.py``).
AWQ_REFERENCE = Path(__file__).resolve().parents[1] / "data" / "awq_reference.safetensors"
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of an int32 holds, lowest bits first


def awq_reference() -> dict[str, torch.Tensor]:
    with safe_open(str(AWQ_REFERENCE), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """``values [n, 8 m]`` (4-bit ints) as int32 ``[n, m]``: nibble ``k`` of column ``c`` holds ``8 c + order[k]``."""
    grouped = values.to(torch.int64).unflatten(1, (-1, 8))
    packed = sum(grouped[:, :, _AWQ_ORDER[k]] << (4 * k) for k in range(8))
    return torch.as_tensor(packed).to(torch.uint32).view(torch.int32)


def awq_pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """An AWQ layer's tensors from ``q [out, in]`` (its values on the grid), ``zeros [out, G]`` and
    ``scales [out, G]``, as AutoAWQ's ``WQLinear_GEMM.from_linear`` writes them."""
    return {
        "qweight": _awq_pack(q.t()),
        "qzeros": _awq_pack(zeros.t()),
        "scales": scales.t().contiguous(),
    }


def awq_quantize(w: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """``w [out, in]`` quantized with asymmetric min-max scales (fp16) and zero points per group of
    ``group`` input features, then ``awq_pack``."""
    grouped = w.float().unflatten(1, (-1, group))
    low, high = grouped.amin(dim=2).clamp(max=0), grouped.amax(dim=2).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    q = (torch.round(grouped / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15).flatten(1)
    return awq_pack(q.long(), zeros.long(), scales)


def awq_dequantize_by_hand(tensors: dict[str, torch.Tensor], layer: str, group: int) -> torch.Tensor:
    """AWQ layer ``layer`` of ``tensors`` as ``[out, in]`` fp32 values, by loops over outputs written
    from the format: ``(q[i, o] - z[i // group, o]) * scales[i // group, o]``."""
    qweight = tensors[f"{layer}.qweight"].to(torch.int64) & 0xFFFFFFFF
    qzeros = tensors[f"{layer}.qzeros"].to(torch.int64) & 0xFFFFFFFF
    scales = tensors[f"{layer}.scales"].float()
    groups = torch.arange(qweight.shape[0]) // group
    rows = []
    for o in range(qweight.shape[1] * 8):
        shift = 4 * _AWQ_ORDER.index(o % 8)
        q = (qweight[:, o // 8] >> shift) & 15
        z = (qzeros[:, o // 8] >> shift) & 15
        rows.append((q - z[groups]).float() * scales[groups, o])
    return torch.stack(rows)


def write_awq(model: nn.Module, folder: Path, *, group: int = 32) -> Path:
    """``model`` saved as an AWQ release (see the module docstring); returns ``folder``."""
    model.save_pretrained(folder)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in read_folder(folder).items():
        if quantized_linear(key, tensor):
            layer = key.removesuffix(".weight")
            out.update({f"{layer}.{name}": value for name, value in awq_quantize(tensor, group).items()})
        else:
            out[key] = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
    write_shards(out, folder, shards=2)
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    edit_config(folder, quantization_config={**quant, "modules_to_not_convert": ["gate"]}, dtype="float16")
    return folder


def awq_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors in fp32 under their stored names, its AWQ layers dequantized by hand under
    ``<layer>.weight``."""
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["group_size"]
    state = read_folder(folder)
    layers = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    out = {f"{layer}.weight": awq_dequantize_by_hand(state, layer, group) for layer in layers}
    return {**{k: v.float() for k, v in state.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}, **out}
