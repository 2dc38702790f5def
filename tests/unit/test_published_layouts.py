"""Published Hugging Face layouts through ``load_pretrained_sharded`` and ``export_hf``, on one process.

Every folder is built from a tiny random model of the family and laid out the way its publisher
ships it (``tests/distributed/published.py``): per-expert keys in several shard files with an
index, DeepSeek-V3's block-scaled FP8 (fp32 and E8M0 scales, partial last blocks), llm-compressor's
and AutoFP8's FP8 with a ``weight_scale`` (per tensor, row, group and block), GPT-OSS's MXFP4
experts, and the multi-token-prediction layer of DeepSeek-V3 and GLM-4.5 (expert weights included).

The reference is transformers' own ``from_pretrained`` of the same folder, dequantized, in fp32:
every parameter is equal bit for bit (both dequantize with the same fp32 products) and so are the
logits. Where a block does not divide a weight (DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` has
5 scale rows of 128), transformers derives the block from the grid instead of the config and so
refuses or misreads the folder; there, and for the FP8 layouts transformers does not dequantize
(AutoFP8's, compressed-tensors' group and block scales), the reference is a dequantization by loops
over the blocks. compressed-tensors' own decompression (through transformers) computes the dense
weights' products in bf16, so it is compared in bf16: the correctly rounded fp32 products.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.models.hf_io import export_hf, load_pretrained_sharded
from lightning_ep.moe.experts.frozen import keep_frozen_experts
from lightning_ep.moe.quantized import dequantize_fp8_block, dequantize_mxfp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import FAMILY_NAMES, micro_batch, rel_err, tiny_family
from published import (
    add_mtp_layer,
    dequantized_by_hand,
    edit_config,
    fp8_dequantize_by_hand,
    fp8_quantize,
    mxfp4_dequantize_by_hand,
    mxfp4_quantize,
    read_folder,
    write_autofp8,
    write_compressed_fp8,
    write_fp8,
    write_mxfp4,
    write_shards,
)

CONFIG = MoEConfig(moe_load_balancing="none")


def transformers_load(folder: Path) -> nn.Module:
    """transformers' own load of ``folder`` in fp32, dequantizing what is quantized."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    quant = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    kwargs = {}
    if quant.get("quant_method") == "fp8":
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    elif quant.get("quant_method") == "mxfp4":
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    # transformers 5.17 leaves a quantized release's unquantized weights in their stored bf16 despite
    # dtype=float32; their values are exact in fp32, so the reference computes in fp32 either way.
    return model.float().eval()


def ours(model_type: str, folder: Path) -> nn.Module:
    """A transformed model of another seed, filled from ``folder`` by ``load_pretrained_sharded``."""
    model = lightning_ep.transform(tiny_family(model_type, seed=11), CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_pretrained_sharded(model, folder).eval()


def assert_same(model: nn.Module, reference: dict[str, torch.Tensor] | nn.Module) -> None:
    state = reference.state_dict() if isinstance(reference, nn.Module) else reference
    for key, value in model.state_dict().items():
        if key.endswith("expert_bias"):
            continue
        assert key in state, key
        assert torch.equal(value, state[key].to(value.dtype)), key


def assert_same_logits(model: nn.Module, reference: nn.Module) -> None:
    ids = micro_batch(0, 0)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, reference(input_ids=ids).logits) <= 1e-5


# --------------------------------------------------------------------------------------------
# The formats against hand computations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_blocks_of_any_offset_equal_a_hand_dequantization(e8m0: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 56)  # blocks of 16 x 16: a grid of 3 x 4 with partial last blocks
    q, scale = fp8_quantize(w, (16, 16), e8m0)
    assert tuple(scale.shape) == (3, 4)
    whole = fp8_dequantize_by_hand(q, scale, (16, 16))
    for r0, r1, c0, c1 in [(0, 40, 0, 56), (5, 37, 9, 50), (16, 32, 48, 56), (39, 40, 0, 1), (17, 18, 31, 33)]:
        grid = scale[r0 // 16 : -(-r1 // 16), c0 // 16 : -(-c1 // 16)]
        block = dequantize_fp8_block(q[r0:r1, c0:c1], grid, (16, 16), (r0, c0), torch.float32)
        assert torch.equal(block, whole[r0:r1, c0:c1]), (r0, r1, c0, c1)
    # Uint8 E8M0 bytes mean 2^(s - 127), as the float8_e8m0fnu values do.
    if e8m0:
        as_bytes = scale.view(torch.uint8)
        assert torch.equal(dequantize_fp8_block(q, as_bytes, (16, 16), (0, 0), torch.float32), whole)


def test_mxfp4_equals_a_hand_dequantization() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 40, 64) * torch.logspace(-3, 1, 64)  # groups of very different scales
    blocks, scales = mxfp4_quantize(w)
    assert blocks.shape == (3, 40, 2, 16) and blocks.dtype == torch.uint8 and scales.shape == (3, 40, 2)
    by_hand = mxfp4_dequantize_by_hand(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), by_hand)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), by_hand.to(torch.bfloat16))
    # The quantizer is faithful enough that the test data means something: within a step of E2M1.
    assert rel_err(by_hand, w) < 0.2


# --------------------------------------------------------------------------------------------
# Every family's published layout against transformers' own load
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_per_expert_keys_in_several_shards(model_type: str, tmp_path: Path) -> None:
    folder = tmp_path / model_type
    tiny_family(model_type, seed=3).save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    if model_type != "gpt_oss":  # GPT-OSS stores its experts fused; the others per expert
        assert any(".experts.0." in key for key in read_folder(folder))
    model, reference = ours(model_type, folder), transformers_load(folder)
    assert_same(model, reference)
    assert_same_logits(model, reference)


@pytest.mark.parametrize("shards", [1, 3])
def test_deepseek_fp8_release_with_its_mtp_layer(tmp_path: Path, shards: int) -> None:
    """DeepSeek-V3's FP8 layout, blocks dividing every weight, plus a multi-token-prediction layer
    whose experts are stored per expert and quantized too: ignored, and named in one warning."""
    folder = write_fp8(tiny_family("deepseek_v3", seed=3), tmp_path / "ds", block=(8, 8), shards=shards, mtp=True)
    stored = read_folder(folder)
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.3.mlp.experts.7.down_proj.weight_scale_inv" in stored  # the MTP layer's experts
    model = lightning_ep.transform(tiny_family("deepseek_v3", seed=11), CONFIG)
    with pytest.warns(
        UserWarning,
        match=r"ignored \d+ weights of .* that the model does not use, as transformers "
        r"does: \d+ multi-token-prediction weights \(e\.g\. 'model\.layers\.3\.",
    ):
        load_pretrained_sharded(model, folder)
    reference = transformers_load(folder)
    assert_same(model.eval(), reference)
    assert_same_logits(model, reference)


@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_partial_blocks_equal_a_hand_dequantization(tmp_path: Path, e8m0: bool) -> None:
    """Blocks of 16: kv_a_proj_with_mqa (24 rows), the dense MLP (48) and q_b/kv_b end in partial
    blocks, as DeepSeek-V3's own 576-row projection does with blocks of 128."""
    folder = write_fp8(tiny_family("deepseek_v3", seed=3), tmp_path / "ds", block=(16, 16), e8m0=e8m0)
    scale = read_folder(folder)["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert tuple(scale.shape) == (2, 4) and scale.dtype == (torch.float8_e8m0fnu if e8m0 else torch.float32)
    model = ours("deepseek_v3", folder)
    reference = by_hand_model(tiny_family("deepseek_v3", seed=0), folder, tmp_path / "hand")
    assert_same(model, reference)
    assert_same_logits(model, reference)


def by_hand_model(
    like: nn.Module, folder: Path, hand_folder: Path, tensors: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    """transformers' load (fused by its own rules) of ``folder``'s tensors dequantized by hand (or of
    ``tensors``, its tensors dequantized otherwise), saved in ``hand_folder`` with the config of ``like``
    (a model of the same family)."""
    like.save_pretrained(hand_folder)
    tensors = dequantized_by_hand(folder) if tensors is None else tensors
    write_shards({k: v.contiguous() for k, v in tensors.items()}, hand_folder, shards=1)
    return transformers_load(hand_folder)


def test_mixtral_fp8_per_expert(tmp_path: Path) -> None:
    """An FP8 release of a Mixtral-layout model: w1/w2/w3 per expert, each with its scales."""
    folder = write_fp8(tiny_family_mixtral(), tmp_path / "mx", block=(8, 16), shards=2)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight_scale_inv" in read_folder(folder)
    model = lightning_ep.transform(tiny_family_mixtral(seed=4), CONFIG)
    load_pretrained_sharded(model, folder)
    reference = transformers_load(folder)
    assert_same(model.eval(), reference)
    assert_same_logits(model, reference)


def tiny_family_mixtral(seed: int = 3, **overrides: int) -> nn.Module:
    from conftest import tiny_mixtral

    return tiny_mixtral(seed=seed, **overrides)


def transformed(model: nn.Module) -> nn.Module:
    return lightning_ep.transform(model, CONFIG)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "group", "block"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_llm_compressor_fp8_release(tmp_path: Path, model_type: str, strategy: str) -> None:
    """compressed-tensors' FP8 (RedHatAI's FP8-dynamic releases are per row, FP8-BLOCK per block):
    bf16 ``weight_scale`` multipliers, the router and head left in bf16, per-expert keys."""
    build = tiny_family_mixtral if model_type == "mixtral" else lambda seed: tiny_family(model_type, seed=seed)
    folder = write_compressed_fp8(build(seed=3), tmp_path / "ct", strategy, group=16, block=(16, 16))
    stored = read_folder(folder)
    expert = next(k for k in stored if ".experts.3." in k and k.endswith("_scale"))
    assert stored[expert].dtype == torch.bfloat16 and stored[expert[: -len("_scale")]].dtype == torch.float8_e4m3fn
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in the folder goes unused
        model = load_pretrained_sharded(transformed(build(seed=11)), folder).eval()
    reference = by_hand_model(build(seed=0), folder, tmp_path / "hand")
    assert_same(model, reference)
    assert_same_logits(model, reference)
    if strategy in ("tensor", "channel"):  # the scales compressed-tensors' own decompression handles for experts
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
            )
        assert_same(copy.deepcopy(model).to(torch.bfloat16), theirs)


def test_fp8_in_e5m2_is_read_as_e5m2(tmp_path: Path) -> None:
    """E5M2 weights (a wider range, one mantissa bit less) dequantize by their own encoding, and are not
    copied as e4m3 bytes into frozen FP8 experts: those are quantized again, with the one warning."""
    folder = write_compressed_fp8(tiny_family_mixtral(), tmp_path / "mx", "channel")
    stored = read_folder(folder)
    write_shards(
        {k: v.float().to(torch.float8_e5m2) if v.dtype == torch.float8_e4m3fn else v for k, v in stored.items()},
        folder,
        shards=1,
    )
    model = load_pretrained_sharded(transformed(tiny_family_mixtral(seed=4)), folder).eval()
    reference = by_hand_model(tiny_family_mixtral(seed=0), folder, tmp_path / "hand")
    assert_same(model, reference)
    assert_same_logits(model, reference)
    with torch.device("meta"):
        meta = transformed(tiny_family_mixtral(seed=4).requires_grad_(False))
    keep_frozen_experts(meta, "fp8", block=(1, 64))  # the folder's own per-row grid over 64 columns
    with pytest.warns(UserWarning, match=r"quantized otherwise than the model keeps them \(fp8"):
        load_pretrained_sharded(meta.to_empty(device="cpu"), folder)


def test_autofp8_static_per_tensor_release(tmp_path: Path) -> None:
    """AutoFP8's layout of neuralmagic's Mixtral-8x7B-Instruct-v0.1-FP8: a scalar ``weight_scale`` and a
    static ``input_scale`` per weight; the activation scales are unused, and named once."""
    folder = write_autofp8(tiny_family_mixtral(), tmp_path / "mx")
    stored = read_folder(folder)
    assert stored["model.layers.1.block_sparse_moe.experts.7.w2.weight_scale"].shape == ()
    model = transformed(tiny_family_mixtral(seed=4))
    with pytest.warns(UserWarning, match=r"\d+ static FP8 activation scales \(e\.g\. 'model\.layers\.0\."):
        load_pretrained_sharded(model, folder)
    reference = by_hand_model(tiny_family_mixtral(seed=0), folder, tmp_path / "hand")
    assert_same(model.eval(), reference)
    assert_same_logits(model, reference)


def test_gpt_oss_mxfp4_release(tmp_path: Path) -> None:
    folder = write_mxfp4(tiny_family("gpt_oss", seed=3), tmp_path / "oss")
    stored = read_folder(folder)
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (8, 64, 2, 16)
    assert stored["model.layers.0.mlp.experts.down_proj_scales"].shape == (8, 64, 1)
    model, reference = ours("gpt_oss", folder), transformers_load(folder)
    assert_same(model, reference)
    assert_same(model, dequantized_by_hand(folder))
    assert_same_logits(model, reference)


def test_glm4_moe_mtp_layer(tmp_path: Path) -> None:
    folder = add_mtp_layer(tiny_family("glm4_moe", seed=3), tmp_path / "glm")
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in read_folder(folder)
    model, reference = ours("glm4_moe", folder), transformers_load(folder)
    assert_same(model, reference)
    assert_same_logits(model, reference)


# --------------------------------------------------------------------------------------------
# The documented path: from_pretrained(folder) on the meta device, then the strategy's allocation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_from_pretrained_meta_build_and_export_round_trip(tmp_path: Path, model_type: str) -> None:
    """``models.pretrained.from_pretrained`` + ``materialize_if_meta`` (what the strategy runs) fills
    the model from an FP8 (MXFP4) folder; ``export_hf`` writes a bf16 folder without the quantization
    config, which transformers loads with the same weights and logits as the model rounded to bf16."""
    from transformers import AutoModelForCausalLM

    from lightning_ep.models.init import materialize_if_meta
    from lightning_ep.models.pretrained import from_pretrained

    if model_type == "deepseek_v3":
        folder = write_fp8(tiny_family(model_type, seed=3), tmp_path / "hf", block=(8, 8), mtp=True)
    else:
        folder = write_mxfp4(tiny_family(model_type, seed=3), tmp_path / "hf")
    model = from_pretrained(folder)
    assert getattr(model.config, "quantization_config", None) is None  # the model in memory is not quantized
    lightning_ep.transform(model, CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        materialize_if_meta(model, "cpu")
    reference = transformers_load(folder)
    assert_same(model.eval(), reference)

    out = export_hf(model, tmp_path / "export", hf_config_or_folder=folder)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert {t.dtype for t in read_folder(out).values()} == {torch.bfloat16}
    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert_same(exported, rounded)
    assert_same_logits(exported, rounded)


# --------------------------------------------------------------------------------------------
# What still fails, and how
# --------------------------------------------------------------------------------------------


def test_keys_the_class_ignores_are_ignored_and_named(tmp_path: Path) -> None:
    """DeepSeek-V3's class lists ``model\\.layers\\.61.*`` (the release's multi-token-prediction layer)
    in ``_keys_to_ignore_on_load_unexpected``: such keys are skipped, and named in the warning as the
    class's."""
    folder = tmp_path / "ds"
    tiny_family("deepseek_v3", seed=3).save_pretrained(folder)
    state = read_folder(folder)
    state["model.layers.61.eh_proj.weight"] = torch.zeros(64, 128)
    write_shards(state, folder, shards=1)
    model = lightning_ep.transform(tiny_family("deepseek_v3", seed=11), CONFIG)
    with pytest.warns(
        UserWarning, match=r"1 weights DeepseekV3ForCausalLM lists in _keys_to_ignore_on_load_unexpected"
    ):
        load_pretrained_sharded(model, folder)
    assert_same(model, transformers_load(folder))


def test_a_key_of_no_parameter_still_fails(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    tiny_family("deepseek_v3", seed=3).save_pretrained(folder)
    state = read_folder(folder)
    state["model.layers.1.mlp.experts.0.gate_proj.lora_magnitude"] = torch.zeros(4)
    write_shards(state, folder, shards=1)
    with pytest.raises(
        ValueError,
        match=r"1 weights in .* match no parameter of the DeepseekV3ForCausalLM, e\.g\. "
        r"\['model\.layers\.1\.mlp\.experts\.0\.gate_proj\.lora_magnitude'\]; the folder was saved from a "
        r"different model",
    ):
        ours("deepseek_v3", folder)
    # Layers past num_hidden_layers are ignored only where the config has multi-token prediction.
    mixtral = tmp_path / "mx"
    tiny_family_mixtral().save_pretrained(mixtral)
    state = read_folder(mixtral)
    state["model.layers.2.input_layernorm.weight"] = torch.ones(64)
    write_shards(state, mixtral, shards=1)
    with pytest.raises(ValueError, match=r"match no parameter .*'model\.layers\.2\.input_layernorm\.weight'"):
        load_pretrained_sharded(lightning_ep.transform(tiny_family_mixtral(seed=4), CONFIG), mixtral)


def _compressed(num_bits: int, kind: str, form: str) -> dict[str, object]:
    weights = {"num_bits": num_bits, "type": kind, "strategy": "group", "group_size": 128, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": form, "config_groups": {"group_0": {"weights": weights}}}


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"quant_method='gptq' \(3-bit\)"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            r"quant_method='gptq' \(checkpoint_format='marlin'\)",
        ),
        (
            {"quant_method": "awq", "bits": 4, "version": "gemv", "zero_point": True},
            r"quant_method='awq' \(4-bit, version 'gemv', zero_point=True\)",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_8bit": True},
            r"quant_method='bitsandbytes' \(8-bit \(LLM\.int8\)\)",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
            r"quant_method='bitsandbytes' \(4-bit stored in bfloat16\)",
        ),
        (
            _compressed(4, "int", "pack-quantized"),
            r"quant_method='compressed-tensors' \(config group 'group_0': "
            r"4-bit int weights, format 'pack-quantized'\)",
        ),
        (_compressed(4, "float", "nvfp4-pack-quantized"), r"4-bit float weights, format 'nvfp4-pack-quantized'\)"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"quant_method='modelopt' \(quant_algo='NVFP4'\)"),
    ],
)
def test_a_folder_quantized_in_a_format_it_cannot_read_is_refused_by_name(
    tmp_path: Path, quant: dict[str, object], named: str
) -> None:
    """GPTQ in 3 bits or Marlin's layout, AWQ's GEMV layout, bitsandbytes' 8-bit (and 4-bit stored in bf16), packed int4
    and NVFP4 releases are refused
    before any tensor is read, with the format named and the way on, not as weights of another model."""
    folder = tmp_path / "mx"
    tiny_family_mixtral().save_pretrained(folder)
    edit_config(folder, quantization_config=quant)
    with pytest.raises(
        ValueError,
        match=named + r", which this loader does not read: it reads FP8 weights .*"
        r"ExpertParallelStrategy\(frozen_experts='nf4'\)",
    ):
        load_pretrained_sharded(transformed(tiny_family_mixtral(seed=4)), folder)
    # A scaled weight stored other than in FP8 (NVFP4's packed bytes) is refused even where config.json
    # does not say so.
    edit_config(folder, quantization_config={"quant_method": "fp8"})
    state = read_folder(folder)
    key = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    state[key] = torch.zeros(32, 32, dtype=torch.uint8)
    state[key + "_scale"] = torch.ones(32, 4, dtype=torch.float8_e4m3fn)
    write_shards(state, folder, shards=1)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight' is stored "
        r"as U8 with scales .*: a quantized format this loader does not read",
    ):
        load_pretrained_sharded(transformed(tiny_family_mixtral(seed=4)), folder)


def test_fp8_scale_errors(tmp_path: Path) -> None:
    folder = write_fp8(tiny_family("deepseek_v3", seed=3), tmp_path / "ds", block=(16, 16), shards=1)
    edit_config(folder, quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32]})
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' is \[4, 3\] but "
        r"'model\.layers\.0\.mlp\.down_proj\.weight' \[64, 48\] in blocks of \[32, 32\] needs a grid "
        r"of \[2, 2\]; the scales do not belong to this weight or weight_block_size is wrong",
    ):
        ours("deepseek_v3", folder)
    edit_config(folder, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match=r"config\.json has no quantization_config\.weight_block_size; add the block"):
        ours("deepseek_v3", folder)
