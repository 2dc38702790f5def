"""On CUDA: a packed row costs at most one device-to-host sync per mask its model builds, never one per layer.

transformers looks for packed documents in the positions once per mask a forward builds (one for most
families, a full and a sliding-window one for GPT-OSS and Qwen2-MoE), before the first layer; the hook
that keeps the documents apart (``lightning_ep.models.causal_mask.separate_packed_documents``) reads no
tensor, and the MoE layers see no padding in a packed row. So a forward and backward of a packed row
makes at most that many syncs more than the same tokens as one row without positions (transformers
5.17 reads the documents once for GPT-OSS's two masks), and no more with 4 decoder layers than with 2.
bf16, so that the experts run the grouped GEMM, which reads no count back. The numbers are the CPU
tests' (``tests/unit/test_packing.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import count_syncs

import lightning_ep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import CONFIG
from packing_workers import FAMILIES, MASKS, documents, packed_batch, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_syncs_once_per_mask_not_per_layer(family: str) -> None:
    packed = {k: v.cuda() for k, v in packed_batch(documents()).items()}
    unpacked = {"input_ids": packed["input_ids"], "labels": packed["input_ids"]}
    extras = []
    for layers in (2, 4):
        model = lightning_ep.transform(tiny(family, num_hidden_layers=layers), CONFIG).cuda().to(torch.bfloat16)

        def step(batch: dict[str, torch.Tensor], model: torch.nn.Module = model) -> None:
            model(**batch).loss.backward()

        step(packed)  # first-use work (allocations, lazy initialisation) stays out of the count
        step(unpacked)
        extras.append(count_syncs(lambda: step(packed)) - count_syncs(lambda: step(unpacked)))
    # Not per layer: 4 layers cost no more than 2, and neither more than one sync per mask.
    assert extras[1] <= extras[0] <= MASKS[family] and extras[1] >= 0, (family, extras)
