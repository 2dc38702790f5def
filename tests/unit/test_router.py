"""``TopKRouter`` in each balancing mode, ``sinkhorn_log``, the ``"balanced"`` bias, and router jitter.

References: Mixtral's own ``MixtralTopKRouter`` for plain top-k, hand computations otherwise.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, tiny_mixtral, tiny_mixtral_config
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_ep
from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter, sinkhorn_log
from lightning_ep.strategy.arguments import enable_checkpointing

H, I, E, K = 64, 32, 8, 2  # noqa: E741 (shape letters, as in lightning_ep.moe)


def _weight(seed: int = 0, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(E, H, generator=torch.Generator().manual_seed(seed)) * scale


def _x(num_tokens: int = 64, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _router(mode: str, weight: torch.Tensor | None = None, **kwargs) -> TopKRouter:
    weight = _weight() if weight is None else weight
    return TopKRouter(nn.Parameter(weight.clone()), top_k=K, mode=mode, **kwargs)


def _counts(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids.flatten(), minlength=E)


# ---------------------------------------------------------------- plain top-k = Mixtral


@pytest.mark.parametrize("mode", ["none", "aux_loss"])
@pytest.mark.parametrize("train", [True, False])
def test_plain_topk_matches_mixtral_router(mode, train):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    hf = MixtralTopKRouter(tiny_mixtral_config())
    with torch.no_grad():
        hf.weight.copy_(_weight())
    router = _router(mode, hf.weight.detach()).train(train)
    x = _x()
    hf_logits, hf_weights, hf_ids = hf(x)
    routing = router(x)
    assert torch.equal(routing.expert_ids_TK, hf_ids)
    assert torch.allclose(routing.weights_TK, hf_weights, rtol=1e-6, atol=1e-7)
    assert torch.allclose(routing.logits_TE, hf_logits, rtol=1e-6, atol=1e-7)
    assert torch.allclose(routing.probs_TE, torch.softmax(hf_logits, -1), rtol=1e-6, atol=1e-7)
    assert routing.expert_ids_TK.dtype == torch.int64


def test_router_adopts_the_weight_parameter():
    weight = nn.Parameter(_weight())
    router = TopKRouter(weight, top_k=K, mode="none")
    assert router.weight is weight
    assert list(router.state_dict()) == ["weight"]


@pytest.mark.parametrize("top_k", [0, E + 1])
def test_top_k_out_of_range(top_k):
    with pytest.raises(ValueError, match=re.escape(f"top_k={top_k} must be between 1 and the number of experts (8).")):
        TopKRouter(nn.Parameter(_weight()), top_k=top_k, mode="none")


def test_without_normalisation_weights_are_raw_probs():
    router = _router("none", normalize_weights=False)
    routing = router(_x())
    expected_w, expected_ids = torch.topk(torch.softmax(_x() @ _weight().t(), -1), K, dim=-1)
    assert torch.equal(routing.expert_ids_TK, expected_ids)
    assert torch.allclose(routing.weights_TK, expected_w, rtol=1e-6)


# ---------------------------------------------------------------- router dtype


def test_bf16_input_routes_in_fp32():
    x = _x(dtype=torch.bfloat16)
    router = _router("none", _weight().bfloat16().float())
    routing = router(x)
    assert routing.logits_TE.dtype == torch.float32
    assert routing.weights_TK.dtype == torch.float32
    expected = F.linear(x.float(), router.weight.detach())
    assert torch.allclose(routing.logits_TE, expected, rtol=1e-6, atol=1e-6)


def test_bf16_weight_is_upcast_too():
    router = TopKRouter(nn.Parameter(_weight().bfloat16()), top_k=K, mode="none")
    routing = router(_x(dtype=torch.bfloat16))
    assert routing.logits_TE.dtype == torch.float32
    expected = F.linear(_x(dtype=torch.bfloat16).float(), _weight().bfloat16().float())
    assert torch.allclose(routing.logits_TE, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["none", "sinkhorn", "balanced"])
def test_autocast_leaves_the_routing_in_fp32(mode):
    """Lightning's "bf16-mixed" runs the model under autocast, which would take the gate's product
    to bf16: the router's logits, scores, choices and weights must be those computed without it."""
    router = _router(mode)
    x = _x()
    expected = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    assert routing.logits_TE.dtype == routing.weights_TK.dtype == torch.float32
    assert torch.equal(routing.logits_TE, expected.logits_TE)
    assert torch.equal(routing.expert_ids_TK, expected.expert_ids_TK)
    assert torch.equal(routing.weights_TK, expected.weights_TK)


def test_float64_router_dtype():
    router = _router("none", router_dtype=torch.float64)
    x = _x()
    routing = router(x)
    assert routing.logits_TE.dtype == torch.float64
    assert routing.probs_TE.dtype == torch.float64
    assert routing.weights_TK.dtype == torch.float64
    logits = x.double() @ _weight().double().t()
    expected_w, expected_ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    assert torch.equal(routing.expert_ids_TK, expected_ids)
    assert torch.allclose(routing.weights_TK, expected_w / expected_w.sum(-1, keepdim=True), rtol=1e-12)


def test_transform_applies_router_dtype():
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(router_dtype="float64", sinkhorn_iterations=7))
    for layer in lightning_ep.moe_layers(model):
        assert layer.gate.router_dtype == torch.float64
        assert layer.gate.sinkhorn_iterations == 7
        assert layer.gate.weight.dtype == torch.float32  # the parameter itself is not cast


# ---------------------------------------------------------------- sinkhorn


@pytest.mark.parametrize("num_tokens", [64, 256])
def test_sinkhorn_log_marginals(num_tokens):
    logits = torch.randn(num_tokens, E, generator=torch.Generator().manual_seed(0)) * 2
    p = sinkhorn_log(logits, 30).exp()
    assert p.shape == (num_tokens, E)
    assert (p.sum(dim=1) - 1).abs().max() < 1e-3
    assert ((p.sum(dim=0) / (num_tokens / E)) - 1).abs().max() < 1e-3


def test_sinkhorn_log_keeps_row_order_of_scores():
    # Rescaling rows and columns by positive factors is exp(logits + u_t + v_e): differences within a
    # column between two rows are preserved.
    logits = torch.randn(32, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s = sinkhorn_log(logits, 5)
    diff = (s - logits) - (s - logits)[:, :1]  # v_e - v_0, the same for every row
    assert torch.allclose(diff, diff[:1].expand_as(diff), atol=1e-10)


def test_sinkhorn_log_survives_huge_logits():
    logits = torch.randn(16, E, generator=torch.Generator().manual_seed(2)) * 1000
    assert torch.isfinite(sinkhorn_log(logits, 30)).all()


def _skewed_router(mode: str) -> tuple[TopKRouter, torch.Tensor]:
    # Feature 0 of every token is 1 and expert 0's weight on it is 3: a large bias towards expert 0.
    weight = _weight(scale=0.1)
    weight[0, 0] = 3.0
    x = _x(256)
    x[:, 0] = 1.0
    return _router(mode, weight), x


def test_sinkhorn_balances_a_skewed_router():
    plain, x = _skewed_router("none")
    sinkhorn, _ = _skewed_router("sinkhorn")
    plain_counts = _counts(plain(x).expert_ids_TK).float()
    sinkhorn_counts = _counts(sinkhorn.train()(x).expert_ids_TK).float()
    plain_imbalance = (plain_counts.max() / plain_counts.mean()).item()
    sinkhorn_imbalance = (sinkhorn_counts.max() / sinkhorn_counts.mean()).item()
    assert plain_imbalance > 3.0  # expert 0 takes every token
    assert sinkhorn_imbalance < 1.5
    assert sinkhorn_counts.sum() == plain_counts.sum() == 256 * K


def test_sinkhorn_selection_and_weights():
    router = _router("sinkhorn", sinkhorn_iterations=30).train()
    x = _x()
    routing = router(x)
    logits = x @ _weight().t()
    expected_ids = torch.topk(sinkhorn_log(logits, 30), K, dim=-1).indices
    assert torch.equal(routing.expert_ids_TK, expected_ids)
    # Combine weights: softmax of the raw logits at the chosen ids, renormalised.
    w = torch.softmax(logits, -1).gather(1, expected_ids)
    assert torch.allclose(routing.weights_TK, w / w.sum(-1, keepdim=True), rtol=1e-6)
    # The choice really differs from plain top-k somewhere, else this test proves nothing.
    assert not torch.equal(routing.expert_ids_TK, torch.topk(logits, K, -1).indices)


def test_sinkhorn_weights_carry_gradient_to_router():
    router = _router("sinkhorn").train()
    x = _x()
    upstream = torch.randn(x.shape[0], K, generator=torch.Generator().manual_seed(5))
    routing = router(x)
    (routing.weights_TK * upstream).sum().backward()
    # By hand: the selection is a constant; the weights are differentiable softmax values.
    w = _weight().requires_grad_(True)
    chosen = routing.expert_ids_TK
    picked = torch.softmax(x @ w.t(), -1).gather(1, chosen)
    ((picked / picked.sum(-1, keepdim=True)) * upstream).sum().backward()
    assert w.grad.norm() > 0
    assert rel_err(router.weight.grad, w.grad) < 1e-5


def test_sinkhorn_in_eval_equals_none():
    x = _x()
    sinkhorn = _router("sinkhorn").eval()(x)
    plain = _router("none").eval()(x)
    assert torch.equal(sinkhorn.expert_ids_TK, plain.expert_ids_TK)
    assert torch.equal(sinkhorn.weights_TK, plain.weights_TK)


# ---------------------------------------------------------------- balanced (aux-loss-free)


def test_balanced_selects_with_bias_weights_without():
    router = _router("balanced")
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, -1.0, 0.0, 0.0])
    router.expert_bias.copy_(bias)
    x = _x()
    routing = router(x)
    probs = torch.softmax(x @ _weight().t(), -1)
    expected_ids = torch.topk(probs + bias, K, dim=-1).indices
    assert torch.equal(routing.expert_ids_TK, expected_ids)
    assert (routing.expert_ids_TK == 3).any(dim=1).all()  # +1 beats any probability
    assert not (routing.expert_ids_TK == 5).any()
    w = probs.gather(1, expected_ids)
    assert torch.allclose(routing.weights_TK, w / w.sum(-1, keepdim=True), rtol=1e-6)
    # The bias is also used in eval: it is part of the trained model.
    assert torch.equal(router.eval()(x).expert_ids_TK, expected_ids)


def test_balanced_zero_bias_is_plain_topk():
    x = _x()
    assert torch.equal(_router("balanced")(x).expert_ids_TK, _router("none")(x).expert_ids_TK)


def test_record_load_and_update_bias():
    router = _router("balanced")
    router.record_load(torch.tensor([10, 0, 3, 3, 1, 7, 4, 4]))
    router.record_load(torch.tensor([2, 0, 1, 1, 1, 1, 4, 6]))
    load = torch.tensor([12.0, 0.0, 4.0, 4.0, 2.0, 8.0, 8.0, 10.0])  # mean 6.0, none equal to it
    assert torch.equal(router.pending_load, load)
    rate = 0.25
    router.update_bias(rate)
    expected = torch.tensor([-rate, rate, rate, rate, rate, -rate, -rate, -rate])
    assert torch.equal(router.expert_bias, expected)
    assert torch.count_nonzero(router.pending_load) == 0

    # An expert exactly at the mean does not move; an explicit load overrides the pending one.
    router.record_load(torch.tensor([100, 0, 0, 0, 0, 0, 0, 0]))
    router.update_bias(0.5, load_E=torch.tensor([1, 1, 1, 1, 2, 2, 2, 2]))
    assert torch.equal(router.expert_bias, expected + torch.tensor([0.5] * 4 + [-0.5] * 4))
    assert torch.count_nonzero(router.pending_load) == 0


def test_update_bias_without_load_keeps_bias():
    router = _router("balanced")
    router.update_bias(0.1)
    assert torch.count_nonzero(router.expert_bias) == 0


@pytest.mark.parametrize("mode", ["none", "aux_loss", "sinkhorn"])
def test_bias_methods_are_noops_outside_balanced(mode):
    router = _router(mode)
    router.record_load(torch.ones(E))
    router.update_bias(0.1)
    assert not hasattr(router, "expert_bias")
    assert list(router.state_dict()) == ["weight"]


def test_balanced_state_stays_exact_after_bf16_cast():
    router = _router("balanced").to(torch.bfloat16)
    router.record_load(torch.tensor([301, 1, 1, 1, 1, 1, 1, 1]))
    assert torch.equal(router.pending_load.double(), torch.tensor([301.0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.float64))
    router.pending_load.zero_()
    router.expert_bias.fill_(0.5)
    router.record_load(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]))  # mean 4.5
    router.update_bias(0.001)
    expected = torch.tensor([0.501] * 4 + [0.499] * 4, dtype=torch.float64)
    assert torch.allclose(router.expert_bias.double(), expected, rtol=0, atol=1e-6)


def _moe_layer(mode: str, *, jitter: float = 0.0, seed: int = 12345) -> MoELayer:
    g = torch.Generator().manual_seed(0)
    gate = TopKRouter(nn.Parameter(_weight()), top_k=K, mode=mode)
    experts = GroupedExperts(
        nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.1),
        nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1),
        F.silu,
    )
    return MoELayer(gate, experts, MoEConfig(moe_load_balancing=mode, random_seed=seed), jitter_noise=jitter)


def test_layer_records_load_in_training_only():
    layer = _moe_layer("balanced")
    x = _x(48)
    layer(x)
    first = layer.tokens_per_expert.clone()
    assert torch.equal(layer.gate.pending_load, first.float())
    assert first.sum() == 48 * K
    layer(x)
    assert torch.equal(layer.gate.pending_load, 2 * first.float())
    layer.eval()(x)
    assert torch.equal(layer.gate.pending_load, 2 * first.float())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_does_not_count_load(use_reentrant):
    layer = _moe_layer("balanced")
    x = _x(48).reshape(2, 24, H).requires_grad_(True)
    out = checkpoint(layer, x, use_reentrant=use_reentrant)
    out.square().sum().backward()
    assert layer.gate.weight.grad is not None  # the recompute really ran
    assert layer.tokens_per_expert.sum() == 48 * K
    assert torch.equal(layer.gate.pending_load, layer.tokens_per_expert.float())


def test_expert_bias_in_state_dict_only_for_balanced():
    for mode in ("sinkhorn", "aux_loss", "none", "balanced"):
        model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing=mode))
        keys = set(model.state_dict())
        bias_keys = {k for k in keys if k.endswith("expert_bias")}
        if mode == "balanced":
            assert bias_keys == {f"model.layers.{i}.mlp.gate.expert_bias" for i in range(2)}
        else:
            assert not bias_keys
        assert not any("pending_load" in k for k in keys)


# ---------------------------------------------------------------- router jitter


def _jitter_model(seed: int = 12345):
    reference = tiny_mixtral(router_jitter_noise=0.1)
    return lightning_ep.transform(reference, MoEConfig(moe_load_balancing="none", random_seed=seed))


def test_jitter_is_read_from_hf_config():
    assert [layer.jitter_noise for layer in lightning_ep.moe_layers(_jitter_model())] == [0.1, 0.1]
    assert [layer.jitter_noise for layer in lightning_ep.moe_layers(lightning_ep.transform(tiny_mixtral()))] == [
        0.0,
        0.0,
    ]


def test_jitter_changes_training_output_only():
    model = _jitter_model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    train_logits = model.train()(ids).logits
    eval_logits = model.eval()(ids).logits
    assert rel_err(train_logits, eval_logits) > 1e-4
    # Eval has no jitter: equals the untouched HF model in eval.
    reference = tiny_mixtral(router_jitter_noise=0.1).eval()
    assert rel_err(eval_logits, reference(ids).logits) < 1e-5


def test_jitter_is_seeded_by_random_seed_and_leaves_global_rng_alone():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b, c = _jitter_model(seed=7), _jitter_model(seed=7), _jitter_model(seed=8)
    torch.manual_seed(999)
    rng_before = torch.random.get_rng_state()
    out_a, out_b, out_c = a(ids).logits, b(ids).logits, c(ids).logits
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.equal(out_a, out_b)
    assert rel_err(out_c, out_a) > 1e-4
    # Successive training forwards draw fresh noise, again reproducibly.
    second_a, second_b = a(ids).logits, b(ids).logits
    assert torch.equal(second_a, second_b)
    assert rel_err(second_a, out_a) > 1e-4


def _layer_grads(layer: MoELayer, x: torch.Tensor, use_checkpoint: bool | None) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = layer(x) if use_checkpoint is None else checkpoint(layer, x, use_reentrant=use_checkpoint)
    out.square().sum().backward()
    return [x.grad, *(p.grad for p in layer.parameters())]


def test_jitter_replayed_by_nonreentrant_checkpoint():
    x = _x(48).reshape(2, 24, H)
    plain = _layer_grads(_moe_layer("none", jitter=0.1), x, None)
    checkpointed = _layer_grads(_moe_layer("none", jitter=0.1), x, False)
    for got, want in zip(checkpointed, plain, strict=True):
        assert rel_err(got, want) < 1e-6


def test_jitter_replayed_by_reentrant_checkpoint():
    x = _x(48).reshape(2, 24, H)
    plain = _layer_grads(_moe_layer("none", jitter=0.1), x, None)
    checkpointed = _layer_grads(_moe_layer("none", jitter=0.1), x, True)
    for got, want in zip(checkpointed, plain, strict=True):
        assert rel_err(got, want) < 1e-6


def test_hf_gradient_checkpointing_keeps_jitter_gradients():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = _jitter_model()
    ckpt = copy.deepcopy(plain)
    enable_checkpointing(ckpt, True)
    # A pre-hook, since checkpointing's early stop may end a recompute before forward hooks run.
    calls = []
    for layer in lightning_ep.moe_layers(ckpt):
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    plain(input_ids=ids, labels=ids).loss.backward()
    ckpt(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 4  # two MoE layers, each run once and recomputed once
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert rel_err(q.grad, p.grad) < 1e-6, name


def test_balanced_router_materializes_from_meta():
    from lightning_ep.moe.routing.router import TopKRouter

    with torch.device("meta"):
        router = TopKRouter(torch.nn.Parameter(torch.empty(8, 64)), top_k=2, mode="balanced")
    router.to_empty(device="cpu")
    assert router.expert_bias.device.type == "cpu" and router.expert_bias.dtype == torch.float32
    assert router.pending_load.device.type == "cpu" and router.pending_load.dtype == torch.float32
