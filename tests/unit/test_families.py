"""Every supported Hugging Face MoE family against its untouched model, on one process.

For each family (``tests/distributed/families_workers.py`` builds the tiny models): logits and
every parameter gradient of the transformed model equal the untouched model's (fp32, 1e-5);
state-dict keys, order and tensors are unchanged; dense layers interleaved with the MoE layers
stay; ``save_pretrained`` then ``from_pretrained`` (and ``load_pretrained_sharded``) give the same
model back. Then each router variant against the Hugging Face router it replaces, GPT-OSS's
experts against ``GptOssExperts``, DeepSeek-V3's ``"balanced"`` bias, and the refusals.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig, MoELayer
from lightning_ep.models.registry import FAMILIES, MoEFamily, family_for, find_moe_blocks, supported_model_types
from lightning_ep.moe import TopKRouter
from lightning_ep.moe.experts.variants import InterleavedGLUExperts
from lightning_ep.parallel.balance import update_expert_biases

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import (
    BLOCKS,
    CONFIG,
    FAMILY_NAMES,
    family_config,
    micro_batch,
    rel_err,
    tiny_family,
)

SUPPORTED = ["deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]
H, E, K, T = 64, 8, 2, 48


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad
    return grads


def _combine_matrix(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` with each token's combine weight at its chosen experts: independent of the order of K."""
    return torch.zeros(ids_TK.shape[0], E, dtype=weights_TK.dtype).scatter(1, ids_TK, weights_TK)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the table


def test_supported_model_types():
    assert supported_model_types() == SUPPORTED
    assert FAMILIES["glm4_moe"] is FAMILIES["deepseek_v3"]


def test_router_must_be_a_child_of_the_block():
    with pytest.raises(ValueError, match=re.escape("MoEFamily(router_weight='mlp.gate.weight'): the router must")):
        MoEFamily(name="x", model_types=("x",), block_classes=("X",), router_weight="mlp.gate.weight")


def test_missing_config_field_or_attribute_is_named():
    from dataclasses import replace

    qwen3 = tiny_family("qwen3_moe")
    family = replace(family_for(qwen3), top_k="experts_per_token")
    with pytest.raises(ValueError, match=re.escape("Qwen3MoeConfig has no field 'experts_per_token', which this")):
        family.build_layer(qwen3.model.layers[0].mlp, qwen3.config, CONFIG, 0)
    gpt_oss = tiny_family("gpt_oss")
    family = replace(family_for(gpt_oss), swiglu_limit="experts.swiglu_limit")
    with pytest.raises(ValueError, match=re.escape("GptOssExperts has no attribute 'swiglu_limit', which this")):
        family.build_layer(gpt_oss.model.layers[0].mlp, gpt_oss.config, CONFIG, 0)


# ---------------------------------------------------------------- whole models vs untouched


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_transformed_matches_hf(model_type):
    reference = tiny_family(model_type)
    model = copy.deepcopy(reference)
    params_before = {name: id(p) for name, p in model.named_parameters()}
    kept = list(model.parameters())  # keep them alive so ids cannot be reused
    lightning_ep.transform(model, CONFIG)

    _, num_blocks, dense_class = BLOCKS[model_type]
    layers = lightning_ep.moe_layers(model)
    assert len(layers) == num_blocks and not find_moe_blocks(model, FAMILIES[model_type])
    dense = [type(layer.mlp).__name__ for layer in model.model.layers if not isinstance(layer.mlp, MoELayer)]
    assert dense == [dense_class] * (len(model.model.layers) - num_blocks)
    assert {name: id(p) for name, p in model.named_parameters()} == params_before and kept
    assert list(model.state_dict()) == list(reference.state_dict())  # same keys, same order

    ids = micro_batch(0, 0)
    out = model(input_ids=ids, labels=ids)
    ref_out = reference(input_ids=ids, labels=ids)
    assert rel_err(out.logits, ref_out.logits) < 1e-5
    out.loss.backward()
    ref_out.loss.backward()
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, reference(input_ids=ids).logits) < 1e-5


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_save_pretrained_round_trip_and_sharded_loader(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_ep.models.hf_io import load_pretrained_sharded

    reference = tiny_family(model_type).eval()
    model = lightning_ep.transform(copy.deepcopy(reference), CONFIG)
    model.save_pretrained(tmp_path / "transformed")
    reference.save_pretrained(tmp_path / "reference")
    saved = load_file(tmp_path / "transformed" / "model.safetensors")
    expected = load_file(tmp_path / "reference" / "model.safetensors")
    assert saved.keys() == expected.keys()
    for key in expected:
        assert torch.equal(saved[key], expected[key]), key

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "transformed").eval()
    assert type(reloaded.model.layers[-1].mlp).__name__ == BLOCKS[model_type][0]
    ids = micro_batch(0, 0)
    with torch.no_grad():
        assert rel_err(reloaded(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-6

    # The library's own reader, through transformers' conversion rules, into another transformed model.
    other = lightning_ep.transform(tiny_family(model_type, seed=1), CONFIG)
    load_pretrained_sharded(other, tmp_path / "transformed")
    state = reference.state_dict()
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_dense_layers_stay_with_decoder_sparse_step():
    from transformers import AutoModelForCausalLM

    # Layers (i + 1) % 2 == 0 are sparse, and layer 3 is dense by mlp_only_layers.
    config = family_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    model = lightning_ep.transform(AutoModelForCausalLM.from_config(config), CONFIG)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["Qwen3MoeMLP", "MoELayer", "Qwen3MoeMLP", "Qwen3MoeMLP"]


def test_children_keep_hf_names():
    qwen2 = lightning_ep.transform(tiny_family("qwen2_moe"), CONFIG).model.layers[0].mlp
    assert [name for name, _ in qwen2.named_children()] == ["gate", "experts", "shared_expert", "shared_expert_gate"]
    gpt_oss = lightning_ep.transform(tiny_family("gpt_oss"), CONFIG).model.layers[0].mlp
    assert [name for name, _ in gpt_oss.named_children()] == ["router", "experts"]
    assert gpt_oss.gate is gpt_oss.router and isinstance(gpt_oss.gate, TopKRouter)
    assert isinstance(gpt_oss.experts, InterleavedGLUExperts)
    out, scores = gpt_oss(torch.randn(2, 3, H))  # GptOssDecoderLayer unpacks a pair
    assert out.shape == (2, 3, H) and scores is None
    deepseek = lightning_ep.transform(tiny_family("deepseek_v3"), CONFIG).model.layers[1].mlp
    assert [name for name, _ in deepseek.named_children()] == ["experts", "gate", "shared_experts"]


def test_shared_expert_output_is_added_gated():
    layer = lightning_ep.transform(tiny_family("qwen2_moe"), CONFIG).model.layers[0].mlp
    x = torch.randn(1, 5, H)
    with torch.no_grad():
        full = layer(x)
        shared = torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)
        layer.shared_expert.down_proj.weight.zero_()  # shared output 0: the routed experts alone
        routed = layer(x)
    assert torch.allclose(full, routed + shared, atol=1e-6)
    assert rel_err(shared, full) > 1e-2  # the shared expert matters here


def test_shared_gate_needs_shared_experts():
    layer = lightning_ep.transform(tiny_family("qwen3_moe"), CONFIG).model.layers[0].mlp
    with pytest.raises(ValueError, match=re.escape("MoELayer(shared_experts_gate=...) needs shared_experts")):
        MoELayer(layer.gate, layer.experts, CONFIG, shared_experts_gate=nn.Linear(H, 1))


# ---------------------------------------------------------------- routers vs Hugging Face's


def _hf_router(model_type: str, module_name: str, **overrides):
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(3)
    router = getattr(module, module_name)(family_config(model_type, **overrides))
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        for name in ("bias", "e_score_correction_bias"):
            if getattr(router, name, None) is not None:
                getattr(router, name).normal_(0.0, 0.05)
    return router


def _check_router(hf, router: TopKRouter, x: torch.Tensor) -> None:
    hf_logits, hf_weights, hf_ids = hf(x)
    routing = router(x)
    assert torch.allclose(routing.logits_TE, hf_logits, rtol=1e-6, atol=1e-7)
    assert torch.equal(routing.expert_ids_TK.sort(-1).values, hf_ids.sort(-1).values)
    assert torch.allclose(
        _combine_matrix(routing.expert_ids_TK, routing.weights_TK), _combine_matrix(hf_ids, hf_weights), atol=1e-7
    )


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("mode", ["none", "aux_loss"])
def test_softmax_router_matches_qwen2_moe(norm, mode):
    hf = _hf_router("qwen2_moe", "Qwen2MoeTopKRouter", norm_topk_prob=norm)
    router = TopKRouter(hf.weight, top_k=K, mode=mode, normalize_weights=norm)
    _check_router(hf, router, _x())
    assert torch.allclose(router(_x()).probs_TE.sum(-1), torch.ones(T))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (2, 1), (4, 2)])
def test_sigmoid_grouped_router_matches_deepseek(model_type, norm, n_group, topk_group):
    module_name = "DeepseekV3TopkRouter" if model_type == "deepseek_v3" else "Glm4MoeTopkRouter"
    hf = _hf_router(model_type, module_name, norm_topk_prob=norm, n_group=n_group, topk_group=topk_group)
    router = TopKRouter(
        hf.weight,
        top_k=K,
        mode="none",
        normalize_weights=norm,
        scoring="sigmoid",
        e_score_correction_bias=hf.e_score_correction_bias,
        n_group=n_group,
        topk_group=topk_group,
        scaling_factor=hf.routed_scaling_factor,
    )
    x = _x()
    _check_router(hf, router, x)
    routing = router(x)
    # The correction bias picks experts but never weighs them; probs are the normalised scores.
    scores = torch.sigmoid(routing.logits_TE)
    assert torch.allclose(routing.probs_TE, scores / scores.sum(-1, keepdim=True))
    with torch.no_grad():
        hf.e_score_correction_bias.zero_()
    assert not torch.equal(router(x).expert_ids_TK.sort(-1).values, routing.expert_ids_TK.sort(-1).values)


def test_topk_softmax_router_matches_gpt_oss():
    hf = _hf_router("gpt_oss", "GptOssTopKRouter")
    router = TopKRouter(hf.weight, top_k=K, mode="none", normalize_weights=False, scoring="topk_softmax", bias=hf.bias)
    _check_router(hf, router, _x())
    assert list(router.state_dict()) == ["weight", "bias"]


def test_group_limited_sinkhorn_selects_within_groups():
    router = TopKRouter(
        nn.Parameter(torch.randn(E, H) * 0.3), top_k=K, mode="sinkhorn", scoring="sigmoid", n_group=4, topk_group=1
    )
    ids = router(_x()).expert_ids_TK
    assert torch.equal(ids[:, 0] // 2, ids[:, 1] // 2)  # both in the one kept group of 2 experts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(scoring="softmax_first"), "TopKRouter(scoring='softmax_first') is not one of"),
        (dict(n_group=3), "TopKRouter(n_group=3) must divide the number of experts (8); choose one of [1, 2, 4, 8]."),
        (dict(n_group=2, topk_group=3), "TopKRouter(topk_group=3) must be between 1 and n_group=2."),
        (dict(n_group=8, topk_group=1), "TopKRouter(top_k=2) exceeds the 1 experts of the topk_group=1 groups kept"),
        (dict(bias=nn.Parameter(torch.zeros(4))), "TopKRouter(bias=...) has shape [4]; it needs one value per expert"),
        (
            dict(e_score_correction_bias=torch.zeros(8, 1)),
            "TopKRouter(e_score_correction_bias=...) has shape [8, 1]; it needs one value per expert: [8].",
        ),
    ],
)
def test_router_refusals(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TopKRouter(nn.Parameter(torch.zeros(E, H)), top_k=K, mode="none", **kwargs)


# ---------------------------------------------------------------- GPT-OSS experts vs Hugging Face's


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_interleaved_experts_match_gpt_oss(use_grouped_mm):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    hf = GptOssExperts(family_config("gpt_oss"))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)  # large enough that both clamps bind
    ours = InterleavedGLUExperts(
        hf.gate_up_proj,
        hf.gate_up_proj_bias,
        hf.down_proj,
        hf.down_proj_bias,
        alpha=hf.alpha,
        limit=hf.limit,
        use_grouped_mm=use_grouped_mm,
    )
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, E - 1, (T, K), generator=torch.Generator().manual_seed(3))  # expert 7 gets no row
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(4))
    h = torch.einsum("th,the->te", x.repeat_interleave(K, 0), hf.gate_up_proj[ids.flatten()])
    assert h.abs().max() > hf.limit  # the clamps are exercised

    want = hf(x, ids, weights)
    grads_want = torch.autograd.grad(want.square().sum(), list(hf.parameters()))
    # Ours on rows sorted by expert, then weighted and summed back per token.
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=E)
    y = ours(x.repeat_interleave(K, 0)[order], counts)
    got = torch.zeros_like(x).index_add(0, order // K, y * weights.flatten()[order, None])
    assert rel_err(got, want) < 1e-5
    grads_got = torch.autograd.grad(got.square().sum(), list(ours.parameters()))
    for name, g_got, g_want in zip([n for n, _ in ours.named_parameters()], grads_got, grads_want, strict=True):
        assert rel_err(g_got, g_want) < 1e-5, name
        assert torch.all(g_got[E - 1] == 0), name  # an expert without rows: a zero gradient, not none


def test_interleaved_experts_scale_grads_and_check_shapes():
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(*s, generator=g)) for s in [(E, H, 32), (E, 32), (E, 16, H), (E, H)]]
    experts = InterleavedGLUExperts(*params, alpha=1.702, limit=7.0)
    x, counts, w = torch.randn(16, H, generator=g), torch.full((E,), 2), torch.randn(16, H, generator=g)
    (experts(x, counts) * w).sum().backward()
    plain = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    experts.grad_scale = 0.25
    (experts(x, counts) * w).sum().backward()
    for p, want in zip(params, plain, strict=True):
        assert torch.allclose(p.grad, want * 0.25)
    with pytest.raises(ValueError, match=re.escape("gate_up_proj (8, 64, 32) needs down_proj (8, 16, 64), got")):
        InterleavedGLUExperts(params[0], params[1], nn.Parameter(torch.zeros(E, 32, H)), params[3], alpha=1, limit=7)
    with pytest.raises(RuntimeError, match=re.escape("got token counts for 4 experts, but 8 are held here.")):
        experts(x, torch.full((4,), 4))


# ---------------------------------------------------------------- DeepSeek-V3's "balanced" bias


def test_deepseek_balanced_updates_the_hf_correction_bias():
    reference = tiny_family("deepseek_v3")
    model = copy.deepcopy(reference)
    hf_biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]]
    lightning_ep.transform(model, MoEConfig(moe_load_balancing="balanced", moe_z_loss_coeff=0.0))
    assert list(model.state_dict()) == list(reference.state_dict())  # no expert_bias: HF's bias is it
    layers = lightning_ep.moe_layers(model)
    assert [layer.gate.e_score_correction_bias for layer in layers] == hf_biases  # the same tensors
    assert all(layer.gate.selection_bias is bias for layer, bias in zip(layers, hf_biases, strict=True))

    # With the bias the model came with, "balanced" routes exactly as the model does.
    ids = micro_batch(0, 0)
    assert rel_err(model(input_ids=ids).logits, reference(input_ids=ids).logits) < 1e-5
    before = [bias.clone() for bias in hf_biases]
    load = layers[0].gate.pending_load.clone()
    assert load.sum() == 2 * 16 * K
    update_expert_biases(model)
    step = torch.sign(load.mean() - load) * layers[0].config.balance_update_rate
    assert torch.allclose(layers[0].gate.e_score_correction_bias, before[0] + step)
    assert all(not torch.equal(bias, old) for bias, old in zip(hf_biases, before, strict=True))

    # Never rounded by a dtype cast: the bias steps are 1e-3.
    model.to(torch.bfloat16)
    assert all(layer.gate.e_score_correction_bias.dtype == torch.float32 for layer in layers)


def test_deepseek_bias_is_frozen_outside_balanced():
    model = lightning_ep.transform(tiny_family("deepseek_v3"), CONFIG)
    gate = lightning_ep.moe_layers(model)[0].gate
    before = gate.e_score_correction_bias.clone()
    ids = micro_batch(0, 0)
    model(input_ids=ids)
    update_expert_biases(model)
    gate.update_bias(0.1, torch.arange(E, dtype=torch.float32))
    assert torch.equal(gate.e_score_correction_bias, before)
    assert not hasattr(gate, "expert_bias")


def test_meta_init_of_new_layouts():
    from transformers import AutoModelForCausalLM

    from lightning_ep.models.init import materialize

    for model_type in ("gpt_oss", "deepseek_v3"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(family_config(model_type))
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="balanced"))
        torch.manual_seed(0)
        materialize(model, "cpu")
        for layer in lightning_ep.moe_layers(model):
            assert torch.all(layer.gate.selection_bias == 0), model_type
            assert torch.all(layer.gate.pending_load == 0), model_type
            assert 0.01 < float(layer.gate.weight.detach().std()) < 0.03, model_type
            for name, p in layer.experts.named_parameters():
                if name.endswith("_bias"):
                    assert torch.all(p == 0), (model_type, name)
                else:
                    assert 0.015 < float(p.detach().std()) < 0.025, (model_type, name)
            if layer.gate.bias is not None:
                assert 0.0 < float(layer.gate.bias.detach().std()) < 0.05
