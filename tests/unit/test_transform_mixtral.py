"""``lightning_ep.transform`` on a tiny Hugging Face Mixtral, against the untouched HF model.

The reference is always the HF model itself (``copy.deepcopy`` before transforming), run on the
same input; router losses are recomputed by hand, per layer, from the HF router logits.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, tiny_mixtral
from safetensors.torch import load_file
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig, MoELayer

NUM_EXPERTS, TOP_K = 8, 2


def _tokens(seed: int = 1, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def _transformed(model: nn.Module, **config) -> nn.Module:
    return lightning_ep.transform(copy.deepcopy(model), MoEConfig(**config))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad
    return grads


def _capture_router_logits(model: nn.Module) -> tuple[list[torch.Tensor], list]:
    """Forward hooks on every HF ``MixtralTopKRouter`` (``mlp.gate``); its output[0] is the logits."""
    logits: list[torch.Tensor] = []
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0])) for layer in model.model.layers
    ]
    return logits, handles


def _hand_load_balancing(logits_TE: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's load-balancing loss of one layer: E * sum_e f_e * P_e, f_e the fraction of the
    T * K (token, expert) pairs routed to e."""
    probs = torch.softmax(logits_TE.float(), dim=-1)
    ids = torch.topk(probs, TOP_K, dim=-1).indices
    fraction = F.one_hot(ids, NUM_EXPERTS).sum(dim=(0, 1)).float() / (logits_TE.shape[0] * TOP_K)
    return NUM_EXPERTS * (fraction * probs.mean(dim=0)).sum()


def _hand_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.exp(logits_TE.float()).sum(dim=-1)).square().mean()


@pytest.mark.parametrize("mode", ["none", "aux_loss"])
@pytest.mark.parametrize("train", [True, False])
def test_logits_match_hf(mode, train):
    reference = tiny_mixtral()
    model = _transformed(reference, moe_load_balancing=mode)
    reference.train(train)
    model.train(train)
    ids = _tokens()
    assert rel_err(model(ids).logits, reference(ids).logits) < 1e-5


@pytest.mark.parametrize("mode", ["sinkhorn", "balanced"])
def test_other_modes_match_hf_where_routing_is_plain_topk(mode):
    # sinkhorn routes like top-k in eval; "balanced" with its initial zero bias is plain top-k.
    reference = tiny_mixtral().eval()
    model = _transformed(reference, moe_load_balancing=mode).eval()
    ids = _tokens()
    assert rel_err(model(ids).logits, reference(ids).logits) < 1e-5


@pytest.mark.parametrize("mode", ["none", "aux_loss"])
def test_gradients_match_hf_without_router_losses(mode):
    reference = tiny_mixtral()
    model = _transformed(reference, moe_load_balancing=mode, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    ids = _tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name


@pytest.mark.parametrize(("aux_coeff", "z_coeff"), [(0.1, 0.01), (0.1, 0.0), (0.0, 0.01)])
def test_gradients_include_per_layer_router_losses(aux_coeff, z_coeff):
    reference = tiny_mixtral()
    model = _transformed(
        reference, moe_load_balancing="aux_loss", moe_aux_loss_coeff=aux_coeff, moe_z_loss_coeff=z_coeff
    )
    ids = _tokens()
    # The transformed model: only the LM loss; its layers attach their losses themselves.
    lm_loss = model(input_ids=ids, labels=ids).loss
    lm_loss.backward()

    # The reference: LM loss + sum over layers of the weighted losses, computed by hand per layer.
    logits, handles = _capture_router_logits(reference)
    ref_lm_loss = reference(input_ids=ids, labels=ids).loss
    for h in handles:
        h.remove()
    assert len(logits) == 2
    router_loss = sum(aux_coeff * _hand_load_balancing(lg) + z_coeff * _hand_z_loss(lg) for lg in logits)
    (ref_lm_loss + router_loss).backward()

    assert rel_err(lm_loss, ref_lm_loss) < 1e-6  # the LM loss itself is not changed
    got, want = _grads(model), _grads(reference)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name
    # The router losses really moved the router gradient (the comparison is not vacuous).
    plain = tiny_mixtral()
    plain(input_ids=ids, labels=ids).loss.backward()
    gate = "model.layers.0.mlp.gate.weight"
    assert rel_err(plain.get_parameter(gate).grad, want[gate]) > 1e-3


def test_parameters_are_the_same_objects():
    model = tiny_mixtral()
    before = {name: id(p) for name, p in model.named_parameters()}
    kept = [p for _, p in model.named_parameters()]  # keep them alive so ids cannot be reused
    lightning_ep.transform(model, MoEConfig())
    after = {name: id(p) for name, p in model.named_parameters()}
    assert after == before
    assert len(kept) == len(before)
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.model.layers)


@pytest.mark.parametrize("mode", ["sinkhorn", "aux_loss", "none"])
def test_state_dict_unchanged(mode):
    model = tiny_mixtral()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lightning_ep.transform(model, MoEConfig(moe_load_balancing=mode))
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].shape == value.shape, key
        assert after[key].dtype == value.dtype, key
        assert torch.equal(after[key], value), key


def test_smp_moe_false_leaves_model_untouched():
    model = tiny_mixtral()
    modules_before = [(name, id(m)) for name, m in model.named_modules()]
    out = lightning_ep.transform(model, MoEConfig(smp_moe=False))
    assert out is model
    assert [(name, id(m)) for name, m in model.named_modules()] == modules_before
    assert not lightning_ep.moe_layers(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_transform_returns_the_model_itself():
    model = tiny_mixtral()
    assert lightning_ep.transform(model, MoEConfig()) is model
    assert len(lightning_ep.moe_layers(model)) == 2


def test_unsupported_family_lists_supported():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    expected = (
        "transform(model): model_type='llama' (LlamaForCausalLM) is not a supported MoE family; supported: "
        "['deepseek_v3', 'glm4_moe', 'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe']."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        lightning_ep.transform(llama, MoEConfig())
    with pytest.raises(ValueError, match=re.escape("MoEConfig(smp_moe=False)")):
        lightning_ep.transform(llama, MoEConfig())


def test_module_without_config_is_refused():
    with pytest.raises(ValueError, match=re.escape("model_type=None (Linear) is not a supported MoE family")):
        lightning_ep.transform(nn.Linear(4, 4), MoEConfig())


def test_mixtral_without_moe_blocks_is_refused():
    model = tiny_mixtral()
    for layer in model.model.layers:
        layer.mlp = nn.Identity()
    expected = (
        "transform(model): found no MixtralSparseMoeBlock in MixtralForCausalLM; "
        "supported families: ['deepseek_v3', 'glm4_moe', 'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe']. "
        "Is every layer dense?"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        lightning_ep.transform(model, MoEConfig())


def test_config_must_be_moe_config():
    with pytest.raises(TypeError, match=re.escape("transform(config=...) must be a MoEConfig, got dict.")):
        lightning_ep.transform(tiny_mixtral(), {"moe_load_balancing": "none"})  # type: ignore[arg-type]


def test_default_config_is_moe_config_default():
    model = lightning_ep.transform(tiny_mixtral())
    layers = lightning_ep.moe_layers(model)
    assert [layer.config for layer in layers] == [MoEConfig()] * 2
    assert [layer.gate.mode for layer in layers] == ["sinkhorn"] * 2
    assert [layer.layer_index for layer in layers] == [0, 1]


def test_save_pretrained_round_trip(tmp_path):
    from transformers import MixtralForCausalLM

    reference = tiny_mixtral()
    model = _transformed(reference, moe_load_balancing="aux_loss")
    model.save_pretrained(tmp_path / "transformed")
    reference.save_pretrained(tmp_path / "reference")

    # On disk, the very same tensors under the very same keys as the untouched model writes.
    saved = load_file(tmp_path / "transformed" / "model.safetensors")
    expected = load_file(tmp_path / "reference" / "model.safetensors")
    assert saved.keys() == expected.keys()
    for key in expected:
        assert torch.equal(saved[key], expected[key]), key

    reloaded = MixtralForCausalLM.from_pretrained(tmp_path / "transformed").eval()
    ids = _tokens()
    model.eval()
    assert rel_err(reloaded(ids).logits, model(ids).logits) < 1e-6
    assert type(reloaded.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_transform_after_from_pretrained(tmp_path):
    from transformers import MixtralForCausalLM

    reference = tiny_mixtral().eval()
    reference.save_pretrained(tmp_path)
    model = lightning_ep.transform(MixtralForCausalLM.from_pretrained(tmp_path), MoEConfig(moe_load_balancing="none"))
    assert len(lightning_ep.moe_layers(model)) == 2
    model.eval()
    ids = _tokens()
    assert rel_err(model(ids).logits, reference(ids).logits) < 1e-5


def test_transform_keeps_eval_mode():
    reference = tiny_mixtral().eval()
    model = lightning_ep.transform(copy.deepcopy(reference), MoEConfig())  # default: sinkhorn
    assert [layer.training for layer in lightning_ep.moe_layers(model)] == [False, False]
    # In eval, sinkhorn routes by plain top-k: the logits equal HF's without calling .eval() again.
    ids = _tokens()
    assert rel_err(model(ids).logits, reference(ids).logits) < 1e-5


def test_transform_twice_is_idempotent(recwarn):
    model = tiny_mixtral(output_router_logits=True)
    with pytest.warns(UserWarning):
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"))
    layers = lightning_ep.moe_layers(model)
    params = {name: id(p) for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _tokens()
    model.eval()
    logits = model(ids).logits

    recwarn.clear()
    assert lightning_ep.transform(model, MoEConfig(moe_load_balancing="none")) is model
    assert not [w for w in recwarn if "output_router_logits" in str(w.message)]
    assert all(a is b for a, b in zip(lightning_ep.moe_layers(model), layers, strict=True))
    assert {name: id(p) for name, p in model.named_parameters()} == params
    assert model.state_dict().keys() == state.keys()
    assert torch.equal(model(ids).logits, logits)
