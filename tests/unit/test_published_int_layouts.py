"""bitsandbytes 4-bit, GPTQ and AWQ releases through ``load_pretrained_sharded``, on one process.

The reference is each publishing tool's own output, recorded in ``tests/data`` (bitsandbytes'
``quantize_4bit`` / ``dequantize_4bit``, AutoGPTQ's ``QuantLinear``, AutoAWQ's ``WQLinear_GEMM``):
the loader equals it box by box, and the test folders' writers (``published_int``) reproduce its
bytes. Whole folders of tiny Mixtral and Qwen3-MoE models are then compared, parameter by parameter
and on logits, with transformers' load of their tensors dequantized by hand (transformers 5 loads
none of these per-expert layouts itself).
"""

from __future__ import annotations

import functools
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_published_layouts import assert_same, assert_same_logits, by_hand_model, tiny_family_mixtral, transformed
from torch import nn

from lightning_ep.models.hf_io import load_pretrained_sharded
from lightning_ep.models.hf_stored import Opener

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import tiny_family
from published import read_folder
from published_int import (
    AWQ_REFERENCE,
    BNB4_REFERENCE,
    GPTQ_REFERENCE,
    awq_dequantize_by_hand,
    awq_dequantized,
    awq_pack,
    awq_reference,
    bnb4_dequantize_by_hand,
    bnb4_dequantized,
    bnb4_quantize,
    bnb4_reference,
    gptq_dequantize_by_hand,
    gptq_dequantized,
    gptq_pack,
    gptq_reference,
    write_awq,
    write_bnb4,
    write_gptq,
)

#: Boxes of a [96, 256] layer: whole, interior ragged, the last element, whole groups.
BOXES_96_256 = [(0, 96, 0, 256), (5, 77, 3, 201), (95, 96, 255, 256), (8, 16, 64, 128)]


def assert_reads(
    weight: Any, expected: torch.Tensor, boxes: list[tuple[int, int, int, int]], dtype: torch.dtype | None = None
) -> None:
    """Every ``(r0, r1, c0, c1)`` box of ``weight`` (an encoding), read in fp32 (and rounded to ``dtype``
    where the reference computed in it), equals that box of ``expected``."""
    opener = Opener()
    for r0, r1, c0, c1 in boxes:
        box = weight.read(opener, (slice(r0, r1), slice(c0, c1)), torch.float32)
        assert torch.equal(box if dtype is None else box.to(dtype), expected[r0:r1, c0:c1]), (r0, r1, c0, c1)
    opener.close()


def assert_loads_as_by_hand(
    build: Callable[..., nn.Module], folder: Path, hand: Path, tensors: dict[str, torch.Tensor]
) -> None:
    """A transformed model of ``build`` loaded from ``folder`` (no warning: nothing goes unused) equals,
    parameter by parameter and on logits, transformers' load of ``tensors`` (dequantized by hand)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_pretrained_sharded(transformed(build(seed=11)), folder).eval()
    reference = by_hand_model(build(seed=0), folder, hand, tensors)
    assert_same(model, reference)
    assert_same_logits(model, reference)


@pytest.mark.parametrize(("quant_type", "double"), [("nf4", True), ("nf4", False), ("fp4", True)])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_bitsandbytes_4bit_release(tmp_path: Path, model_type: str, quant_type: str, double: bool) -> None:
    """A ``load_in_4bit`` release (unsloth's and others' ``*-bnb-4bit`` of Mixtral and Qwen-MoE, saved
    when the experts were linear layers): every linear weight, routers included, equals the
    dequantization by hand (which equals bitsandbytes' own: ``test_bitsandbytes_format_equals_its_own_output``)
    bit for bit."""
    if model_type == "mixtral":
        build = functools.partial(tiny_family_mixtral, intermediate_size=64)
    else:
        build = functools.partial(tiny_family, model_type, moe_intermediate_size=64)
    folder = write_bnb4(build(seed=3), tmp_path / "bnb", quant_type=quant_type, double=double)
    stored = read_folder(folder)
    expert = next(k for k in stored if ".experts.5." in k and k.endswith(".weight"))
    assert stored[expert].dtype == torch.uint8 and f"{expert}.quant_state.bitsandbytes__{quant_type}" in stored
    assert_loads_as_by_hand(build, folder, tmp_path / "hand", bnb4_dequantized(folder))


BNB4_VARIANTS = {"nf4_double": ("nf4", 64, True), "nf4_double_32": ("nf4", 32, True), "nf4_single": ("nf4", 64, False)}
BNB4_VARIANTS["fp4_double"] = ("fp4", 64, True)


@pytest.mark.parametrize("variant", list(BNB4_VARIANTS))
def test_bitsandbytes_format_equals_its_own_output(tmp_path: Path, variant: str) -> None:
    """bitsandbytes' own bytes, state and dequantization of one weight (``tests/data``): the test
    folders' writer reproduces the bytes and state exactly, and every box of rows and columns the
    loader reads equals bitsandbytes' dequantization bit for bit, as does the dequantization by hand."""
    from lightning_ep.models.hf_formats import encode
    from lightning_ep.models.hf_stored import stored_tensors

    reference = bnb4_reference()
    quant_type, block, double = BNB4_VARIANTS[variant]
    mine = bnb4_quantize(reference["source"].float(), quant_type, block, double)
    for name, value in mine.items():
        assert torch.equal(value, reference[f"{variant}.{name}"]), name
    theirs = reference[f"{variant}.dequantized"]
    assert torch.equal(bnb4_dequantize_by_hand(reference, f"{variant}.weight"), theirs)
    shutil.copy(BNB4_REFERENCE, tmp_path / "model.safetensors")
    encoded, _ = encode(stored_tensors(tmp_path), {"quant_method": "bitsandbytes", "load_in_4bit": True})
    weight = encoded[f"{variant}.weight"]
    assert weight.shape == (72, 128)
    assert_reads(weight, theirs, [(0, 72, 0, 128), (1, 2, 0, 128), (3, 71, 5, 99), (71, 72, 127, 128), (2, 40, 0, 1)])


def test_bitsandbytes_blocks_run_over_the_flattened_weight(tmp_path: Path) -> None:
    """bitsandbytes cuts the flattened ``[R, C]`` weight into blocks (here of 64 over rows of 40: a
    block spans two rows, the last is partial, the absmax need two blocks of 256): any box of rows and
    columns equals the dequantization by hand."""
    from safetensors.torch import save_file

    from lightning_ep.models.hf_formats import encode
    from lightning_ep.models.hf_stored import stored_tensors

    torch.manual_seed(0)
    w = torch.randn(423, 40) * torch.logspace(-2, 1, 423)[:, None]  # 16920 values: 264.4 blocks of 64
    tensors = {"w" + k.removeprefix("weight"): v for k, v in bnb4_quantize(w).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    by_hand = bnb4_dequantize_by_hand(tensors, "w")
    weight = encode(stored_tensors(tmp_path), {})[0]["w"]
    assert_reads(
        weight, by_hand, [(0, 423, 0, 40), (1, 2, 0, 40), (3, 420, 5, 29), (422, 423, 39, 40), (409, 423, 0, 1)]
    )


GPTQ_VARIANTS = {"b4_g64_act": 4, "b4_g128": 4, "b8_g64": 8, "b4_whole": 4}


@pytest.mark.parametrize("variant", list(GPTQ_VARIANTS))
def test_gptq_format_equals_autogptq_own_output(tmp_path: Path, variant: str) -> None:
    """AutoGPTQ's own packing and fp16 dequantization of four layers (``tests/data``: act-order, groups
    in order, 8 bits, one group): AutoGPTQ gives back the weight it packed (already on the grid), every
    box the loader reads equals AutoGPTQ's values (the fp32 products, rounded to fp16 as AutoGPTQ
    computes them), as does the dequantization by hand, and the test folders' packer reproduces
    AutoGPTQ's bytes from the unpacked values."""
    from lightning_ep.models.hf_formats import encode
    from lightning_ep.models.hf_stored import stored_tensors
    from lightning_ep.moe.quantized import unpack_int32

    reference, bits = gptq_reference(), GPTQ_VARIANTS[variant]
    theirs = reference[f"{variant}.dequantized"]
    assert torch.equal(theirs.float(), reference[f"{variant}.source"])  # the packed weight, given back
    assert torch.equal(gptq_dequantize_by_hand(reference, variant, bits).half(), theirs)
    q = unpack_int32(reference[f"{variant}.qweight"], bits, 0).t()
    zeros = ((unpack_int32(reference[f"{variant}.qzeros"], bits, 1) + 1) & (2**bits - 1)).t()
    packed = gptq_pack(q, zeros, reference[f"{variant}.scales"].t(), reference[f"{variant}.g_idx"], bits)
    for name, value in packed.items():
        assert torch.equal(value, reference[f"{variant}.{name}"]), name
    shutil.copy(GPTQ_REFERENCE, tmp_path / "model.safetensors")
    quant = {"quant_method": "gptq", "bits": bits, "group_size": 64, "checkpoint_format": "gptq"}
    weight = encode(stored_tensors(tmp_path), quant)[0][f"{variant}.weight"]
    assert weight.shape == (96, 256)
    assert_reads(weight, theirs, BOXES_96_256, torch.float16)


@pytest.mark.parametrize(("bits", "act_order", "v2"), [(4, False, False), (4, True, False), (8, False, True)])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_gptq_release(tmp_path: Path, model_type: str, bits: int, act_order: bool, v2: bool) -> None:
    """A GPTQ release (Qwen's ``*-GPTQ-Int4`` of its MoE models, TheBloke's Mixtral): every quantized
    layer, experts per expert, equals the dequantization by hand bit for bit (fp32 products)."""
    build = tiny_family_mixtral if model_type == "mixtral" else functools.partial(tiny_family, model_type)
    folder = write_gptq(build(seed=3), tmp_path / "gptq", bits=bits, group=32, act_order=act_order, v2=v2)
    stored = read_folder(folder)
    assert stored[next(k for k in stored if ".experts.5." in k and k.endswith(".qweight"))].dtype == torch.int32
    assert_loads_as_by_hand(build, folder, tmp_path / "hand", gptq_dequantized(folder))


@pytest.mark.parametrize("variant", ["g128", "g64"])
def test_awq_format_equals_autoawq_own_output(tmp_path: Path, variant: str) -> None:
    """AutoAWQ's own packing and fp16 dequantization of two layers (``tests/data``): AutoAWQ gives back
    the weight it packed, every box the loader reads equals AutoAWQ's values (fp32 products, rounded to
    fp16 as AutoAWQ computes them), as does the dequantization by hand, and the test folders' packer
    reproduces AutoAWQ's bytes."""
    from lightning_ep.models.hf_formats import encode
    from lightning_ep.models.hf_stored import stored_tensors
    from lightning_ep.moe.quantized import unpack_awq

    reference, group = awq_reference(), int(variant[1:])
    theirs = reference[f"{variant}.dequantized"]
    assert torch.equal(theirs.float(), reference[f"{variant}.source"])  # the packed weight, given back
    assert torch.equal(awq_dequantize_by_hand(reference, variant, group).half(), theirs)
    q, zeros = unpack_awq(reference[f"{variant}.qweight"]).t(), unpack_awq(reference[f"{variant}.qzeros"]).t()
    for name, value in awq_pack(q, zeros, reference[f"{variant}.scales"].t()).items():
        assert torch.equal(value, reference[f"{variant}.{name}"]), name
    shutil.copy(AWQ_REFERENCE, tmp_path / "model.safetensors")
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    tensors = {k: v for k, v in stored_tensors(tmp_path).items() if k.startswith(variant + ".")}
    weight = encode(tensors, quant)[0][f"{variant}.weight"]
    assert weight.shape == (96, 256)
    assert_reads(weight, theirs, BOXES_96_256, torch.float16)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_awq_release(tmp_path: Path, model_type: str) -> None:
    """An AWQ release (TheBloke's and casperhansen's Mixtral): every quantized layer, experts per expert,
    equals the dequantization by hand bit for bit (fp32 products); the routers stay in fp16."""
    build = tiny_family_mixtral if model_type == "mixtral" else functools.partial(tiny_family, model_type)
    folder = write_awq(build(seed=3), tmp_path / "awq", group=32)
    assert_loads_as_by_hand(build, folder, tmp_path / "hand", awq_dequantized(folder))


def test_layers_whose_parts_do_not_fit_are_refused_by_name(tmp_path: Path) -> None:
    """A GPTQ, AWQ or bitsandbytes layer with a part missing or of another shape: one error naming the
    layer and what it holds, before any weight is read."""
    from safetensors.torch import save_file

    from lightning_ep.models.hf_formats import encode
    from lightning_ep.models.hf_stored import stored_tensors

    def refused(tensors: dict[str, torch.Tensor], quant: dict[str, object], match: str) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            encode(stored_tensors(tmp_path), quant)

    gptq = {f"x.{k}": v for k, v in gptq_pack(*_grid(), bits=4).items()}
    refused(
        {k: v for k, v in gptq.items() if not k.endswith("qzeros")},
        {"quant_method": "gptq", "bits": 4, "group_size": 32},
        r"the GPTQ layer 'x' has no \['x\.qzeros'\]: not the 4-bit GPTQ layout",
    )
    awq = {f"x.{k}": v for k, v in awq_pack(*_grid()[:3]).items()}
    refused(
        {**awq, "x.scales": awq["x.scales"][:, :8]},
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
        r"the AWQ layer 'x' has qweight I32 \[64, 2\], scales \[2, 8\]: not the 4-bit GEMM layout",
    )
    bnb = {"x" + k.removeprefix("weight"): v for k, v in bnb4_quantize(torch.randn(16, 64)).items()}
    refused(
        {k: v for k, v in bnb.items() if k != "x.absmax"},
        {},
        r"'x' is a bitsandbytes 4-bit weight \('x\.quant_state\.bitsandbytes__nf4'\) but \['x\.absmax'\] are missing",
    )


def _grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 16 x 64 layer on a 4-bit grid: values, zero points and fp16 scales per group of 32, its groups."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=generator)
    zeros = torch.randint(0, 16, (16, 2), generator=generator)
    scales = torch.rand(16, 2, generator=generator).half()
    return q, zeros, scales, torch.arange(64) // 32
