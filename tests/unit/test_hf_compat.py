"""What a transformed model keeps of Hugging Face's behaviour (``lightning_ep.models.hf_compat``):
router logits and transformers' own aux loss, weight init, the experts-implementation switch,
``torch.compile(fullgraph=True)``, the refusal of transformers' own expert parallelism, and the
switch the strategy's ``activation_checkpointing`` turns on.
Each against the untouched Hugging Face model.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from conftest import rel_err, tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.models.hf_compat import EXPERTS_IMPLEMENTATION
from lightning_ep.strategy.arguments import enable_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import tiny_family

NONE = MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0, moe_aux_loss_coeff=0.0)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"]


def _padded() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------- router logits


@pytest.mark.parametrize("mode", ["none", "sinkhorn"])
def test_router_logits_and_hf_aux_loss_come_back(mode: str) -> None:
    """``output_router_logits=True``: ``MixtralForCausalLM`` returns each layer's ``[B * S, E]`` logits and
    transformers' own (masked) ``aux_loss`` as the untouched model does, and that loss's gradient
    reaches the routers; ``MixtralModel`` returns the logits too."""
    reference = tiny_mixtral(output_router_logits=True)
    with pytest.warns(UserWarning, match="transformers adds its own load-balancing loss"):
        # No loss of ours: transformers' aux loss alone reaches the gradients below.
        config = MoEConfig(moe_load_balancing=mode, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
        model = lightning_ep.transform(copy.deepcopy(reference), config)
    model.eval()
    reference.eval()
    batch = _padded()
    ours, theirs = model(**batch), reference(**batch)
    assert len(ours.router_logits) == len(theirs.router_logits) == 2
    real = batch["attention_mask"].reshape(-1).bool()
    for a, b in zip(ours.router_logits, theirs.router_logits, strict=True):
        assert a.shape == b.shape == (20, 8)
        assert rel_err(a[real], b[real]) < 1e-6
        assert torch.all(a[~real] == 0)  # padded positions are not routed
    assert rel_err(ours.aux_loss, theirs.aux_loss) < 1e-6
    base = model.model(**batch, output_router_logits=True)
    assert len(base.router_logits) == 2 and rel_err(base.router_logits[0][real], theirs.router_logits[0][real]) < 1e-6
    if mode != "none":
        return  # in training Sinkhorn routes otherwise than the untouched model: the gradients differ
    # The gradient of transformers' aux loss alone reaches the router weights, as on the untouched model.
    model.train()
    reference.train()
    ours = model(**batch, output_router_logits=True)
    theirs = reference(**batch, output_router_logits=True)
    ours.aux_loss.backward()
    theirs.aux_loss.backward()
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"):
        assert rel_err(model.get_parameter(name).grad, reference.get_parameter(name).grad) < 1e-5, name


def test_router_logits_are_not_recorded_unless_asked() -> None:
    model = lightning_ep.transform(tiny_mixtral(), NONE)
    out = model(**_padded())
    assert out.router_logits is None or len(out.router_logits) == 0
    assert all(not layer.router_logits.active() for layer in lightning_ep.moe_layers(model))


def test_no_warning_without_transformers_aux_loss(recwarn: pytest.WarningsRecorder) -> None:
    lightning_ep.transform(tiny_mixtral(output_router_logits=True, router_aux_loss_coef=0.0), NONE)
    lightning_ep.transform(tiny_mixtral(), NONE)
    assert not [w for w in recwarn if "load-balancing loss" in str(w.message)]


# ---------------------------------------------------------------- weight init


def _reset_init_flags(model: torch.nn.Module) -> None:
    for module in model.modules():
        for obj in (module, *module.parameters(recurse=False), *module.buffers(recurse=False)):
            if hasattr(obj, "_is_hf_initialized"):
                obj._is_hf_initialized = False


@pytest.mark.parametrize("model_type", FAMILIES)
def test_init_weights_initialises_moe_modules_as_hugging_face(model_type: str) -> None:
    """``model.init_weights()`` after ``transform`` initialises ``TopKRouter`` and the routed experts as
    Hugging Face initialises the modules they replace: with the same seed, every tensor of the model is
    bitwise the untouched model's."""
    reference = tiny_mixtral() if model_type == "mixtral" else tiny_family(model_type)
    model = lightning_ep.transform(copy.deepcopy(reference), NONE)
    for m in (reference, model):
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(float("nan"))  # so that anything not initialised shows
        _reset_init_flags(m)
        torch.manual_seed(42)
        m.init_weights()
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_init_weights_resets_the_balanced_bias() -> None:
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="balanced"))
    gate = lightning_ep.moe_layers(model)[0].gate
    with torch.no_grad():
        gate.expert_bias.fill_(1.0)
        gate.pending_load.fill_(3.0)
    _reset_init_flags(model)
    model.init_weights()
    assert torch.all(gate.expert_bias == 0) and torch.all(gate.pending_load == 0)


def test_from_pretrained_initialises_missing_moe_weights(tmp_path: Path) -> None:
    """Missing weights of a transformed model built by ``from_pretrained`` are initialised as the untouched
    model's: ``from_pretrained(None, config=..., state_dict={})`` under one seed, as transformers tests it."""
    from transformers import MixtralForCausalLM

    config = tiny_mixtral().config
    torch.manual_seed(0)
    reference = MixtralForCausalLM.from_pretrained(None, config=copy.deepcopy(config), state_dict={})
    original_init = type(reference.model).__init__

    def transformed_init(self, *args, **kwargs):  # transform right after the base model is built
        original_init(self, *args, **kwargs)
        lightning_ep.transform(self, NONE)

    with patch.object(type(reference.model), "__init__", transformed_init):
        torch.manual_seed(0)
        model = MixtralForCausalLM.from_pretrained(None, config=copy.deepcopy(config), state_dict={})
    assert lightning_ep.moe_layers(model)
    ours, theirs = model.state_dict(), reference.state_dict()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


# ---------------------------------------------------------------- experts implementation


def test_experts_implementation_is_lightning_ep_and_switches() -> None:
    """``transform`` names its experts in the config; ``set_experts_implementation`` with one of transformers'
    implementations runs that implementation (its function is called) on the layer's weights, with the
    untouched model's outputs; ``"lightning_ep"`` switches back."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    reference = tiny_mixtral().eval()
    model = lightning_ep.transform(copy.deepcopy(reference), NONE).eval()
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    batch = _padded()
    ours = model(**batch).logits
    real = batch["attention_mask"].bool()
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return batched_mm_experts_forward(*args, **kwargs)

    with patch.dict(type(ALL_EXPERTS_FUNCTIONS)._global_mapping, {"batched_mm": spy}):
        for implementation in ("eager", "batched_mm"):
            model.set_experts_implementation(implementation)
            reference.set_experts_implementation(implementation)
            assert model.config._experts_implementation == implementation
            assert rel_err(model(**batch).logits[real], reference(**batch).logits[real]) < 1e-5
    assert calls, "transformers' batched_mm was not called"
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    assert torch.equal(model(**batch).logits, ours)


def test_transformers_experts_implementation_is_refused_under_a_capacity() -> None:
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none", capacity_factor=1.0))
    model.set_experts_implementation("eager")
    with pytest.raises(ValueError, match=r"config._experts_implementation is 'eager', one of transformers'"):
        model(input_ids=torch.randint(0, 128, (2, 8)))


def test_unreplaced_experts_refuse_lightning_eps_name() -> None:
    reference = tiny_mixtral()
    lightning_ep.transform(tiny_mixtral(), NONE)  # registers the name with transformers
    reference.config._experts_implementation = EXPERTS_IMPLEMENTATION
    with pytest.raises(RuntimeError, match=r"experts_implementation='lightning_ep' runs inside lightning_ep's MoE"):
        reference(input_ids=torch.randint(0, 128, (2, 8)))


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("train", [False, True])
def test_compiled_fullgraph_equals_eager(train: bool) -> None:
    """``torch.compile(model, fullgraph=True)`` on one process traces through the MoE layers, padding included."""
    torch._dynamo.reset()
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="aux_loss")).train(train)
    batch = _padded()
    labels = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    eager = model(**batch, labels=labels)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(**batch, labels=labels)
    assert rel_err(compiled.loss, eager.loss) < 1e-6
    if train:
        eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
        compiled_grads = torch.autograd.grad(compiled.loss, list(model.parameters()))
        for a, b in zip(compiled_grads, eager_grads, strict=True):
            assert rel_err(a, b) < 1e-5


def test_generate_with_a_fullgraph_compile_config() -> None:
    """``generate(compile_config=CompileConfig(fullgraph=True))``, the path transformers advertises with
    ``_can_compile_fullgraph``, gives the eager generation."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = lightning_ep.transform(tiny_mixtral(), NONE).eval()
    batch = _padded()
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    eager = model.generate(**batch, **kwargs)
    compiled = model.generate(
        **batch, **kwargs, compile_config=CompileConfig(fullgraph=True, backend="aot_eager"), disable_compile=False
    )
    assert torch.equal(compiled, eager)


# ---------------------------------------------------------------- transformers' own expert parallelism


def test_transformers_expert_parallelism_is_refused() -> None:
    """Combining transformers' expert parallelism with lightning_ep's is refused, whichever comes first."""
    from transformers.distributed import DistributedConfig

    model = tiny_mixtral()
    model.config.distributed_config = DistributedConfig(fsdp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=re.escape("transformers' own expert parallelism is applied to this model")):
        lightning_ep.transform(model, NONE)
    experts = lightning_ep.moe_layers(lightning_ep.transform(tiny_mixtral(), NONE))[0].experts
    with pytest.raises(RuntimeError, match=r"transformers' own expert parallelism \(DistributedConfig"):
        experts.num_experts = 4  # what transformers' MoEParamShard does to the experts it shards


# ---------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_uses_the_current_switch_without_a_warning() -> None:
    """transformers 5.23 renamed ``gradient_checkpointing_enable``; the old name warns on every rank."""
    model = tiny_mixtral(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_checkpointing(model, True)
    checkpoint = model.model.layers[0]._gradient_checkpointing_func
    assert model.model.layers[0].gradient_checkpointing
    assert checkpoint.func is torch.utils.checkpoint.checkpoint and checkpoint.keywords == {"use_reentrant": False}


def test_activation_checkpointing_refuses_a_model_without_a_switch() -> None:
    message = r"activation_checkpointing=True\): Linear has neither .* activation_checkpointing=False\."
    with pytest.raises(TypeError, match=message):
        enable_checkpointing(torch.nn.Linear(8, 8), True)
