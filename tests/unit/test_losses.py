"""Router losses: the pure functions on hand-checked numbers, the per-layer values a ``MoELayer``
keeps, and the gradient the layer attaches to its router weight by itself.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, tiny_mixtral
from torch import nn
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import lightning_ep
from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter, load_balancing_loss, z_loss

H, I, E, K, T = 64, 32, 8, 2, 48  # noqa: E741 (shape letters, as in lightning_ep.moe)


# ---------------------------------------------------------------- pure functions, by hand


def test_load_balancing_loss_hand_example():
    # T=4 tokens, E=2 experts, K=1. Top-1 picks 0, 0, 1, 0 -> f = [3/4, 1/4];
    # mean probs P = [2.6/4, 1.4/4] = [0.65, 0.35]; loss = 2 * (0.75*0.65 + 0.25*0.35) = 1.15.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], dtype=torch.float64)
    ids = torch.tensor([[0], [0], [1], [0]])
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.15, abs=1e-12)
    # HF's function softmaxes its input: log-probs give back these probs.
    hf = load_balancing_loss_func((probs.log().float(),), 2, 1)
    assert hf.item() == pytest.approx(1.15, abs=1e-6)


def test_load_balancing_loss_uniform_probs_is_one():
    # P_e = 1/E for every expert and sum_e f_e = 1, so E * sum f_e / E = 1 whatever the choice.
    probs = torch.full((6, 4), 0.25)
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3], [1, 2], [0, 1]])
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.0, abs=1e-6)


def test_load_balancing_loss_even_routing_is_one():
    # Every expert gets T * K / E pairs: f_e = 1/E, so the loss is sum_e P_e = 1 for any probs.
    probs = torch.softmax(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.0, abs=1e-6)


def test_load_balancing_loss_is_megatrons_formula():
    """Megatron-Core's ``switch_load_balancing_loss_func`` (before its coefficient): ``sum_e(sum_t p_te *
    count_e) * E / (K * T * T)``, by hand on a T=5, E=4, K=2 example; ``transformers``'
    ``load_balancing_loss_func`` is ``K`` times it."""
    probs = torch.tensor(
        [
            [0.4, 0.3, 0.2, 0.1],
            [0.1, 0.6, 0.2, 0.1],
            [0.3, 0.2, 0.15, 0.35],
            [0.7, 0.1, 0.05, 0.15],
            [0.2, 0.25, 0.5, 0.05],
        ],
        dtype=torch.float64,
    )
    ids = torch.tensor([[0, 1], [1, 2], [0, 3], [0, 1], [2, 0]])
    # counts = [4, 3, 2, 1]; column sums of p = [1.7, 1.45, 1.1, 0.75].
    expected = (1.7 * 4 + 1.45 * 3 + 1.1 * 2 + 0.75 * 1) * 4 / (2 * 5 * 5)
    assert load_balancing_loss(probs, ids).item() == pytest.approx(expected, abs=1e-12)
    # HF picks the top-k of the probabilities itself (and softmaxes its input: log-probs give them back).
    top_ids = torch.topk(probs, 2, dim=-1).indices
    hf = load_balancing_loss_func((probs.log().float(),), 4, 2)
    assert hf.item() == pytest.approx(2 * load_balancing_loss(probs, top_ids).item(), rel=1e-6)


def test_load_balancing_and_z_loss_leave_out_padded_tokens():
    """With ``valid_T`` the losses equal those of the real tokens alone, and are 0 without any."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, dim=-1)
    ids = torch.topk(probs, 2, dim=-1).indices
    valid = torch.tensor([True, False, True, True, False, True])
    assert load_balancing_loss(probs, ids, valid).item() == pytest.approx(
        load_balancing_loss(probs[valid], ids[valid]).item(), abs=1e-12
    )
    assert z_loss(logits, valid).item() == pytest.approx(z_loss(logits[valid]).item(), abs=1e-12)
    none = torch.zeros(6, dtype=torch.bool)
    assert load_balancing_loss(probs, ids, none).item() == 0.0 and z_loss(logits, none).item() == 0.0
    assert load_balancing_loss(probs[:0], ids[:0]).item() == 0.0 and z_loss(logits[:0]).item() == 0.0


def test_load_balancing_loss_gradient_flows_through_probs_only():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], requires_grad=True)
    ids = torch.tensor([[0], [0], [1], [0]])
    load_balancing_loss(probs, ids).backward()
    # d/dP[t, e] of E * sum_e f_e * mean_t P[t, e] = E * f_e / T = 2 * [0.75, 0.25] / 4 (K = 1).
    assert torch.allclose(probs.grad, torch.tensor([[0.375, 0.125]]).expand(4, 2))


def test_z_loss_hand_example():
    # Row 1: logits all zero, E=4 -> logsumexp = log 4. Row 2: exp(logits) = 1, 2, 3, 4 -> log 10.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3), math.log(4)]], dtype=torch.float64)
    expected = (math.log(4) ** 2 + math.log(10) ** 2) / 2
    assert z_loss(logits).item() == pytest.approx(expected, abs=1e-12)
    assert z_loss(torch.zeros(5, 4)).item() == pytest.approx(math.log(4) ** 2, rel=1e-6)


def test_z_loss_matches_hand_formula_on_random_logits():
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    expected = torch.log(torch.exp(logits).sum(dim=-1)).square().mean()
    assert z_loss(logits).item() == pytest.approx(expected.item(), rel=1e-12)


# ---------------------------------------------------------------- per-layer values in a model


def _hf_router_logits(reference, ids):
    logits = []
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0].detach()))
        for layer in reference.model.layers
    ]
    reference(ids)
    for h in handles:
        h.remove()
    return logits


@pytest.mark.parametrize("mode", ["aux_loss", "none"])
def test_layer_losses_match_hf_per_layer(mode):
    reference = tiny_mixtral()
    model = lightning_ep.transform(copy.deepcopy(reference), MoEConfig(moe_load_balancing=mode))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    hf_logits = _hf_router_logits(reference, ids)
    model(ids)
    layers = lightning_ep.moe_layers(model)
    assert len(layers) == len(hf_logits) == 2
    for layer, logits in zip(layers, hf_logits, strict=True):
        expected_aux = load_balancing_loss_func((logits,), E, K) / K  # HF's f_e sum to K, ours to 1
        assert layer.aux_loss.shape == () and not layer.aux_loss.requires_grad
        assert rel_err(layer.aux_loss, expected_aux) < 1e-6
        expected_z = torch.log(torch.exp(logits).sum(dim=-1)).square().mean()
        assert layer.z_loss.shape == () and not layer.z_loss.requires_grad
        assert rel_err(layer.z_loss, expected_z) < 1e-6
        expected_counts = torch.bincount(torch.topk(logits, K, dim=-1).indices.flatten(), minlength=E)
        assert layer.tokens_per_expert.dtype == torch.int64
        assert torch.equal(layer.tokens_per_expert, expected_counts)
    # The two layers see different logits, so a pooled (all-layer) loss would differ from each.
    pooled = load_balancing_loss_func(tuple(hf_logits), E, K)
    assert not torch.allclose(layers[0].aux_loss, layers[1].aux_loss)
    assert not torch.allclose(pooled / K, layers[0].aux_loss)


# ---------------------------------------------------------------- gradients from the attached losses


def _layer(mode="aux_loss", aux=0.1, z=0.01, seed=0) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    weight = nn.Parameter(torch.randn(E, H, generator=g) * 0.3)
    gate = TopKRouter(weight, top_k=K, mode=mode)
    experts = GroupedExperts(
        nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.1),
        nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1),
        F.silu,
    )
    config = MoEConfig(moe_load_balancing=mode, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    return MoELayer(gate, experts, config)


def _x(seed=1) -> torch.Tensor:
    return torch.randn(2, T // 2, H, generator=torch.Generator().manual_seed(seed))


def _router_loss_grad(weight: torch.Tensor, x: torch.Tensor, aux: float, z: float) -> torch.Tensor:
    """``d(aux * lb + z * zl)/d weight`` computed by hand with plain top-k routing."""
    w = weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, H) @ w.t()
    probs = torch.softmax(logits, dim=-1)
    ids = torch.topk(probs, K, dim=-1).indices
    fraction = F.one_hot(ids, E).sum(dim=(0, 1)).float() / (logits.shape[0] * K)
    lb = E * (fraction * probs.mean(dim=0)).sum()
    zl = torch.logsumexp(logits, dim=-1).square().mean()
    (grad,) = torch.autograd.grad(aux * lb + z * zl, w)
    return grad


def _attached_grad(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Gradient reaching the router weight when the upstream gradient is zero: the losses alone."""
    out = layer(x)
    out.backward(torch.zeros_like(out))
    assert layer.gate.weight.grad is not None
    return layer.gate.weight.grad


@pytest.mark.parametrize(("aux", "z"), [(0.1, 0.01), (0.1, 0.0), (0.0, 0.01)])
def test_attached_gradient_equals_weighted_losses(aux, z):
    layer = _layer(aux=aux, z=z)
    x = _x()
    grad = _attached_grad(layer, x)
    expected = _router_loss_grad(layer.gate.weight, x, aux, z)
    assert expected.norm() > 0
    assert rel_err(grad, expected) < 1e-5
    # Experts get nothing from the router losses.
    assert torch.count_nonzero(layer.experts.gate_up_proj.grad) == 0
    assert torch.count_nonzero(layer.experts.down_proj.grad) == 0


def test_loss_scale_halves_the_attached_gradient():
    x = _x()
    full = _attached_grad(_layer(), x).clone()
    half_layer = _layer()
    half_layer.loss_scale = 0.5
    half = _attached_grad(half_layer, x)
    assert rel_err(half, 0.5 * full) < 1e-6
    assert rel_err(full, _router_loss_grad(half_layer.gate.weight, x, 0.1, 0.01)) < 1e-5


def test_sinkhorn_attaches_z_loss_only():
    # The aux-loss coefficient only applies to "aux_loss"; z-loss applies whenever its coeff > 0.
    layer = _layer(mode="sinkhorn", aux=0.1, z=0.01)
    x = _x()
    grad = _attached_grad(layer, x)
    expected = _router_loss_grad(layer.gate.weight, x, 0.0, 0.01)  # z-loss does not depend on ids
    assert rel_err(grad, expected) < 1e-5


def test_eval_attaches_nothing():
    layer = _layer().eval()
    grad = _attached_grad(layer, _x())
    assert torch.count_nonzero(grad) == 0
    assert layer.aux_loss > 0 and layer.z_loss > 0  # still measured for logging


def test_zero_coefficients_attach_nothing():
    layer = _layer(aux=0.0, z=0.0)
    grad = _attached_grad(layer, _x())
    assert torch.count_nonzero(grad) == 0


def test_no_grad_forward_records_losses_without_attaching():
    layer = _layer()
    x = _x()
    with torch.no_grad():
        out = layer(x)
    assert out.grad_fn is None
    logits = x.reshape(-1, H) @ layer.gate.weight.detach().t()
    assert rel_err(layer.z_loss, torch.logsumexp(logits, -1).square().mean()) < 1e-6
    assert rel_err(layer.aux_loss, load_balancing_loss_func((logits,), E, K) / K) < 1e-6


def test_losses_attach_once_per_forward_even_if_output_is_reused():
    layer = _layer()
    x = _x()
    out = layer(x)
    # The output is used twice, yet its zero upstream gradient still attaches the losses once.
    (0.0 * out.sum() + 0.0 * out.square().sum()).backward()
    expected = _router_loss_grad(layer.gate.weight, x, 0.1, 0.01)
    assert rel_err(layer.gate.weight.grad, expected) < 1e-5


def test_gradient_accumulation_adds_each_forward_once():
    layer = _layer()
    x1, x2 = _x(1), _x(2)
    layer(x1).sum().mul(0.0).backward()
    layer(x2).sum().mul(0.0).backward()
    expected = _router_loss_grad(layer.gate.weight, x1, 0.1, 0.01) + _router_loss_grad(layer.gate.weight, x2, 0.1, 0.01)
    assert rel_err(layer.gate.weight.grad, expected) < 1e-5
