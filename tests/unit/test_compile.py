"""``compile_blocks`` / ``Execution(compile=True)`` against eager, one process.

Decoder layers with compiled dense parts must compute what the eager ones do: inductor fuses the
RMSNorms' fp32 reductions and the rotary arithmetic, which reorders float sums, so fp32 losses and
gradients agree to ~1e-6 relative (1e-5 asserted), not bitwise. The MoE layers must stay eager,
module names and state-dict keys must not change, and activation checkpointing must not turn the
compilation off. The CUDA
twin is ``tests/gpu/test_compile_cuda.py``; the Trainer run at degree 2 is in
``tests/trainer/test_strategy.py``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from torch._dynamo.utils import counters

import lightning_ep
from lightning_ep.parallel.compile import (
    compile_blocks,
    compile_final_norm,
    compile_for_training,
    compile_head,
    compile_loss,
    dense_children,
    final_norm,
    is_compiled,
)
from lightning_ep.parallel.fsdp import decoder_blocks
from lightning_ep.strategy.arguments import enable_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import FAMILY_NAMES, tiny_family

RTOL = 1e-5


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        )  # fmt: skip
        return MixtralForCausalLM(config).float()
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64, decoder_sparse_step=1,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(config).float()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_compiled_layers_match_eager(family: str) -> None:
    config = lightning_ep.MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    eager = lightning_ep.transform(_tiny(family), config).train()
    for layer in lightning_ep.moe_layers(eager):
        layer.check_finite = True
    compiled = copy.deepcopy(eager)
    keys = list(compiled.state_dict())
    torch._dynamo.reset()  # graphs of an earlier test would not be counted
    counters.clear()
    assert compile_blocks(decoder_blocks(compiled)) == 2
    assert compile_blocks(decoder_blocks(compiled)) == 0, "a second call must leave compiled blocks alone"
    assert all(is_compiled(block) for block in decoder_blocks(compiled))

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for step in range(2):  # the second step runs the cached graphs
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        assert rel_err(losses[1], losses[0]) < RTOL, (step, losses)
        grads = dict(eager.named_parameters())
        for name, param in compiled.named_parameters():
            assert param.grad is not None, name
            assert rel_err(param.grad, grads[name].grad) < RTOL, (step, name)
        for mine, theirs in zip(lightning_ep.moe_layers(compiled), lightning_ep.moe_layers(eager), strict=True):
            assert torch.equal(mine.tokens_per_expert, theirs.tokens_per_expert)
            assert not mine.nonfinite and not theirs.nonfinite
            for name in ("aux_loss", "z_loss", "router_entropy"):
                assert rel_err(getattr(mine, name), getattr(theirs, name)) < RTOL, name

    assert list(compiled.state_dict()) == keys
    # Shared by the layers: one graph each for the attention, the RMSNorms, the routing with its
    # statistics and the output's finiteness check; none broken (the rest of the MoE layers is eager).
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for block in decoder_blocks(compiled):
        names = {name for name, child in block.named_children() if child in dense_children(block)}
        assert names == {"self_attn", "input_layernorm", "post_attention_layernorm"}, names


def test_compile_for_training_turns_the_kv_cache_off() -> None:
    """The helper the strategy calls: no KV cache (it would make a graph per layer index), then
    compile the layers and the loss."""
    model = lightning_ep.transform(_tiny("mixtral"), lightning_ep.MoEConfig())
    assert model.config.use_cache
    assert compile_for_training(model, decoder_blocks(model)) == 2
    assert model.config.use_cache is False
    assert all(is_compiled(block) for block in decoder_blocks(model))
    assert not compile_loss(model), "compile_for_training compiled the loss already"
    assert not compile_head(model), "and the output projection"
    assert not compile_final_norm(model), "and the final norm before it"


def _eager_and_compiled(compile_fn: Callable[[torch.nn.Module], bool]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Mixtral and its copy with ``compile_fn`` applied (Dynamo reset, its counters cleared);
    checks that ``compile_fn`` compiles once, is idempotent and leaves a plain ``Linear`` alone."""
    eager = _tiny("mixtral").train()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    assert compile_fn(compiled)
    assert not compile_fn(compiled), "idempotent"
    assert not compile_fn(torch.nn.Linear(2, 2))
    return eager, compiled


def _backward_each(models: tuple[torch.nn.Module, ...], loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> list:
    """``loss_of(model).backward()`` for each model; the detached losses."""
    losses = []
    for model in models:
        loss = loss_of(model)
        loss.backward()
        losses.append(loss.detach())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return losses


def test_compiled_loss_matches_eager() -> None:
    """The causal-LM loss, fused by inductor (fp32 log-softmax without an fp32 copy of the logits),
    gives the eager loss and gradients; a module without Hugging Face's ``loss_function`` is left alone."""
    eager, compiled = _eager_and_compiled(compile_loss)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions, as padding gives
    losses = _backward_each((eager, compiled), lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss)
    assert rel_err(losses[1], losses[0]) < RTOL, losses
    grads = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        assert rel_err(param.grad, grads[name].grad) < RTOL, name


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_head_matches_eager(autocast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output projection's compiled ``forward`` gives the eager logits and gradients bit for bit:
    in fp32, and under bf16 autocast with fp32 weights (the casts compiled, their gradient widened
    back to the fp32 weight as eagerly); a module without output embeddings is left alone. (The
    final norm, which ``compile_head`` compiles too, is left eager here and checked below.)"""
    from lightning_ep.parallel import compile as compiling

    monkeypatch.setattr(compiling, "compile_final_norm", lambda model, **kwargs: False)
    eager, compiled = _eager_and_compiled(compile_head)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, use_cache=False).logits
        return logits.float().square().mean()

    losses = _backward_each((eager, compiled), loss_of)
    assert compiled.lm_head.weight.grad.dtype == torch.float32
    # Bit for bit: the same GEMMs on the same (bf16-rounded) operands, the casts exact or
    # correctly rounded either way.
    assert torch.equal(losses[1], losses[0]), losses
    grads = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        assert torch.equal(param.grad, grads[name].grad), name


def test_compiled_final_norm_matches_eager() -> None:
    """The final RMSNorm before the output projection, compiled (``compile_head`` compiles it too),
    gives the eager logits and gradients to fp32 rounding (inductor reorders its fp32 reduction);
    a module without a decoder norm is left alone."""
    eager, compiled = _eager_and_compiled(compile_final_norm)
    assert final_norm(compiled) is compiled.model.norm
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits.square().mean()

    losses = _backward_each((eager, compiled), loss_of)
    assert rel_err(losses[1], losses[0]) < RTOL, losses
    grads = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        assert rel_err(param.grad, grads[name].grad) < RTOL, name


@pytest.mark.parametrize("family", ["mixtral", *FAMILY_NAMES])
def test_final_norm_is_the_norm_before_the_output_projection(family: str) -> None:
    """Every supported family: ``final_norm`` finds the module whose output the ``lm_head`` reads."""
    model = _tiny("mixtral") if family == "mixtral" else tiny_family(family)
    norm = final_norm(model)
    assert norm is not None
    seen: dict[str, torch.Tensor] = {}
    norm.register_forward_hook(lambda module, args, out: seen.setdefault("norm", out))
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.setdefault("head", args[0]))
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    assert torch.equal(seen["head"], seen["norm"])
    assert final_norm(torch.nn.Linear(2, 2)) is None


def test_checkpointed_layers_still_compile() -> None:
    """Hugging Face checkpoints a decoder layer's ``forward``; the compiled children run inside it."""
    model = lightning_ep.transform(_tiny("mixtral"), lightning_ep.MoEConfig())
    enable_checkpointing(model, True)
    reference = copy.deepcopy(model)
    compile_blocks(decoder_blocks(model))
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    model.train(), reference.train()
    losses = []
    for m in (reference, model):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # attention, norms, routing
    assert rel_err(losses[1], losses[0]) < RTOL
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert rel_err(param.grad, grads[name].grad) < RTOL, name
