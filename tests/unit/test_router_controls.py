"""Router controls for fine-tuning: frozen routers (``lightning_ep.freeze_routers``) and the
``"sinkhorn"`` selection gap that ``MoEMonitor`` reports.

- A frozen router routes as before and its losses are reported with the same values, but they add
  no gradient: every other parameter's gradient equals that of the same model with both loss
  coefficients at 0 (the same autograd graph for the model's loss, so the same bits), and the
  ``"balanced"`` bias (this library's, or DeepSeek-V3's own ``e_score_correction_bias``) stays.
- ``selection_gap`` equals a hand count of the tokens whose Sinkhorn choice of experts differs from
  the plain top-k of the same router, and is 0 in evaluation and in the other modes.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_mixtral
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig, freeze_routers
from lightning_ep.moe import TopKRouter
from lightning_ep.moe.routing.router import group_limited, sinkhorn_log
from lightning_ep.parallel.balance import update_expert_biases

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import tiny_family

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
WITH_LOSSES = MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.05)
WITHOUT_LOSSES = MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)


def step(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """One forward and backward of the language-model loss; the gradient of every parameter."""
    model.train().zero_grad(set_to_none=True)
    model(input_ids=IDS, labels=IDS).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("before_transform", [True, False])
def test_frozen_routers_report_losses_and_add_no_gradient(before_transform: bool) -> None:
    base = tiny_mixtral(seed=1)
    frozen = copy.deepcopy(base)
    if before_transform:
        names = freeze_routers(frozen)
        lightning_ep.transform(frozen, WITH_LOSSES)
    else:
        names = freeze_routers(lightning_ep.transform(frozen, WITH_LOSSES))
    assert names == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert all(layer.gate.frozen for layer in lightning_ep.moe_layers(frozen))

    trained = lightning_ep.transform(copy.deepcopy(base), WITH_LOSSES)  # the same model, routers trained
    no_losses = lightning_ep.transform(copy.deepcopy(base), WITHOUT_LOSSES)
    grads_frozen, grads_trained, grads_without = step(frozen), step(trained), step(no_losses)
    for name, grad in grads_frozen.items():
        if name.endswith("gate.weight"):
            assert grad is None, name
            continue
        assert torch.equal(grad, grads_without[name]), name  # the losses reach no gradient
    # The losses do reach the trained model's gradients (so the comparison above means something).
    assert not torch.equal(
        grads_trained["model.layers.0.self_attn.q_proj.weight"], grads_frozen["model.layers.0.self_attn.q_proj.weight"]
    )
    # ... and are reported, with the same values.
    for mine, theirs in zip(lightning_ep.moe_layers(frozen), lightning_ep.moe_layers(trained), strict=True):
        assert mine.aux_loss.item() > 0 and torch.equal(mine.aux_loss, theirs.aux_loss)
        assert torch.equal(mine.z_loss, theirs.z_loss)


def test_peft_leaves_routers_frozen() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_mixtral(seed=1), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lightning_ep.transform(model, WITH_LOSSES)
    assert all(layer.gate.frozen for layer in lightning_ep.moe_layers(model))
    with pytest.raises(ValueError, match=r"freeze_routers\(model\): found no MoE router in the Linear; pass a"):
        freeze_routers(nn.Linear(4, 4))


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_frozen_balanced_bias_stays(model_type: str) -> None:
    config = MoEConfig(moe_load_balancing="balanced", balance_update_rate=0.01)
    make = (lambda: tiny_mixtral(seed=2)) if model_type == "mixtral" else (lambda: tiny_family(model_type, seed=2))
    frozen, trained = lightning_ep.transform(make(), config), lightning_ep.transform(make(), config)
    freeze_routers(frozen)
    for model in (frozen, trained):
        before = [layer.gate.selection_bias.clone() for layer in lightning_ep.moe_layers(model)]
        step(model)
        update_expert_biases(model)
        after = [layer.gate.selection_bias for layer in lightning_ep.moe_layers(model)]
        moved = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert moved == (model is trained), model_type


# ---------------------------------------------------------------- the selection gap


def test_selection_gap_counts_tokens_whose_sinkhorn_choice_differs() -> None:
    torch.manual_seed(0)
    model = lightning_ep.transform(tiny_mixtral(seed=3), MoEConfig(moe_load_balancing="sinkhorn"))
    layer = lightning_ep.moe_layers(model)[0]
    x_BSH = torch.randn(4, 8, 64) * 3  # sharp router scores: Sinkhorn changes many choices
    layer.train()(x_BSH)
    logits_TE = F.linear(x_BSH.reshape(-1, 64), layer.gate.weight.detach())
    balanced = sinkhorn_log(logits_TE, layer.gate.sinkhorn_iterations).topk(2, dim=-1).indices.sort(-1).values
    plain = torch.softmax(logits_TE, dim=-1).topk(2, dim=-1).indices.sort(-1).values
    expected = (balanced != plain).any(-1).float().mean()
    assert 0 < expected.item() < 1
    assert layer.selection_gap.item() == pytest.approx(expected.item(), abs=0)
    assert not layer.selection_gap.requires_grad
    layer.eval()(x_BSH)
    assert layer.selection_gap.item() == 0.0  # inference's own choice
    aux = lightning_ep.moe_layers(
        lightning_ep.transform(tiny_mixtral(seed=3), MoEConfig(moe_load_balancing="aux_loss"))
    )
    aux[0].train()(x_BSH)
    assert aux[0].selection_gap.item() == 0.0


def test_selection_gap_with_sigmoid_groups_and_a_correction_bias() -> None:
    torch.manual_seed(1)
    weight = nn.Parameter(torch.randn(8, 16))
    bias = torch.randn(8) * 0.1
    router = TopKRouter(
        weight, top_k=2, mode="sinkhorn", scoring="sigmoid", e_score_correction_bias=bias, n_group=4, topk_group=2
    ).train()
    x_TH = torch.randn(64, 16)
    routing = router(x_TH)
    logits_TE = F.linear(x_TH, weight.detach())
    chosen = group_limited(sinkhorn_log(logits_TE, 30).exp(), 4, 2).topk(2, dim=-1).indices.sort(-1).values
    plain = group_limited(torch.sigmoid(logits_TE) + bias, 4, 2).topk(2, dim=-1).indices.sort(-1).values
    assert routing.differs_T is not None
    assert torch.equal(routing.differs_T, (chosen != plain).any(-1))
    assert torch.equal(routing.expert_ids_TK.sort(-1).values, chosen)
