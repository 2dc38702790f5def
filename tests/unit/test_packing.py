"""A packed row is its documents (DESIGN.md, invariant 11), on one process.

A row from transformers' ``DataCollatorWithFlattening`` (``position_ids`` restarting at 0 per document,
no ``attention_mask``) through a transformed model whose ``config.use_cache`` is on gives the loss and
gradients of its documents each run alone on the untouched model, and the token counts and aux and z
losses of the documents as one padded batch; eagerly, with the strategy's compiled layers, with the whole
model compiled, under PEFT, and through ``ExpertParallelStrategy`` in a Trainer. Why these two references
are exact, and the tolerance (1e-5 relative in fp32): ``tests/distributed/packing_workers.py``. The
untouched model's own packed loss, its documents attending to each other, is off by more than 1e-4
(asserted for every family), so the tolerance tells the two apart. The degree-2 twin is
``tests/distributed/test_packing_ep.py``.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import rel_err
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import CONFIG, RTOL
from packing_workers import (
    AUX,
    FAMILIES,
    MASKS,
    assert_close,
    documents,
    fit_one_step,
    grads,
    packed_batch,
    packed_module,
    padded_batch,
    run,
    separate,
    tiny,
)


def _against_separate_documents(family: str, prepare: Any = None) -> None:
    """The packed row through ``transform(tiny(family), CONFIG)`` (then ``prepare(model)``) against its
    documents each alone through the untouched model."""
    docs = documents()
    untouched = tiny(family)
    model = lightning_ep.transform(copy.deepcopy(untouched), CONFIG)
    if prepare is not None:
        prepare(model)
    assert model.config.use_cache is True
    ours = run(model, packed_batch(docs))
    reference = {"loss": separate(untouched, docs), "grads": grads(untouched)}
    assert_close(family, ours, reference, stats=False)
    assert model.config.use_cache is True, "the user's config is left as it is"


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_gives_its_documents_loss_and_gradients(family: str) -> None:
    _against_separate_documents(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_without_the_hook_the_documents_attend_to_each_other(family: str) -> None:
    """The trap is real for every family, so the tests above can tell: the untouched model with
    ``config.use_cache`` on mixes the documents of a packed row. With ``use_cache=False`` transformers
    separates them, except GPT-OSS, whose decoder builds its masks without the positions (the hook
    builds them for it)."""
    docs = documents()
    model = tiny(family)
    reference = separate(model, docs)
    with torch.no_grad():
        assert rel_err(model(**packed_batch(docs)).loss, reference) > 10 * RTOL
        without_cache = rel_err(model(**packed_batch(docs), use_cache=False).loss, reference)
    assert (without_cache > 10 * RTOL) if family == "gpt_oss" else (without_cache <= RTOL), without_cache


@pytest.mark.parametrize(
    ("family", "config"),
    [(family, AUX) for family in FAMILIES] + [("mixtral", MoEConfig(moe_z_loss_coeff=0.01))],
    ids=[f"{family}-aux_loss" for family in FAMILIES] + ["mixtral-sinkhorn"],
)
def test_packed_row_routes_each_token_once(family: str, config: MoEConfig) -> None:
    """Token counts, aux and z losses, loss and gradients (router losses' included) of the packed row
    equal those of its documents as one padded batch, on the same transformed model."""
    docs = documents()
    model = lightning_ep.transform(tiny(family), config)
    reference = copy.deepcopy(model)
    ours = run(model, packed_batch(docs))
    assert_close(family, ours, run(reference, padded_batch(docs)))
    assert sum(int(c.sum()) for c in ours["counts"]) == len(ours["counts"]) * sum(map(len, docs)) * 2  # top-2


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_through_the_strategys_compiled_layers(family: str) -> None:
    """``compile_for_training`` (what ``Execution(compile=True)`` runs; it turns ``config.use_cache``
    off, which is turned back on here): attention, norms, routing, loss and head compiled by inductor."""
    from lightning_ep.parallel.compile import compile_for_training
    from lightning_ep.parallel.fsdp import decoder_blocks

    def compile_layers(model: nn.Module) -> None:
        torch._dynamo.reset()
        assert compile_for_training(model, decoder_blocks(model)) > 0
        model.config.use_cache = True

    _against_separate_documents(family, compile_layers)


def test_packed_row_through_the_whole_model_compiled() -> None:
    """``torch.compile(model, fullgraph=True)``: transformers' packing check is traced (no host read), the
    hook's choice of ``use_cache`` too."""
    docs = documents()
    untouched = tiny("mixtral")
    model = lightning_ep.transform(copy.deepcopy(untouched), CONFIG)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ours = run(compiled, packed_batch(docs))
    ours["grads"] = grads(model)
    reference = {"loss": separate(untouched, docs), "grads": grads(untouched)}
    assert_close("mixtral compiled", ours, reference, stats=False)


def test_packed_row_through_a_peft_model() -> None:
    """Under PEFT the hook sits on the Hugging Face decoder inside the PEFT model: the loss is that of
    the documents each alone through the untouched PEFT model (LoRA on attention and experts)."""
    from lora_workers import lora_config
    from peft import get_peft_model

    docs = documents()
    torch.manual_seed(1)
    untouched = get_peft_model(tiny("mixtral"), lora_config())
    model = lightning_ep.transform(copy.deepcopy(untouched), CONFIG)
    ours = run(model, packed_batch(docs))
    loss = separate(untouched, docs)
    assert rel_err(ours["loss"], loss) <= RTOL, (ours["loss"], loss)


def test_packed_detection_runs_once_per_mask_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers reads the positions back once per mask a forward builds, before the first layer,
    never per layer: as often with 2 decoder layers as with 4, in forward and backward."""
    from transformers import masking_utils

    calls: list[int] = []
    find = masking_utils.find_packed_sequence_indices

    def counted(position_ids: torch.Tensor) -> torch.Tensor | None:
        calls.append(1)
        return find(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    batch = packed_batch(documents())
    for family in FAMILIES:
        for layers in (2, 4):
            model = lightning_ep.transform(tiny(family, num_hidden_layers=layers), CONFIG)
            calls.clear()
            model(**batch).loss.backward()
            assert len(calls) == MASKS[family], (family, layers, len(calls))


def test_a_training_forward_that_asks_for_a_cache_is_refused() -> None:
    from transformers import DynamicCache

    model = lightning_ep.transform(tiny("mixtral"), CONFIG)
    batch = packed_batch(documents())
    with pytest.raises(ValueError, match=re.escape("called in train mode with use_cache=True, position_ids and no")):
        model(**batch, use_cache=True)
    with pytest.raises(ValueError, match=re.escape("A training forward needs no cache: leave use_cache unset")):
        model(**batch, use_cache=True)
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # < 5.24
    with pytest.raises(ValueError, match=re.escape("called in train mode with a cache, position_ids and no")):
        model(**batch, **{cache: DynamicCache(config=model.config)})


def test_calls_that_are_not_packed_rows_keep_hugging_faces_caching() -> None:
    """Outside a training forward of a packed row the caching is Hugging Face's: an evaluation call that
    asks for a cache gets one (documents then attend to each other, as in transformers), a call without
    positions follows ``config.use_cache``, and a packed call that leaves it unset gets none."""
    model = lightning_ep.transform(tiny("mixtral"), CONFIG).eval()
    batch = packed_batch(documents())
    with torch.no_grad():
        assert model(**batch, use_cache=True).past_key_values is not None
        assert model(input_ids=batch["input_ids"]).past_key_values is not None
        assert model(**batch).past_key_values is None
        model.config.use_cache = False
        assert model(input_ids=batch["input_ids"]).past_key_values is None
    model.train()
    model(input_ids=batch["input_ids"], use_cache=True)  # no positions: nothing to look for, allowed


def test_positional_arguments_of_the_decoder() -> None:
    """The hook reads the decoder's arguments by name, positional ones included: positions passed
    positionally keep the documents apart too (missed, the config's cache would mix them)."""
    model = lightning_ep.transform(tiny("mixtral"), CONFIG)
    batch = packed_batch(documents())
    ids, positions = batch["input_ids"], batch["position_ids"]
    decoder = model.base_model
    with torch.no_grad():
        by_keyword = decoder(input_ids=ids, position_ids=positions).last_hidden_state
        by_position = decoder(ids, None, positions).last_hidden_state
    assert torch.equal(by_position, by_keyword)
    with pytest.raises(ValueError, match="use_cache=True"):
        decoder(ids, None, positions, None, None, True)


@pytest.mark.parametrize("smp_moe", [True, False])
def test_packed_row_through_the_strategy(single_process, smp_moe: bool) -> None:
    """One Trainer step of ``ExpertParallelStrategy`` on one process, the batch collated by
    ``DataCollatorWithFlattening``: the loss and every gradient are those of the documents each alone
    through the untouched model, with the strategy's MoE layers and with the model's own blocks."""
    from lightning_ep import Execution, ExpertParallelStrategy

    docs = documents()
    untouched = tiny("mixtral")
    expected = {"loss": separate(untouched, docs), "grads": grads(untouched)}
    module = packed_module("mixtral")
    moe = replace(CONFIG, smp_moe=smp_moe)
    fit_one_step(module, ExpertParallelStrategy(moe=moe, execution=Execution(compile=False)), 0, 1)
    assert module.model.config.use_cache is True
    assert bool(lightning_ep.moe_layers(module.model)) is smp_moe
    assert_close(f"strategy smp_moe={smp_moe}", {"loss": module.loss.detach(), "grads": module.grads}, expected, False)
