"""Which encoding (``hf_encodings``) each of a folder's tensors is in, from its key, its dtype, its
companions and the folder's ``quantization_config``: ``encode``, with ``check_readable`` first.

The quantized folders read (``check_readable`` refuses the others before any tensor is read):
``quant_method`` ``"fp8"`` (transformers' block-scaled ``weight_scale_inv``, or AutoFP8's per-tensor
``weight_scale``), ``"mxfp4"``, ``"fbgemm_fp8"`` (per-row ``weight_scale``), ``"modelopt"`` with
``quant_algo`` ``"FP8"``, ``"compressed-tensors"`` whose weights are 8-bit floats
(``float-quantized``: per tensor, channel, group or block), ``"bitsandbytes"`` in 4 bits (NF4 or
FP4, with or without double quantization, stored in uint8), ``"gptq"`` in 2, 4 or 8 bits
(``checkpoint_format`` ``"gptq"`` or ``"gptq_v2"``, act-order included) and ``"awq"`` (4 bits, the
``gemm`` version, with zero points)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from lightning_ep.models.hf_encodings import AWQ, BNB4, GPTQ, MXFP4, BlockFP8, Encoded, Plain
from lightning_ep.models.hf_stored import Opener, Stored

# An FP8 weight `x.weight` has its scales at `x.weight_scale_inv` (transformers, DeepSeek-V3) or at
# `x.weight_scale` (compressed-tensors, AutoFP8, ModelOpt, FBGEMM); both multiply the stored values.
FP8_SCALES = ("_scale_inv", "_scale")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# Static-FP8 companions that a dequantized model has no use for: activation and KV-cache scales.
ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")
# Weights in 8-bit floats, in the compressed-tensors formats that store them unpacked.
FLOAT8_FORMATS = ("float-quantized", "naive-quantized")
# A GPTQ or AWQ layer `x` stores `x.qweight`, `x.qzeros`, `x.scales` (and GPTQ's `x.g_idx`).
GPTQ_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
# A bitsandbytes 4-bit weight `x.weight` has its state beside it: `x.weight.absmax`, `x.weight.quant_map`
# (and `x.weight.nested_absmax`, `x.weight.nested_quant_map` when double-quantized) and the JSON rest
# packed in `x.weight.quant_state.bitsandbytes__nf4` (or `__fp4`).
BNB_STATE = ".quant_state.bitsandbytes__"
BNB_PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", BNB_STATE + "nf4", BNB_STATE + "fp4")


def check_readable(quant: Mapping[str, Any], folder: Path) -> None:
    """``ValueError`` naming the format when ``quant`` (a folder's ``quantization_config``) stores
    weights in a format this loader does not read (see the module docstring)."""
    method = quant.get("quant_method")
    if method is None or method in ("fp8", "mxfp4", "fbgemm_fp8"):
        return
    detail = None
    if method == "gptq":
        form = quant.get("checkpoint_format") or "gptq"
        if quant.get("bits") not in (2, 4, 8):
            detail = f"{quant.get('bits')}-bit"
        elif form not in ("gptq", "gptq_v2"):
            detail = f"checkpoint_format={form!r}"
    elif method == "awq":
        version = str(quant.get("version") or "gemm").lower()
        if quant.get("bits", 4) != 4 or version != "gemm" or quant.get("zero_point") is False:
            detail = f"{quant.get('bits', 4)}-bit, version {version!r}, zero_point={quant.get('zero_point', True)}"
    elif method == "bitsandbytes":
        storage = quant.get("bnb_4bit_quant_storage") or "uint8"
        if quant.get("load_in_8bit") or not quant.get("load_in_4bit"):
            detail = "8-bit (LLM.int8)"
        elif storage != "uint8":
            detail = f"4-bit stored in {storage}"
    elif method == "modelopt":
        algo = quant.get("quant_algo")
        detail = None if str(algo).upper() == "FP8" else f"quant_algo={algo!r}"
    elif method == "compressed-tensors":
        for name, group in (quant.get("config_groups") or {}).items():
            weights, form = group.get("weights") or {}, group.get("format") or quant.get("format")
            if weights and (
                weights.get("type") != "float" or weights.get("num_bits") != 8 or form not in FLOAT8_FORMATS
            ):
                detail = (
                    f"config group {name!r}: {weights.get('num_bits')}-bit {weights.get('type')} weights, "
                    f"format {form!r}"
                )
                break
        sparsity = (quant.get("sparsity_config") or {}).get("format")
        if detail is None and sparsity not in (None, "dense"):
            detail = f"sparsity format {sparsity!r}"
    else:
        detail = ""
    if detail is None:
        return
    raise ValueError(
        f"load_pretrained_sharded: {folder} is quantized with quant_method={method!r}"
        + (f" ({detail})" if detail else "")
        + ", which this loader does not read: it reads FP8 weights (weight_scale_inv or weight_scale: per "
        "tensor, row, group or block), MXFP4 experts, bitsandbytes' 4-bit, GPTQ's 2, 4 and 8-bit and AWQ's "
        "4-bit weights. Start from the publisher's bf16 or FP8 release; to hold the experts in 4 bits while "
        "LoRA trains, load it with ExpertParallelStrategy(frozen_experts='nf4') (or 'mxfp4')."
    )


def fp8_blocks(quant: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The block sizes ``quant`` names for FP8 scales: ``weight_block_size``, or compressed-tensors'
    ``block_structure`` and ``group_size`` (a group is a ``1 x group_size`` block)."""
    blocks = []
    if quant.get("weight_block_size"):
        blocks.append(quant["weight_block_size"])
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block" and weights.get("block_structure"):
            blocks.append(weights["block_structure"])
        elif weights.get("strategy") == "group" and weights.get("group_size"):
            blocks.append([1, weights["group_size"]])
    return [(int(b[0]), int(b[1])) for b in blocks]


def encode(tensors: Mapping[str, Stored], quant: Mapping[str, Any]) -> tuple[dict[str, Encoded], list[str]]:
    """The folder's tensors as logical values, each weight with its scales under the weight's key
    (``x.weight`` for ``x.weight`` + ``x.weight_scale_inv`` or ``x.weight_scale``), and the unused
    static activation scales."""
    encoded: dict[str, Encoded] = {}
    activation_scales: list[str] = []
    blocks = fp8_blocks(quant)
    with closing(Opener()) as opener:
        bnb = {key: _bnb4(key, tensors, opener) for key in tensors if _bnb_state_key(key, tensors) is not None}
    method = quant.get("quant_method")
    gptq = {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight") and method in ("gptq", "awq")}
    for key, stored in tensors.items():
        if _fp8_scale_of(key, tensors) is not None or _bnb_part_of(key, bnb) is not None:
            continue  # read with its weight
        if any(key.endswith(p) and key[: -len(p)] in gptq for p in GPTQ_PARTS):
            if key.endswith(".qweight"):
                layer = key[: -len(".qweight")]
                encoded[layer + ".weight"] = (
                    _gptq(layer, tensors, quant) if method == "gptq" else _awq(layer, tensors, quant)
                )
            continue
        if key in bnb:
            encoded[key] = bnb[key]
            continue
        if key.endswith(MXFP4_SCALES) and key[: -len(MXFP4_SCALES)] + MXFP4_BLOCKS in tensors:
            continue
        scale = next((tensors[key + s] for s in FP8_SCALES if key + s in tensors), None)
        if key.endswith(ACTIVATION_SCALES) and quant:
            activation_scales.append(key)
        elif key.endswith(MXFP4_BLOCKS) and key[: -len(MXFP4_BLOCKS)] + MXFP4_SCALES in tensors:
            base = key[: -len(MXFP4_BLOCKS)]
            encoded[base] = MXFP4(stored, tensors[base + MXFP4_SCALES])
        elif scale is not None and stored.dtype in FP8_DTYPES:
            encoded[key] = BlockFP8(stored, scale, _fp8_block(stored, scale, blocks))
        elif scale is not None:
            raise ValueError(
                f"load_pretrained_sharded: {key!r} is stored as {stored.dtype} with scales {scale.key!r}: a "
                f"quantized format this loader does not read (quant_method={quant.get('quant_method')!r}); it "
                "reads scaled weights stored in FP8 (F8_E4M3). Start from the publisher's bf16 or FP8 release."
            )
        else:
            encoded[key] = Plain(stored)
    return encoded, activation_scales


def _gptq(layer: str, tensors: Mapping[str, Stored], quant: Mapping[str, Any]) -> GPTQ:
    """``layer``'s GPTQ weight, its parts checked against each other."""
    bits, group = int(quant["bits"]), int(quant.get("group_size") or -1)
    qweight = tensors[layer + ".qweight"]
    missing = [layer + p for p in GPTQ_PARTS[1:3] if layer + p not in tensors]
    scales = () if missing else tensors[layer + ".scales"].shape
    if missing or qweight.dtype != "I32" or len(qweight.shape) != 2 or scales[1:] != qweight.shape[1:]:
        found = f"no {missing}" if missing else f"qweight {qweight.dtype} {list(qweight.shape)}, scales {list(scales)}"
        raise ValueError(
            f"load_pretrained_sharded: the GPTQ layer {layer!r} has {found}: not the {bits}-bit GPTQ layout "
            "(qweight int32 [in * bits / 32, out], scales [groups, out]) that config.json names; the folder is "
            "incomplete or saved in another format."
        )
    size = group if group > 0 else qweight.shape[0] * 32 // bits
    v1 = (quant.get("checkpoint_format") or "gptq") == "gptq"
    return GPTQ(
        qweight, tensors[layer + ".qzeros"], tensors[layer + ".scales"], tensors.get(layer + ".g_idx"), bits, size, v1
    )


def _awq(layer: str, tensors: Mapping[str, Stored], quant: Mapping[str, Any]) -> AWQ:
    """``layer``'s AWQ weight, its parts checked against each other."""
    group, qweight = int(quant.get("group_size") or 128), tensors[layer + ".qweight"]
    missing = [layer + p for p in (".qzeros", ".scales") if layer + p not in tensors]
    scales = () if missing else tensors[layer + ".scales"].shape
    inputs, packed = qweight.shape if len(qweight.shape) == 2 else (0, 0)
    if missing or qweight.dtype != "I32" or scales != (-(-inputs // group), packed * 8):
        found = f"no {missing}" if missing else f"qweight {qweight.dtype} {list(qweight.shape)}, scales {list(scales)}"
        raise ValueError(
            f"load_pretrained_sharded: the AWQ layer {layer!r} has {found}: not the 4-bit GEMM layout (qweight "
            f"int32 [in, out / 8], scales [in / {group}, out]) that config.json names; the folder is incomplete "
            "or saved in another format."
        )
    return AWQ(qweight, tensors[layer + ".qzeros"], tensors[layer + ".scales"], group)


def _bnb_state_key(key: str, tensors: Mapping[str, Stored]) -> str | None:
    """The packed state of ``key`` when it is a bitsandbytes 4-bit weight, or ``None``."""
    return next((key + BNB_STATE + q for q in ("nf4", "fp4") if key + BNB_STATE + q in tensors), None)


def _bnb_part_of(key: str, weights: Mapping[str, BNB4]) -> str | None:
    """The bitsandbytes weight whose state ``key`` holds, or ``None``."""
    return next((key[: -len(p)] for p in BNB_PARTS if key.endswith(p) and key[: -len(p)] in weights), None)


def _bnb4(key: str, tensors: Mapping[str, Stored], opener: Opener) -> BNB4:
    """``key``'s bitsandbytes 4-bit weight, its packed JSON state and maps read (a few hundred bytes)."""
    state_key = _bnb_state_key(key, tensors)
    assert state_key is not None
    packed = opener.read(tensors[state_key], (slice(0, tensors[state_key].shape[0]),))
    state = json.loads(bytes(packed.tolist()).decode("utf-8"))
    parts = [".absmax", ".quant_map", *((".nested_absmax", ".nested_quant_map") if "nested_offset" in state else ())]
    missing = [key + p for p in parts if key + p not in tensors]
    if missing or tensors[key].dtype != "U8":
        raise ValueError(
            f"load_pretrained_sharded: {key!r} is a bitsandbytes 4-bit weight ({state_key!r}) but "
            + (f"{missing} are missing" if missing else f"is stored as {tensors[key].dtype}, not uint8")
            + "; the folder is incomplete or saved with another quant storage. Start from the publisher's bf16 release."
        )

    def values(name: str) -> tuple[float, ...]:
        stored = tensors[key + name]
        return tuple(opener.read(stored, (slice(0, stored.shape[0]),)).to(torch.float32).tolist())

    nested = None
    if "nested_offset" in state:
        nested = (tensors[key + ".nested_absmax"], tensors[key + ".nested_quant_map"])
    return BNB4(
        tensors[key],
        tensors[key + ".absmax"],
        tuple(int(n) for n in state["shape"]),
        str(state["quant_type"]),
        int(state["blocksize"]),
        values(".quant_map"),
        nested,
        int(state.get("nested_blocksize", 256)),
        float(state.get("nested_offset", 0.0)),
    )


def _fp8_scale_of(key: str, tensors: Mapping[str, Stored]) -> str | None:
    """The FP8 weight whose scales ``key`` holds, or ``None``."""
    for suffix in FP8_SCALES:
        if key.endswith(suffix) and key[: -len(suffix)] in tensors:
            return key[: -len(suffix)]
    return None


def _fp8_block(weight: Stored, scale: Stored, blocks: list[tuple[int, int]]) -> tuple[int, int]:
    """The rows and columns one scale covers: the whole matrix for one scale (per tensor, or per
    matrix of a stacked tensor), a block of ``blocks`` (the folder's configured sizes) whose grid the
    scales form, or ``1 x cols`` for one scale per row; checked against the stored grid."""
    if len(weight.shape) < 2:
        raise ValueError(
            f"load_pretrained_sharded: {weight.key!r} {list(weight.shape)} has scales {scale.key!r} but is not a "
            "matrix; block-scaled FP8 weights are [..., rows, cols]."
        )
    rows, cols = weight.shape[-2:]
    if math.prod(scale.shape) == 1:  # one scale for the whole tensor
        return rows, cols

    def grid(block: tuple[int, int]) -> tuple[int, ...]:
        return (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))

    for block in [*blocks, (rows, cols), (1, cols)]:
        if tuple(scale.shape) == grid(block):
            return block
    if not blocks:
        raise ValueError(
            f"load_pretrained_sharded: {weight.key!r} has block scales {list(scale.shape)} but the folder's "
            "config.json has no quantization_config.weight_block_size; add the block size the weights were "
            'quantized with, e.g. "weight_block_size": [128, 128].'
        )
    br, bc = blocks[0]
    raise ValueError(
        f"load_pretrained_sharded: {scale.key!r} is {list(scale.shape)} but {weight.key!r} "
        f"{list(weight.shape)} in blocks of {[br, bc]} needs a grid of {list(grid((br, bc)))}; the scales do not "
        "belong to this weight or weight_block_size is wrong."
    )


__all__ = ["check_readable", "encode", "fp8_blocks"]
