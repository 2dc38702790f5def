"""Workers for ``lightning_ep.parallel.single_rank`` (``test_single_rank.py``): at world size 1 the
dense parameters used in place give FSDP2's numbers bit for bit; above it, the option is refused."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from workers import micro_batch, tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.parallel.fsdp import check_all_sharded
from lightning_ep.parallel.single_rank import is_kept_local, keep_dense_local


def _pair(precision: str, **overrides: object) -> list[nn.Module]:
    """The same tiny Mixtral twice: under FSDP2 (as every larger world runs it), and in place."""
    policy = None
    if precision != "32-true":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = tiny_mixtral(**overrides)
    if precision == "bf16-true":
        base = base.to(torch.bfloat16)
    base.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)  # a frozen weight, as under LoRA
    models = []
    for in_place in (False, True):
        model = copy.deepcopy(base)
        mesh = lightning_ep.init_mesh(1, device_type="cpu")
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="aux_loss"), mesh=mesh)
        lightning_ep.shard_model(model, mesh, mp_policy=policy, in_place_on_one_rank=in_place)
        assert is_kept_local(model) == in_place
        assert isinstance(model, FSDPModule) != in_place
        models.append(model.train())
    return models


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_same_grads_and_weights(models: list[nn.Module], what: str) -> None:
    sharded, local = (dict(m.named_parameters()) for m in models)
    assert list(sharded) == list(local), what
    for name, p in local.items():
        assert isinstance(p, DTensor), (what, name)
        other = sharded[name]
        assert (p.grad is None) == (other.grad is None), (what, name)
        if p.grad is not None:
            assert p.grad.dtype == other.grad.dtype == p.dtype, (what, name, p.grad.dtype)
            assert torch.equal(_full(p.grad), _full(other.grad)), (what, name)
        assert torch.equal(_full(p), _full(other)), (what, name)


def run_in_place_matches_fsdp2(rank: int, world: int, precision: str, tied: bool) -> None:
    """Five AdamW steps with the library's gradient clipping, in ``precision`` (``bf16-mixed``: fp32
    weights, FSDP2's bf16 policy, autocast): a plain step, a step with two forwards before one
    backward, a step with two backwards before the optimizer (gradients accumulated on the
    DTensors), then two plain ones; between steps an evaluation forward without grad, and a
    forward that raises. Losses, logits, gradients and weights are bitwise FSDP2's throughout."""
    models = _pair(precision, tie_word_embeddings=tied)
    if tied:
        local = models[1]
        assert local.lm_head.weight is local.model.embed_tokens.weight
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in models]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    for step, kind in enumerate(("plain", "two forwards", "two backwards", "plain", "plain")):
        losses = []
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            ids, more = micro_batch(step, rank), micro_batch(step + 100, rank)
            with autocast:
                if kind == "two forwards":
                    loss = model(input_ids=ids, labels=ids).loss + model(input_ids=more, labels=more).loss
                    loss.backward()
                elif kind == "two backwards":
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    model(input_ids=more, labels=more).loss.backward()
                else:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
            losses.append(loss.detach())
            check_all_sharded(model)  # the DTensors are back in their slots, with their gradients
            lightning_ep.clip_grad_norm_(model.parameters(), 0.5)
        assert torch.equal(losses[0], losses[1]), (kind, losses)
        _assert_same_grads_and_weights(models, kind)
        for optimizer in optimizers:
            optimizer.step()
        _assert_same_grads_and_weights(models, f"after the step of {kind}")
        with torch.no_grad(), autocast:
            logits = [m(input_ids=micro_batch(step + 200, rank)).logits for m in models]
        assert torch.equal(logits[0], logits[1]), kind
    with pytest.raises(IndexError):  # a token id past the vocabulary: the embedding raises mid-forward
        models[1](input_ids=torch.full((1, 4), 10**6))
    check_all_sharded(models[1])


def _sharded(seed: int, dtype: torch.dtype) -> nn.Module:
    model = tiny_mixtral(seed=seed).to(dtype)
    mesh = lightning_ep.init_mesh(1, device_type="cpu")
    lightning_ep.transform(model, MoEConfig(moe_load_balancing="aux_loss"), mesh=mesh)
    return lightning_ep.shard_model(model, mesh)


def run_in_place_follows_new_weights(rank: int, world: int) -> None:
    """Weights replaced after a forward (``load_state_dict``, then a dtype conversion) are the ones
    the next forward uses: the stand-ins follow the DTensors."""
    model = _pair("32-true")[1]
    ids = micro_batch(0, rank)
    model(input_ids=ids)
    model.load_state_dict(_sharded(1, torch.float32).state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, _sharded(1, torch.float32)(input_ids=ids).logits)
        model.to(torch.bfloat16)
        assert torch.equal(model(input_ids=ids).logits, _sharded(1, torch.bfloat16)(input_ids=ids).logits)


def run_in_place_is_freed_with_its_model(rank: int, world: int) -> None:
    """A trained model in place, dropped, is freed by the garbage collector with its weights: the
    gradient hooks, which live in C++ out of the collector's sight, hold no strong reference back."""
    model = _pair("bf16-mixed")[1]
    ids = micro_batch(0, rank)
    model(input_ids=ids, labels=ids).loss.backward()
    weight = weakref.ref(model.model.embed_tokens.weight)
    del model
    gc.collect()
    assert weight() is None, "the model's weights outlived it"


def run_in_place_refused_above_one_rank(rank: int, world: int) -> None:
    mesh = lightning_ep.init_mesh(world, device_type="cpu")
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(), mesh=mesh)
    with pytest.raises(ValueError, match=r"in_place_on_one_rank=True needs one rank in all, but the dense parameters"):
        lightning_ep.shard_model(model, mesh, in_place_on_one_rank=True)
    with pytest.raises(ValueError, match=rf"keep_dense_local needs a one-rank mesh \(it has {world} ranks\)"):
        keep_dense_local(model, mesh["ep"])
