"""A call whose attention mask is known on the host skips Hugging Face's mask creation (and its host
sync), with the same numbers; every other call builds its mask as before.

Which path a call took is read inside it: a forward pre-hook on the first attention module records
the attention implementation of the config the model's forward runs on (``"lightning_ep_sdpa"`` when
the mask creation was skipped) and that of the attention's own config (always the model's own).
Hugging Face's own path is the same model with ``causal_mask.mask_is_known`` patched to refuse
every call. Losses and gradients are compared bit for bit: both paths call the same SDPA kernel
with the same arguments.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_mixtral
from torch import nn

import lightning_ep
from lightning_ep.models import causal_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import FAMILY_NAMES, tiny_family

SEQ = 12


def _ids(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(3))


def _attention(model: nn.Module) -> nn.Module:
    return next(m for name, m in model.named_modules() if name.endswith("self_attn"))


def _implementations_seen(model: nn.Module, call: Any) -> list[str]:
    """The attention implementation of the config that the decoder's forward (``decoder_model``) ran on
    when it reached the first attention module during ``call()``; that module's own config reads the model's."""
    base, seen = causal_mask.decoder_model(model), []
    own = base.config._attn_implementation

    def record(attention: nn.Module, _args: tuple) -> None:
        assert attention.config._attn_implementation == own
        seen.append(base.config._attn_implementation)

    handle = _attention(model).register_forward_pre_hook(record)
    try:
        call()
    finally:
        handle.remove()
    assert base.config._attn_implementation == own  # the model's own config is back after the call
    return seen


def _loss_and_grads(model: nn.Module, **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(causal_mask, "mask_is_known", lambda config, args, kwargs: False)


def _assert_same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


SDPA_FAMILIES = ["mixtral", *(name for name in FAMILY_NAMES if name != "gpt_oss")]  # GPT-OSS runs eager attention


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_a_call_without_mask_positions_or_cache_skips_the_mask_with_the_same_numbers(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_mixtral() if family == "mixtral" else tiny_family(family)
    lightning_ep.transform(model)
    assert model.config._attn_implementation == "sdpa"
    reference = copy.deepcopy(model)
    ids = _ids()
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}

    config = model.base_model.config
    assert _implementations_seen(model, lambda: _loss_and_grads(model, **inputs)) == [causal_mask.NAME]
    assert model.base_model.config is config and config._attn_implementation == "sdpa"
    ours = _loss_and_grads(model, **inputs)
    with monkeypatch.context() as patch:
        _hf_path(patch)
        assert _implementations_seen(reference, lambda: _loss_and_grads(reference, **inputs)) == ["sdpa"]
        _assert_same(ours, _loss_and_grads(reference, **inputs))


@pytest.mark.parametrize("order", ["peft-then-transform", "transform-then-peft"])
def test_a_peft_model_skips_the_mask_with_the_same_numbers(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks sit on the decoder inside PEFT's wrapper, whichever of the two came first."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    if order == "transform-then-peft":
        model = get_peft_model(lightning_ep.transform(tiny_mixtral()), lora)
    else:
        model = lightning_ep.transform(get_peft_model(tiny_mixtral(), lora))
    reference = copy.deepcopy(model)
    ids = _ids()
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    assert _implementations_seen(model, lambda: _loss_and_grads(model, **inputs)) == [causal_mask.NAME]
    ours = _loss_and_grads(model, **inputs)
    assert any("lora" in name for name in ours[1])
    with monkeypatch.context() as patch:
        _hf_path(patch)
        assert _implementations_seen(reference, lambda: _loss_and_grads(reference, **inputs)) == ["sdpa"]
        _assert_same(ours, _loss_and_grads(reference, **inputs))


def _calls() -> dict[str, tuple[dict[str, Any], dict[str, Any], bool]]:
    """name -> (config overrides, the call's inputs, whether the mask creation is skipped)."""
    ids = _ids()
    padded = torch.ones_like(ids)
    padded[0, 8:] = 0
    packed = torch.cat([torch.arange(6), torch.arange(6)]).expand(2, -1)
    return {
        "no mask, use_cache=False": ({}, {"input_ids": ids, "use_cache": False}, True),
        "no mask, the config's use_cache": ({}, {"input_ids": ids}, True),
        "inputs_embeds": ({}, {"inputs_embeds": torch.randn(2, SEQ, 64), "use_cache": False}, True),
        "sliding window longer than the sequence": ({"sliding_window": SEQ + 1}, {"input_ids": ids}, True),
        "a mask of ones": ({}, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, False),
        "padding": ({}, {"input_ids": ids, "attention_mask": padded}, False),
        "packed positions": ({}, {"input_ids": ids, "position_ids": packed, "use_cache": False}, False),
        "sliding window shorter than the sequence": ({"sliding_window": SEQ - 4}, {"input_ids": ids}, False),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_each_call_takes_the_path_its_mask_allows_with_hugging_faces_numbers(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides, inputs, skipped = _calls()[name]
    model = lightning_ep.transform(tiny_mixtral(**overrides))
    reference = copy.deepcopy(model)
    inputs = {**inputs, "labels": _ids()}
    assert _implementations_seen(model, lambda: model(**inputs)) == [causal_mask.NAME if skipped else "sdpa"]
    ours = _loss_and_grads(model, **inputs)
    with monkeypatch.context() as patch:
        _hf_path(patch)
        _assert_same(ours, _loss_and_grads(reference, **inputs))
    if not skipped and "a mask of ones" not in name:
        # The check matters: had this call skipped the mask, its numbers would differ.
        monkeypatch.setattr(causal_mask, "mask_is_known", lambda config, args, kwargs: True)
        wrong = _loss_and_grads(reference, **inputs)
        assert not torch.equal(wrong[0], ours[0])


def test_a_cache_another_argument_or_another_implementation_keeps_the_mask_creation() -> None:
    config = tiny_mixtral().config
    ids = _ids()
    assert causal_mask.mask_is_known(config, (), {"input_ids": ids, "attention_mask": None, "return_dict": True})
    assert causal_mask.mask_is_known(config, (ids,), {})
    assert not causal_mask.mask_is_known(config, (ids, None), {})  # positional arguments past input_ids
    assert not causal_mask.mask_is_known(config, (), {"input_ids": ids, "past_key_values": object()})
    assert not causal_mask.mask_is_known(config, (), {"input_ids": ids, "cache_position": torch.arange(SEQ)})
    assert not causal_mask.mask_is_known(config, (), {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)})
    assert not causal_mask.mask_is_known(config, (), {})
    chunked = copy.copy(config)
    chunked.attention_chunk_size = 4
    assert not causal_mask.mask_is_known(chunked, (), {"input_ids": ids})
    for eager in (tiny_mixtral(attn_implementation="eager"), tiny_family("gpt_oss")):
        lightning_ep.transform(eager)
        assert not causal_mask.skip_causal_mask(eager)
        assert _implementations_seen(eager, lambda m=eager: m(input_ids=ids, use_cache=False)) == ["eager"]


def test_the_mask_creation_runs_as_before_under_torch_compile() -> None:
    model = lightning_ep.transform(tiny_mixtral())
    ids = _ids()
    assert _implementations_seen(model, lambda: model(input_ids=ids, use_cache=False)) == [causal_mask.NAME]
    eager = model(input_ids=ids, use_cache=False).logits
    compiled = torch.compile(model, backend="eager")(input_ids=ids, use_cache=False).logits
    assert model.base_model.config._attn_implementation == "sdpa"
    # Traced, Hugging Face builds an explicit causal mask: another SDPA kernel, the same attention.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
