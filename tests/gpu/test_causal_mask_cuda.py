"""On CUDA: a forward and backward of a transformed model called without mask, positions or cache
makes no device-to-host sync; Hugging Face's mask creation, which the call skips, makes one
(``lightning_ep.models.causal_mask``). The numbers are the CPU test's (``tests/unit/test_causal_mask.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import count_syncs, tiny_mixtral

import lightning_ep
from lightning_ep.models import causal_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_call_without_mask_makes_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    model = lightning_ep.transform(tiny_mixtral(hidden_size=128, intermediate_size=64)).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    step()  # first-use work (allocations, lazy initialisation) stays out of the count
    assert count_syncs(step) == 0
    monkeypatch.setattr(causal_mask, "mask_is_known", lambda config, args, kwargs: False)
    assert count_syncs(step) >= 1  # Hugging Face's mask creation reads the positions back
