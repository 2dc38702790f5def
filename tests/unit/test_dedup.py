"""Token deduplication's pieces on one process: the deterministic segment sum and
``LayerExecution.token_dedup``'s checks (``Execution(token_dedup=True)`` under the strategy). The
exchange itself is tested on gloo processes (``tests/distributed``: ``Case(dedup=...)`` and
``test_keep_all_to_all``) and under NCCL (``tests/gpu``)."""

from __future__ import annotations

import pytest
import torch

from lightning_ep import LayerExecution, MoEConfig
from lightning_ep.moe.dispatch.dedup import segment_sum, wire_dtype


def test_segment_sum_adds_rows_in_order_in_fp32_and_rounds_once():
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=torch.bfloat16)
    out = segment_sum(src, torch.tensor([2, 0, 2, 2]), 4, torch.bfloat16)
    expected = torch.tensor([[3.0, 4.0], [0.0, 0.0], [13.0, 16.0], [0.0, 0.0]], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    # 256 + 1 + 1: bf16 pairwise adds would lose both ones (256 + 1 rounds to 256); fp32 keeps them.
    big = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    assert segment_sum(big, torch.tensor([0, 0, 0]), 1, torch.float32).item() == 258.0


def test_segment_sum_keeps_fp64_precision():
    src = torch.tensor([[1.0], [1e-12]], dtype=torch.float64)
    assert segment_sum(src, torch.tensor([0, 0]), 1, torch.float64).item() == 1.0 + 1e-12
    assert wire_dtype(torch.bfloat16) == torch.float32 and wire_dtype(torch.float64) == torch.float64


def test_token_dedup_is_checked():
    assert LayerExecution().token_dedup is False
    with pytest.raises(TypeError, match=r"LayerExecution\(token_dedup=1\): pass True or False"):
        LayerExecution(token_dedup=1)  # type: ignore[arg-type]
    dedup = LayerExecution(token_dedup=True)
    refused = r"Execution\(exchange='collective', token_dedup=True, row_budget=None\) changes the dropless all-to-all"
    with pytest.raises(ValueError, match=refused + r".*capacity_factor=1.0"):
        dedup.check(MoEConfig(capacity_factor=1.0), 2)
    with pytest.raises(ValueError, match=refused + r".*moe_all_to_all_dispatcher=False"):
        dedup.check(MoEConfig(moe_all_to_all_dispatcher=False), 2)
    with pytest.raises(ValueError, match=refused + r".*degree=1"):
        dedup.check(MoEConfig(), 1)
    dedup.check(MoEConfig(), 2)
    for other in ({"exchange": "symmetric_memory"}, {"row_budget": 64}, {"row_budget": "auto"}):
        with pytest.raises(ValueError, match=r"token_dedup=True deduplicates the dynamic collective all-to-all"):
            LayerExecution(token_dedup=True, **other)  # type: ignore[arg-type]
    LayerExecution(token_dedup=False).check(MoEConfig(capacity_factor=1.0), 2)  # off is always allowed
