"""Ragged and padded batches under expert parallelism: ranks with different token counts in the same
step (dynamic padding per batch, the normal case of a fine-tune) and padded positions, on 4 gloo
processes at degree 2, equal data parallelism of the unsharded model (the one-process model on every
rank's micro-batch, averaged) within 1e-5, for every dispatcher; pad content changes nothing, bitwise.
"""

from __future__ import annotations

import pytest
from harness import spawn
from padding_workers import RaggedCase, run_pad_content, run_ragged, run_router_logits

pytestmark = pytest.mark.distributed

# Sequence lengths 16 / 13 / 10 / 7 on ranks 0-3; "padded" adds an attention mask with padding too.
RAGGED = [
    RaggedCase(),  # the all-to-all dispatcher
    RaggedCase(capacity=0.5, mode="aux_loss"),
    RaggedCase(capacity=0.75, policy="position", mode="balanced"),
    RaggedCase(shuffle=True),
    RaggedCase(all_to_all=False, mode="sinkhorn"),
    RaggedCase(all_to_all=False, shuffle=True),
    RaggedCase(dedup=True, mode="balanced"),
]
PADDED = [
    RaggedCase(padded=True, mode="sinkhorn"),
    RaggedCase(padded=True, capacity=0.5, mode="aux_loss"),
    RaggedCase(padded=True, capacity=0.75, policy="position", mode="balanced"),
    RaggedCase(padded=True, shuffle=True),
    RaggedCase(padded=True, all_to_all=False, mode="balanced"),
    RaggedCase(padded=True, dedup=True, mode="aux_loss"),
]
PAD_CONTENT = [
    RaggedCase(mode="sinkhorn"),
    RaggedCase(capacity=0.5, mode="aux_loss"),
    RaggedCase(capacity=0.5, policy="position", mode="balanced"),
    RaggedCase(shuffle=True),
    RaggedCase(all_to_all=False, mode="sinkhorn"),
    RaggedCase(dedup=True, mode="none"),
]


def test_ragged_lengths_match_data_parallel() -> None:
    spawn(run_ragged, 4, RAGGED)


def test_padded_ragged_batches_match_data_parallel() -> None:
    spawn(run_ragged, 4, PADDED)


def test_pad_content_changes_nothing_under_expert_parallelism() -> None:
    spawn(run_pad_content, 2, PAD_CONTENT)


@pytest.mark.parametrize("shuffle", [False, True])
def test_router_logits_under_expert_parallelism(shuffle: bool) -> None:
    spawn(run_router_logits, 2, shuffle)
