"""Frozen expert weights kept in FP8, MXFP4 or NF4 (``lightning_ep.moe.experts.frozen``), on one process.

- The formats: the stored values dequantize exactly to a hand computation (loops over blocks and
  nibbles, ``tests/distributed/published.py``); the MXFP4 quantizer follows the OCP MX rule (ties to
  the even E2M1 value, clamping at 6), the NF4 one takes the nearest of its 16 values; quantizing
  dequantized values gives the same bytes back. Casting the model keeps the stored dtypes.
- The LoRA step: a PEFT LoRA model (tiny Mixtral, adapters on attention and both expert weights; tiny
  GPT-OSS, adapters on attention) with its experts kept quantized gives the loss, every gradient and
  the AdamW step of the same model whose expert parameters hold the dequantized values, bit for bit in
  fp32 and in bf16: the GEMMs take equal operands. The dequantized weights are not kept from forward
  to backward, the frozen weights get no gradient and no optimizer state.
- Loading: an FP8 folder (DeepSeek-V3's layout, 128 x 128 blocks) and an MXFP4 folder (GPT-OSS's) are
  copied byte for byte; a bf16 folder is quantized expert by expert as ``quantize_fp8`` quantizes it.
- Export: ``export_hf`` of such a model writes the dequantized values.
- Refusals: trainable experts, an unknown format, transformers' own experts implementation.
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.models.hf_io import export_hf, load_pretrained_sharded
from lightning_ep.moe.experts import frozen as frozen_module
from lightning_ep.moe.experts.frozen import BUFFERS, FrozenExpertWeight, keep_frozen_experts
from lightning_ep.moe.quantized import (
    NF4_VALUES,
    dequantize_mxfp4,
    dequantize_nf4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nf4,
)
from lightning_ep.strategy.arguments import enable_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from conftest import tiny_mixtral
from families_workers import micro_batch, tiny_family
from lora_workers import lora_config, tiny_base, tiny_peft
from published import (
    fp8_dequantize_by_hand,
    mxfp4_dequantize_by_hand,
    read_folder,
    write_autofp8,
    write_compressed_fp8,
    write_fp8,
    write_mxfp4,
)
from published_int import (
    bnb4_dequantize_by_hand,
    gptq_dequantized,
    write_bnb4,
    write_gptq,
)

CONFIG = MoEConfig(moe_load_balancing="none")


def frozen_weights(model: nn.Module) -> dict[str, FrozenExpertWeight]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FrozenExpertWeight)}


# --------------------------------------------------------------------------------------------
# The formats
# --------------------------------------------------------------------------------------------


def test_fp8_weight_dequantizes_to_a_hand_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 200, 136) * torch.logspace(-3, 0, 136)  # partial last blocks on both dims
    frozen = FrozenExpertWeight("fp8", nn.Parameter(w, requires_grad=False))
    stored = frozen.stored()
    assert stored["data"].dtype == torch.uint8 and tuple(stored["scale_inv"].shape) == (3, 2, 2)
    data = stored["data"].view(torch.float8_e4m3fn)
    for e in range(3):
        by_hand = fp8_dequantize_by_hand(data[e], stored["scale_inv"][e], (128, 128))
        assert torch.equal(frozen.dequantize(torch.float32, slice(e, e + 1))[0], by_hand)
        # Each block's largest magnitude maps to 448, the largest e4m3 value.
        assert float(data[e, :128, :128].float().abs().max()) == 448.0
    assert torch.equal(frozen.dequantize(torch.bfloat16), frozen.dequantize(torch.float32).to(torch.bfloat16))
    # Quantizing the dequantized values gives the same FP8 values back.
    whole = frozen.dequantize(torch.float32)
    again, _ = quantize_fp8(whole)
    assert torch.equal(again.view(torch.uint8), stored["data"])
    monkeypatch.setattr(frozen_module, "DEQUANTIZE_ELEMENTS", 1)  # one expert at a time: the same values
    assert torch.equal(frozen.dequantize(torch.float32), whole)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nf4"])
def test_casting_the_module_keeps_the_stored_dtypes(fmt: str) -> None:
    # ``bf16-true`` casts the whole model: the fp32 FP8 scales must not be rounded to bf16.
    torch.manual_seed(0)
    frozen = FrozenExpertWeight(fmt, torch.randn(2, 128, 64))  # type: ignore[arg-type]
    before = {name: t.clone() for name, t in frozen.stored().items()}
    frozen.to(torch.bfloat16).half().double()
    for name, t in frozen.stored().items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name


def test_mxfp4_quantizer_follows_the_ocp_rule() -> None:
    # amax 4 -> shared exponent floor(log2 4) - 2 = 0: the values themselves, rounded to E2M1.
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 4.0, 0.0, 0.1, -6.0, 2.9, 0.5, 1.5]
    blocks, scales = quantize_mxfp4(torch.tensor(values * 2).reshape(1, 32))
    assert scales.tolist() == [[127 + 0]]
    got = dequantize_mxfp4(blocks, scales, torch.float32)[0, :16].tolist()
    # Ties go to the even code (mantissa 0): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, 4.0, 0.0, 0.0, -6.0, 3.0, 0.5, 1.5]
    # A group scaled up: amax 7.9 -> exponent 0 still, 7.9 clamps to 6; a zero group has scale byte 0.
    blocks, scales = quantize_mxfp4(torch.tensor([[7.9] + [0.0] * 31, [0.0] * 32]))
    assert scales.tolist() == [[127], [0]] and dequantize_mxfp4(blocks, scales, torch.float32)[0, 0] == 6.0
    # Quantizing dequantized values gives the same bytes back.
    first = quantize_mxfp4(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    again = quantize_mxfp4(dequantize_mxfp4(*first, torch.float32))
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def nf4_dequantize_by_hand(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``[..., out, in]`` in fp32, one byte at a time: low nibble, then high nibble, each NF4 value times
    its group's absmax."""
    flat_codes, flat_absmax = codes.reshape(-1, 32), absmax.reshape(-1)
    out = torch.empty(flat_codes.shape[0], 64)
    for g in range(flat_codes.shape[0]):
        for i in range(32):
            byte = int(flat_codes[g, i])
            out[g, 2 * i] = NF4_VALUES[byte & 15] * float(flat_absmax[g])
            out[g, 2 * i + 1] = NF4_VALUES[byte >> 4] * float(flat_absmax[g])
    return out.reshape(*codes.shape[:-2], codes.shape[-2] * 64)


# The relative error bounds: measured 0.11 (MXFP4) and 0.09 (NF4) on normal values.
@pytest.mark.parametrize(("fmt", "group", "bound"), [("mxfp4", 32, 0.2), ("nf4", 64, 0.15)])
@pytest.mark.parametrize("transposed", [False, True])
def test_4bit_weight_dequantizes_to_a_hand_computation(
    fmt: str, group: int, bound: float, transposed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    w = torch.randn(2, 64, 128) * torch.logspace(-3, 1, 128)
    frozen = FrozenExpertWeight(fmt, nn.Parameter(w, requires_grad=False), transposed=transposed)  # type: ignore[arg-type]
    stored = frozen.stored()
    values, scales = BUFFERS[fmt]
    out, inner = (128, 64) if transposed else (64, 128)
    assert tuple(stored[values].shape) == (2, out, inner // group, group // 2) and stored[values].dtype == torch.uint8
    assert tuple(stored[scales].shape) == (2, out, inner // group)
    by_hand = (mxfp4_dequantize_by_hand if fmt == "mxfp4" else nf4_dequantize_by_hand)(stored[values], stored[scales])
    expected = by_hand.transpose(1, 2) if transposed else by_hand  # by hand: [E, out, in]
    assert torch.equal(frozen.dequantize(torch.float32), expected)
    monkeypatch.setattr(frozen_module, "DEQUANTIZE_ELEMENTS", 1)  # one expert at a time: the same values
    assert torch.equal(frozen.dequantize(torch.float32), expected)
    assert (frozen.dequantize(torch.float32) - w).norm() / w.norm() < bound


def test_nf4_quantizer_takes_the_nearest_value() -> None:
    # Each group is divided by its absmax: the extremes land on -1 and 1 exactly, zero on the exact 0.
    group = torch.tensor(NF4_VALUES * 4) * 3.0  # every NF4 value, absmax 3
    codes, absmax = quantize_nf4(group.reshape(1, 64))
    assert absmax.tolist() == [[3.0]]
    assert torch.equal(dequantize_nf4(codes, absmax, torch.float32)[0], group)
    # Between two values: the nearer one; on the midpoint, the lower index.
    mid = (NF4_VALUES[8] + NF4_VALUES[9]) / 2
    row = torch.tensor([1.0, mid, mid + 1e-3, mid - 1e-3] + [0.0] * 60).reshape(1, 64)
    got = dequantize_nf4(*quantize_nf4(row), torch.float32)[0, :4].tolist()
    assert got == [1.0, NF4_VALUES[8], NF4_VALUES[9], NF4_VALUES[8]]
    # A group of zeros keeps absmax 0 and dequantizes to zeros.
    codes, absmax = quantize_nf4(torch.zeros(1, 64))
    assert absmax.tolist() == [[0.0]] and not dequantize_nf4(codes, absmax, torch.float32).any()
    # Quantizing dequantized values gives the same bytes back.
    first = quantize_nf4(torch.randn(4, 128, generator=torch.Generator().manual_seed(0)))
    again = quantize_nf4(dequantize_nf4(*first, torch.float32))
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_nf4(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="frozen_experts='nf4' groups 64 input features a scale"):
        FrozenExpertWeight("nf4", torch.zeros(2, 64, 32))


# --------------------------------------------------------------------------------------------
# The LoRA step
# --------------------------------------------------------------------------------------------


def _models(model_type: str, fmt: str, dtype: torch.dtype, **config: int) -> tuple[nn.Module, nn.Module]:
    """``(quantized, reference)``: a transformed PEFT LoRA model (its config's fields overridden by
    ``config``) with its experts kept in ``fmt``, and a copy whose frozen expert parameters hold the
    dequantized values."""
    if model_type == "mixtral" and not config:
        model = tiny_peft("mixtral")
    else:
        from peft import get_peft_model
        from workers import tiny_mixtral

        base = (tiny_mixtral(0, **config) if model_type == "mixtral" else tiny_family(model_type, **config)).train()
        torch.manual_seed(1)
        model = get_peft_model(base, lora_config(**({} if model_type == "mixtral" else {"target_parameters": []})))
    model = model.to(dtype)
    lightning_ep.transform(model, CONFIG)
    reference = copy.deepcopy(model)
    names = keep_frozen_experts(model, fmt)  # type: ignore[arg-type]
    assert len(names) == 4  # two layers, two weights
    for name, frozen in frozen_weights(model).items():
        reference.get_parameter(name).data.copy_(frozen.dequantize(dtype))
    return model, reference


# NF4 groups 64 input features: the tiny models' experts 64 wide instead of 32.
@pytest.mark.parametrize(
    ("model_type", "fmt", "dtype", "config"),
    [
        ("mixtral", "fp8", torch.float32, {}),
        ("mixtral", "mxfp4", torch.float32, {}),
        ("mixtral", "fp8", torch.bfloat16, {}),
        ("gpt_oss", "mxfp4", torch.float32, {}),
        ("mixtral", "nf4", torch.float32, {"intermediate_size": 64}),
        ("mixtral", "nf4", torch.bfloat16, {"intermediate_size": 64}),
        ("gpt_oss", "nf4", torch.float32, {"intermediate_size": 64}),
    ],
)
def test_lora_step_equals_the_step_on_dequantized_weights(
    model_type: str, fmt: str, dtype: torch.dtype, config: dict[str, int]
) -> None:
    model, reference = _models(model_type, fmt, dtype, **config)
    made: list[weakref.ref[torch.Tensor]] = []
    dequantize = FrozenExpertWeight.dequantize

    def tracked(self: FrozenExpertWeight, *args: object) -> torch.Tensor:
        out = dequantize(self, *args)  # type: ignore[arg-type]
        made.append(weakref.ref(out))
        return out

    ids = micro_batch(0, 0)
    FrozenExpertWeight.dequantize = tracked  # type: ignore[method-assign]
    try:
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        assert made and all(r() is None for r in made)  # nothing kept from forward to backward
        loss.backward()
    finally:
        FrozenExpertWeight.dequantize = dequantize  # type: ignore[method-assign]
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    expected = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    assert trainable.keys() == expected.keys() and any("_lora_" in n for n in trainable) == (model_type == "mixtral")
    for name, p in trainable.items():
        assert torch.equal(p.grad, expected[name].grad), name
    # The frozen weights are buffers: no gradient, no optimizer state; one AdamW step stays equal.
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n, _ in model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
    assert {id(p) for p in optimizer.state} == {id(p) for p in trainable.values()}
    for name, p in trainable.items():
        assert torch.equal(p, expected[name]), name


def test_keep_frozen_experts_refuses_trainable_experts() -> None:
    model = lightning_ep.transform(tiny_base("mixtral"), CONFIG)
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj trains \(requires_grad=True\)\. Freeze"):
        keep_frozen_experts(model, "fp8")
    with pytest.raises(ValueError, match="holds no routed experts"):
        keep_frozen_experts(nn.Linear(4, 4), "fp8")


def test_strategy_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match=r"frozen_experts='int4'\): pass one of \['fp8', 'mxfp4', 'nf4'\]"):
        lightning_ep.ExpertParallelStrategy(frozen_experts="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smp_moe=False"):
        lightning_ep.ExpertParallelStrategy(frozen_experts="fp8", moe=MoEConfig(smp_moe=False))


def test_transformers_experts_implementation_is_refused_on_quantized_experts() -> None:
    model, _ = _models("mixtral", "fp8", torch.float32)
    model.get_base_model().set_experts_implementation("eager")
    ids = micro_batch(0, 0)
    with pytest.raises(ValueError, match="would compute the experts without their LoRA adapters"):
        model(input_ids=ids)
    plain = lightning_ep.transform(tiny_base("mixtral").requires_grad_(False), CONFIG)
    keep_frozen_experts(plain, "fp8")
    plain.set_experts_implementation("eager")
    with pytest.raises(ValueError, match=r"cannot read expert weights kept quantized \(frozen_experts\)"):
        plain(input_ids=ids)


# --------------------------------------------------------------------------------------------
# Loading published folders, and export
# --------------------------------------------------------------------------------------------


def _meta_frozen(model_type: str, fmt: str, block: tuple[int, int] = (128, 128), **overrides: object) -> nn.Module:
    """A transformed model on the meta device with frozen experts in ``fmt``, allocated on the CPU."""
    with torch.device("meta"):
        model = tiny_mixtral(11, **overrides) if model_type == "mixtral" else tiny_family(model_type, 11, **overrides)
    model.requires_grad_(False)
    lightning_ep.transform(model, CONFIG)
    keep_frozen_experts(model, fmt, block=block)  # type: ignore[arg-type]
    return model.to_empty(device="cpu")


def _load(model: nn.Module, folder: Path) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_pretrained_sharded(model, folder)


@pytest.mark.parametrize(("block", "width"), [((128, 128), 128), ((16, 16), 32)])
def test_fp8_folder_is_copied_byte_for_byte(tmp_path: Path, block: tuple[int, int], width: int) -> None:
    # Blocks of 128 (DeepSeek-V3's) over experts of width 128, and the folder's own blocks of 16 kept as
    # published (the strategy passes weight_block_size): the gate and up parts fill whole blocks.
    source = tiny_family("deepseek_v3", moe_intermediate_size=width)
    folder = write_fp8(source, tmp_path / "fp8", block=block)
    stored = read_folder(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no requantization warning: the bytes are kept
        model = _load(_meta_frozen("deepseek_v3", "fp8", block, moe_intermediate_size=width), folder)
    weights = frozen_weights(model)
    assert weights
    for name, frozen in weights.items():
        layer = name.split(".")[2]
        for e in range(frozen.shape[0]):
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            parts = ["gate_proj", "up_proj"] if name.endswith("gate_up_proj") else ["down_proj"]
            data = torch.cat([stored[f"{prefix}{p}.weight"] for p in parts]).view(torch.uint8)
            scale = torch.cat([stored[f"{prefix}{p}.weight_scale_inv"] for p in parts])
            assert torch.equal(frozen.stored()["data"][e], data), (name, e)
            assert torch.equal(frozen.stored()["scale_inv"][e], scale), (name, e)
    # The export dequantizes with the weight's own block (its extra state in the state dict).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = read_folder(export_hf(model, tmp_path / "export", hf_config_or_folder=folder))
    for name, frozen in weights.items():
        prefix, _, weight = name.rpartition(".")
        parts = ["gate_proj", "up_proj"] if weight == "gate_up_proj" else ["down_proj"]
        values = frozen.dequantize(torch.float32)
        for e in range(frozen.shape[0]):
            expected = torch.cat([exported[f"{prefix}.{e}.{p}.weight"].float() for p in parts])
            assert torch.equal(values[e].to(torch.bfloat16).float(), expected), (name, e)


MIXTRAL_PARTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}


def mixtral_parts(stored: dict[str, torch.Tensor], name: str, expert: int, suffix: str = "") -> list[torch.Tensor]:
    """The per-expert tensors of a Mixtral folder that make expert ``expert`` of the fused weight ``name``."""
    layer, weight = name.split(".")[2], name.rpartition(".")[2]
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return [stored[f"{prefix}.{w}.weight{suffix}"] for w in MIXTRAL_PARTS[weight]]


@pytest.mark.parametrize(
    ("layout", "block"), [("autofp8", (16, 16)), ("autofp8", (32, 32)), ("tensor", (16, 16)), ("group", (1, 16))]
)
def test_fp8_folder_with_coarser_scales_is_copied_byte_for_byte(
    tmp_path: Path, layout: str, block: tuple[int, int]
) -> None:
    """One scale per expert matrix (AutoFP8's scalar, compressed-tensors' [1]) holds over any grid of
    blocks that tiles the matrix, and compressed-tensors' groups of 16 are blocks of 1 x 16 (the block
    the strategy picks for such a folder): each block takes the scale covering it, no value changes."""
    source = tiny_base("mixtral")
    folder = (
        write_autofp8(source, tmp_path / "fp8")
        if layout == "autofp8"
        else write_compressed_fp8(source, tmp_path / "fp8", layout, group=16)
    )
    stored = read_folder(folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*quantized otherwise")  # no requantization
        warnings.filterwarnings("ignore", message=".*activation scales")
        model = load_pretrained_sharded(_meta_frozen("mixtral", "fp8", block), folder)
    weights = frozen_weights(model)
    assert len(weights) == 4
    for name, frozen in weights.items():
        expected = []
        for e in range(frozen.shape[0]):
            values, scales = mixtral_parts(stored, name, e), mixtral_parts(stored, name, e, "_scale")
            data = torch.cat(values).view(torch.uint8)
            assert torch.equal(frozen.stored()["data"][e], data), (name, e)
            grids = [  # each block's scale, by hand: the matrix's one scale, or its group's
                s.float().reshape(1, 1).expand(-(-v.shape[0] // block[0]), -(-v.shape[1] // block[1]))
                if s.numel() == 1
                else s.float()
                for v, s in zip(values, scales, strict=True)
            ]
            assert torch.equal(frozen.stored()["scale_inv"][e], torch.cat(grids)), (name, e)
            expected.append(torch.cat([fp8_dequantize_by_hand(v, g, block) for v, g in zip(values, grids)]))
        assert torch.equal(frozen.dequantize(torch.float32), torch.stack(expected)), name


def test_a_per_row_fp8_folder_is_copied_into_rows_and_requantized_into_blocks(tmp_path: Path) -> None:
    """compressed-tensors' per-row scales (FP8-dynamic releases) carry into blocks of one row as wide
    as the widest expert input (the strategy's choice for such a folder): copied byte for byte. Into
    blocks of 16 rows they do not: the values are read exactly, quantized into blocks of 16 and the one
    warning says so."""
    folder = write_compressed_fp8(tiny_base("mixtral"), tmp_path / "ct", "channel")
    stored = read_folder(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = load_pretrained_sharded(_meta_frozen("mixtral", "fp8", (1, 64)), folder)
    for name, frozen in frozen_weights(rows).items():
        for e in range(frozen.shape[0]):
            data = torch.cat(mixtral_parts(stored, name, e)).view(torch.uint8)
            scales = torch.cat(mixtral_parts(stored, name, e, "_scale")).float()
            assert torch.equal(frozen.stored()["data"][e], data), (name, e)
            assert torch.equal(frozen.stored()["scale_inv"][e], scales), (name, e)
    model = _meta_frozen("mixtral", "fp8", (16, 16))
    with pytest.warns(
        UserWarning, match=r"quantized otherwise than the model keeps them \(fp8, blocks of \[16, 16\]\)"
    ):
        load_pretrained_sharded(model, folder)
    for name, frozen in frozen_weights(model).items():
        exact = torch.stack(
            [
                torch.cat(
                    [
                        v.float() * s.float()
                        for v, s in zip(mixtral_parts(stored, name, e), mixtral_parts(stored, name, e, "_scale"))
                    ]
                )
                for e in range(frozen.shape[0])
            ]
        )
        expected = FrozenExpertWeight("fp8", exact, block=(16, 16)).dequantize(torch.float32)
        assert torch.equal(frozen.dequantize(torch.float32), expected), name


def test_bitsandbytes_nf4_folder_is_copied_byte_for_byte(tmp_path: Path) -> None:
    """bitsandbytes' NF4 (blocks of 64 along the input features, double-quantized absmax) is this
    library's NF4 with the nibbles of a byte the other way round and the absmax expanded to fp32: the
    codes are copied, the absmax computed as bitsandbytes computes them, and the experts equal the
    dequantization by hand (bitsandbytes' own, ``test_published_layouts``) bit for bit, with no
    warning. FP4 is quantized again."""
    folder = write_bnb4(tiny_mixtral(3, intermediate_size=64), tmp_path / "bnb")
    stored = read_folder(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_pretrained_sharded(_meta_frozen("mixtral", "nf4", intermediate_size=64), folder)
    weights = frozen_weights(model)
    assert len(weights) == 4
    for name, frozen in weights.items():
        codes, values = [], []
        for e in range(frozen.shape[0]):
            layer, weight = name.split(".")[2], name.rpartition(".")[2]
            for part in MIXTRAL_PARTS[weight]:
                key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{part}.weight"
                rows, cols = bnb4_dequantize_by_hand(stored, key).shape
                byte = stored[key].reshape(rows, cols // 64, 32)
                codes.append((byte & 15) << 4 | byte >> 4)  # our order: the first value in the low nibble
                values.append(bnb4_dequantize_by_hand(stored, key))
        experts = frozen.shape[0]
        assert torch.equal(frozen.stored()["codes"], torch.cat(codes).reshape(experts, -1, *codes[0].shape[1:])), name
        expected = torch.cat(values).reshape(experts, -1, values[0].shape[1])
        assert torch.equal(frozen.dequantize(torch.float32), expected), name
        groups = expected.unflatten(-1, (-1, 64)).abs().amax(dim=-1)  # an NF4 group's largest |value| is its absmax
        assert torch.equal(frozen.stored()["absmax"], groups), name
    fp4 = write_bnb4(tiny_mixtral(3, intermediate_size=64), tmp_path / "fp4", quant_type="fp4")
    with pytest.warns(UserWarning, match=r"quantized otherwise than the model keeps them \(nf4\)"):
        load_pretrained_sharded(_meta_frozen("mixtral", "nf4", intermediate_size=64), fp4)


@pytest.mark.parametrize("fmt", ["fp8", "nf4"])
def test_a_gptq_folder_is_requantized_with_one_warning(tmp_path: Path, fmt: str) -> None:
    """No frozen format holds GPTQ's integers and zero points: each expert is dequantized exactly (fp32)
    and quantized into the format on the rank that holds it, and the one warning says so."""
    folder = write_gptq(tiny_mixtral(3, intermediate_size=64), tmp_path / "gptq", bits=4, group=32, act_order=True)
    exact = gptq_dequantized(folder)
    model = _meta_frozen("mixtral", fmt, (16, 16), intermediate_size=64)
    with pytest.warns(UserWarning, match=rf"quantized otherwise than the model keeps them \({fmt}"):
        load_pretrained_sharded(model, folder)
    for name, frozen in frozen_weights(model).items():
        values = torch.stack([torch.cat(mixtral_parts(exact, name, e)) for e in range(frozen.shape[0])])
        expected = FrozenExpertWeight(fmt, values, block=(16, 16)).dequantize(torch.float32)  # type: ignore[arg-type]
        assert torch.equal(frozen.dequantize(torch.float32), expected), name


def test_mxfp4_folder_is_copied_byte_for_byte_and_exports_dequantized(tmp_path: Path) -> None:
    source = tiny_family("gpt_oss")
    folder = write_mxfp4(source, tmp_path / "mxfp4")
    stored = read_folder(folder)
    model = _load(_meta_frozen("gpt_oss", "mxfp4"), folder)
    for name, frozen in frozen_weights(model).items():
        assert torch.equal(frozen.stored()["blocks"], stored[f"{name}_blocks"]), name
        assert torch.equal(frozen.stored()["scales"], stored[f"{name}_scales"]), name
    out = export_hf(model, tmp_path / "export", hf_config_or_folder=folder)
    exported = read_folder(out)
    for name, frozen in frozen_weights(model).items():
        assert torch.equal(exported[name], frozen.dequantize(torch.bfloat16)), name


def test_a_folder_in_another_format_is_requantized_with_one_warning(tmp_path: Path) -> None:
    folder = write_mxfp4(tiny_family("gpt_oss"), tmp_path / "mxfp4")
    model = _meta_frozen("gpt_oss", "fp8")
    with pytest.warns(
        UserWarning, match=r"stores 4 expert weights .* quantized otherwise than the model keeps them \(fp8"
    ):
        load_pretrained_sharded(model, folder)
    for name, frozen in frozen_weights(model).items():  # the MXFP4 values, rounded to FP8
        expected = FrozenExpertWeight("fp8", mxfp4_by_hand(folder, name)).dequantize(torch.float32)
        assert torch.equal(frozen.dequantize(torch.float32), expected), name


def test_published_and_bf16_folders_are_quantized_into_nf4(tmp_path: Path) -> None:
    # No release ships NF4: GPT-OSS's MXFP4 bytes are dequantized and quantized again (one warning), a
    # bf16 folder's experts are quantized as quantize_nf4 quantizes them, along ``in`` ([E, in, out]).
    source = tiny_family("gpt_oss", 11, intermediate_size=64)
    folder = write_mxfp4(source, tmp_path / "mxfp4")
    model = _meta_frozen("gpt_oss", "nf4", intermediate_size=64)
    with pytest.warns(UserWarning, match=r"quantized otherwise than the model keeps them \(nf4\)"):
        load_pretrained_sharded(model, folder)
    for name, frozen in frozen_weights(model).items():
        expected = FrozenExpertWeight("nf4", mxfp4_by_hand(folder, name), transposed=True)
        assert torch.equal(frozen.dequantize(torch.float32), expected.dequantize(torch.float32)), name
    source.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = _load(_meta_frozen("gpt_oss", "nf4", intermediate_size=64), tmp_path / "bf16")
    for name, frozen in frozen_weights(model).items():
        codes, absmax = quantize_nf4(source.get_parameter(name).detach().to(torch.bfloat16).transpose(1, 2))
        assert torch.equal(frozen.stored()["codes"], codes) and torch.equal(frozen.stored()["absmax"], absmax), name
    out = export_hf(model, tmp_path / "export", hf_config_or_folder=tmp_path / "bf16")
    exported = _load(lightning_ep.transform(tiny_family("gpt_oss", 3, intermediate_size=64), CONFIG), out)
    for name, frozen in frozen_weights(model).items():
        assert torch.equal(exported.get_parameter(name), frozen.dequantize(torch.float32)), name


def mxfp4_by_hand(folder: Path, name: str) -> torch.Tensor:
    """The folder's MXFP4 weight ``name`` dequantized by hand, in the model's ``[E, in, out]`` layout."""
    stored = read_folder(folder)
    return mxfp4_dequantize_by_hand(stored[f"{name}_blocks"], stored[f"{name}_scales"]).transpose(1, 2)


def test_bf16_folder_is_quantized_expert_by_expert(tmp_path: Path) -> None:
    source = tiny_base("mixtral").to(torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    model = _load(_meta_frozen("mixtral", "fp8"), tmp_path / "bf16")
    for name, frozen in frozen_weights(model).items():
        data, scale = quantize_fp8(source.get_parameter(name).detach())
        assert torch.equal(frozen.stored()["data"], data.view(torch.uint8)), name
        assert torch.equal(frozen.stored()["scale_inv"], scale), name
    out = export_hf(model, tmp_path / "export", hf_config_or_folder=tmp_path / "bf16")
    exported = lightning_ep.transform(tiny_base("mixtral", seed=3), CONFIG)
    _load(exported, out)
    for name, frozen in frozen_weights(model).items():
        assert torch.equal(exported.get_parameter(name), frozen.dequantize(torch.float32)), name


def test_meta_model_is_initialised_expert_by_expert() -> None:
    """A model built on the meta device (no folder) gets ``normal(0, initializer_range)`` expert weights,
    quantized, as Hugging Face initialises the weights they replace; the same seed gives the same bytes."""
    from lightning_ep.models.init import materialize

    def build() -> nn.Module:
        with torch.device("meta"):
            model = tiny_base("mixtral")
        model.requires_grad_(False)
        lightning_ep.transform(model, CONFIG)
        keep_frozen_experts(model, "fp8")
        torch.manual_seed(5)
        return materialize(model, "cpu")

    first, second = build(), build()
    std = first.config.initializer_range
    for name, frozen in frozen_weights(first).items():
        values = frozen.dequantize(torch.float32)
        assert abs(float(values.std()) / std - 1) < 0.05, name
        assert torch.equal(frozen.stored()["data"], frozen_weights(second)[name].stored()["data"]), name


def test_cuda_graphs_are_refused_on_quantized_experts() -> None:
    from lightning_ep.moe.dispatch.base import LocalDispatcher
    from lightning_ep.moe.graphs import LayerGraphs

    model = lightning_ep.transform(tiny_base("mixtral").requires_grad_(False), CONFIG)
    keep_frozen_experts(model, "mxfp4")
    experts = lightning_ep.moe_layers(model)[0].experts
    with pytest.raises(ValueError, match=r"keeps its frozen experts quantized \(frozen_experts\)"):
        LayerGraphs(LocalDispatcher(8), experts)


def test_the_strategy_keeps_an_fp8_folder_s_own_blocks(tmp_path: Path) -> None:
    from lightning_ep.models.pretrained import from_pretrained, published_fp8_block

    write_fp8(tiny_family("deepseek_v3"), tmp_path / "fp8", block=(16, 16))
    tiny_base("mixtral").save_pretrained(tmp_path / "plain")
    assert published_fp8_block(from_pretrained(tmp_path / "fp8")) == (16, 16)
    # compressed-tensors' blocks and groups (a group is a block of one row), its rows (a block of one row
    # as wide as the widest expert input, 64: hidden 64, intermediate 32); one scale per tensor fits 128.
    for strategy, block in [("block", (32, 32)), ("group", (1, 16)), ("channel", (1, 64)), ("tensor", (128, 128))]:
        write_compressed_fp8(tiny_base("mixtral"), tmp_path / strategy, strategy, group=16, block=(32, 32))
        assert published_fp8_block(from_pretrained(tmp_path / strategy)) == block, strategy
    write_autofp8(tiny_base("mixtral"), tmp_path / "autofp8")
    assert published_fp8_block(from_pretrained(tmp_path / "autofp8")) == (128, 128)
    assert published_fp8_block(from_pretrained(tmp_path / "plain")) == (128, 128)
    assert published_fp8_block(tiny_base("mixtral")) == (128, 128)


def test_saved_activations_reach_the_hooks_in_force_and_weights_do_not() -> None:
    """Activation checkpointing keeps nothing of a layer until its recomputation by its own saved-tensor
    hooks; the experts' hooks hand every other saved tensor on to them, so a checkpointed layer keeps no
    expert activations either, and the LoRA step under checkpointing still equals the reference's."""
    model, reference = _models("mixtral", "fp8", torch.float32)
    weight_shapes = {tuple(m.shape) for m in frozen_weights(model).values()}
    weight_shapes |= {(e, c, r) for e, r, c in weight_shapes}  # the transposed views the GEMMs save
    seen: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return t

    ids = micro_batch(0, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # The expert adapters' A [E, r, H], which only the experts' GEMMs save, reach the hooks; no weight does.
    assert (8, 8, 64) in seen and not weight_shapes & set(seen)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    for m in (model, reference):
        enable_checkpointing(m.get_base_model(), True)
    checkpointed = model(input_ids=ids, labels=ids).loss
    checkpointed.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(checkpointed, loss)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, grads[name]) and torch.equal(p.grad, expected[name].grad), name
