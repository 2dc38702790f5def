"""LoRA through PEFT on one process: PEFT's math, PEFT's files, and every refusal.

``transform`` of a ``peft.get_peft_model`` LoRA model gives the loss and every LoRA gradient of
PEFT's own model (fp32, 1e-5; grouped GEMM and per-expert paths); ``export_lora_adapter`` and
``export_hf`` of the trained model load back with ``PeftModel.from_pretrained`` and
``from_pretrained`` with its logits; bad LoRA setups are refused by message.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch

import lightning_ep
from lightning_ep import MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from lora_workers import lora_config, peft_expert_grads, tiny_base, tiny_peft

CONFIG = MoEConfig(moe_load_balancing="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_transformed_lora_equals_peft(model_type: str, use_grouped_mm: bool | None) -> None:
    reference = tiny_peft(model_type)
    model = lightning_ep.transform(copy.deepcopy(reference), CONFIG)
    for layer in lightning_ep.moe_layers(model):
        assert type(layer.experts).__name__ == "LoRAGroupedExperts"
        layer.experts.use_grouped_mm = use_grouped_mm
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    ref_loss = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    got = peft_expert_grads(model)
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any(n.endswith("experts.gate_up_proj") for n in frozen)
    assert all(model.get_parameter(n).grad is None for n in frozen)


def test_adapter_and_merged_exports_round_trip(tmp_path: Path) -> None:
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_ep.models.hf_export import export_hf
    from lightning_ep.models.lora_export import export_lora_adapter

    base = tiny_base("qwen3_moe")
    base.save_pretrained(tmp_path / "base")
    model = lightning_ep.transform(get_peft_model(base, lora_config()), CONFIG)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        ids = _ids(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ids = _ids(9)
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits
    export_lora_adapter(model, tmp_path / "adapter", hf_config_or_folder=tmp_path / "base")
    export_hf(model, tmp_path / "merged", hf_config_or_folder=tmp_path / "base")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    base_again = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = PeftModel.from_pretrained(base_again, str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)


def test_export_hf_of_lora_factors_without_a_lora_config_is_refused(tmp_path: Path) -> None:
    from lightning_ep.models.hf_export import export_hf

    model = lightning_ep.transform(tiny_peft("mixtral"), CONFIG)
    with pytest.raises(ValueError, match=re.escape("holds LoRA factors") + ".*pass lora_config="):
        export_hf(dict(model.state_dict()), tmp_path / "out", hf_config_or_folder=model.config)


def test_target_parameters_matching_nothing_is_refused() -> None:
    model = tiny_peft("mixtral", target_parameters=["experts.gate_up_proj", "experts.w1"])
    with pytest.raises(ValueError, match=re.escape("target_parameters=[..., 'experts.w1', ...]) matches no parameter")):
        lightning_ep.transform(model, CONFIG)


def test_lora_target_modules_matching_nothing_is_refused_by_peft() -> None:
    with pytest.raises(ValueError, match=re.escape("Target modules {'wq'} not found")):
        tiny_peft("mixtral", target_modules=["wq"], target_parameters=None)


@pytest.mark.parametrize(
    ("lora", "where"),
    [
        (dict(target_modules=["q_proj", "gate"]), "layers.0.mlp.gate"),
        (dict(target_parameters=["experts.gate_up_proj", "gate.weight"]), "layers.0.mlp.gate"),
    ],
)
def test_adapter_on_the_router_is_refused(lora: dict, where: str) -> None:
    model = tiny_peft("mixtral", **lora)
    with pytest.raises(ValueError, match=re.escape(where) + ".*Fix: leave the router out of the LoRA targets"):
        lightning_ep.transform(model, CONFIG)


def test_another_peft_method_is_refused() -> None:
    from peft import IA3Config, get_peft_model

    model = get_peft_model(tiny_base("mixtral"), IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(ValueError, match=r"uses IA3, and lightning_ep trains PEFT's LoRA only.*LoraConfig"):
        lightning_ep.transform(model, CONFIG)


def test_several_adapters_are_refused() -> None:
    model = tiny_peft("mixtral")
    model.add_adapter("second", lora_config())
    with pytest.raises(ValueError, match=re.escape("holds 2 adapters ['default', 'second']") + ".*delete_adapter"):
        lightning_ep.transform(model, CONFIG)


def test_merged_adapter_is_refused() -> None:
    model = tiny_peft("mixtral")
    model.merge_adapter()
    with pytest.raises(ValueError, match=r"is merged into the weight.*unmerge_adapter"):
        lightning_ep.transform(model, CONFIG)


def test_adapter_on_another_expert_parameter_is_refused() -> None:
    from peft import get_peft_model
    from torch import nn

    base = tiny_base("mixtral")
    experts = base.model.layers[0].mlp.experts
    experts.extra = nn.Parameter(torch.zeros(8, 16, 64))  # a 3-D parameter PEFT can wrap, not an expert weight
    model = get_peft_model(base, lora_config(target_parameters=["experts.gate_up_proj", "layers.0.mlp.experts.extra"]))
    with pytest.raises(ValueError, match=re.escape("experts.extra, but lightning_ep carries LoRA on the experts'")):
        lightning_ep.transform(model, CONFIG)


def test_transformers_experts_implementation_on_lora_experts_is_refused() -> None:
    model = lightning_ep.transform(tiny_peft("mixtral"), CONFIG)
    model.set_experts_implementation("eager")
    ids = _ids()
    with pytest.raises(ValueError, match=r"without their LoRA adapters.*set_experts_implementation\('lightning_ep'\)"):
        model(input_ids=ids)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_pretrained_weights_load_into_a_peft_wrapped_model(tmp_path: Path, model_type: str) -> None:
    """``from_pretrained`` + ``get_peft_model`` in ``configure_model``: the base weights come from the
    folder (under PEFT's ``base_model.model.`` and ``base_layer`` names), the adapters keep their values."""
    from lightning_ep.models.hf_io import load_pretrained_sharded

    tiny_base(model_type, seed=0).save_pretrained(tmp_path)
    saved = {k: v.clone() for k, v in tiny_base(model_type, seed=0).state_dict().items()}
    model = lightning_ep.transform(tiny_peft(model_type, seed=5), MoEConfig())
    adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    assert adapters
    load_pretrained_sharded(model, tmp_path)
    state = model.state_dict()
    for key, value in adapters.items():
        assert torch.equal(state[key], value), key
    base = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v for k, v in state.items()}
    for key, value in saved.items():
        assert torch.equal(base[key], value), key


def test_expert_lora_ranks_seen_before_and_after_transform() -> None:
    """The setup reads the experts' LoRA ranks off PEFT's wrappers or off the transformed experts
    (the automatic CUDA graphs need multiples of 8); attention-only LoRA has none."""
    from lightning_ep.execution.environment import expert_lora_ranks

    peft_model = tiny_peft("mixtral", r=4)
    assert expert_lora_ranks(peft_model) == (4,)
    assert expert_lora_ranks(lightning_ep.transform(peft_model, CONFIG)) == (4,)
    assert expert_lora_ranks(tiny_peft("mixtral", target_parameters=[])) == ()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_shape_of_a_peft_model_before_and_after_transform(family: str) -> None:
    """PEFT wraps the experts (``ParamWrapper``): the shape is read from their base weight, and equals
    the transformed model's."""
    from lightning_ep.models.registry import MoEShape

    model = tiny_peft(family)
    before = MoEShape.of(model)
    assert before.num_experts is not None and before.top_k is not None and before.expert_elements > 0
    assert MoEShape.of(lightning_ep.transform(model, CONFIG)) == before
