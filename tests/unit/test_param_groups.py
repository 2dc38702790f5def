"""``weight_decay_groups`` on a tiny model of every supported family, before and after ``transform``.

The expected split is written out per family from the Hugging Face parameter names: norms, biases,
GPT-OSS's sinks, routers and Qwen2-MoE's shared-expert gate are not decayed; everything else
(embeddings, attention and expert matrices, dense and shared MLPs, the LM head) is.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.param_groups import no_weight_decay, weight_decay_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import tiny_family

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"]
# Hugging Face names that must not decay: norms (any "norm" module), biases, sinks, routers.
UNDECAYED = re.compile(
    r"(norm\.weight$|layernorm\.weight$|bias$|\.sinks$|\.mlp\.gate\.weight$|\.mlp\.router\.weight$"
    r"|\.mlp\.shared_expert_gate\.weight$)"
)


def _model(family: str) -> torch.nn.Module:
    return tiny_mixtral() if family == "mixtral" else tiny_family(family)


def _expected(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if UNDECAYED.search(name)]


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_biases_and_routers_do_not_decay(family: str) -> None:
    model = _model(family)
    expected = _expected(model)
    assert any(".mlp.gate." in n or ".mlp.router." in n for n in expected), expected  # the table found routers
    assert no_weight_decay(model) == expected
    # The same after the MoE blocks became MoELayers (here in "balanced" mode, which adds a buffer).
    lightning_ep.transform(model, MoEConfig(moe_load_balancing="balanced"))
    assert no_weight_decay(model) == expected

    groups = weight_decay_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    by_id = {id(p): name for name, p in model.named_parameters()}
    decayed = [by_id[id(p)] for p in groups[0]["params"]]
    assert [by_id[id(p)] for p in groups[1]["params"]] == expected
    assert sorted(decayed + expected) == sorted(by_id.values())  # every parameter once
    assert "lm_head.weight" in decayed and any(n.endswith("gate_up_proj") for n in decayed)
    buffers = {id(b) for b in model.buffers()}
    assert not buffers & {id(p) for g in groups for p in g["params"]}
    torch.optim.AdamW(groups, lr=1e-3)  # a valid optimizer argument


def test_shared_expert_gate_and_gpt_oss_biases_are_listed() -> None:
    qwen = no_weight_decay(tiny_family("qwen2_moe"))
    assert "model.layers.0.mlp.shared_expert_gate.weight" in qwen
    gpt = no_weight_decay(tiny_family("gpt_oss"))
    for name in ("mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj_bias", "self_attn.sinks"):
        assert f"model.layers.0.{name}" in gpt


def test_frozen_parameters_are_left_out_and_empty_groups_dropped() -> None:
    model = tiny_mixtral()
    for name, p in model.named_parameters():
        p.requires_grad_(bool(UNDECAYED.search(name)))
    groups = weight_decay_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.0]
    assert no_weight_decay(model) == _expected(model)
    model.requires_grad_(False)
    assert weight_decay_groups(model, 0.1) == [] and no_weight_decay(model) == []


def test_negative_weight_decay_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("weight_decay_groups(weight_decay=-0.1) must be >= 0.")):
        weight_decay_groups(tiny_mixtral(), -0.1)
