"""Dense parameters of a one-rank world used in place (``lightning_ep.parallel.single_rank``), gloo:
FSDP2's numbers bit for bit (``single_rank_workers.py``)."""

from __future__ import annotations

import pytest
from harness import spawn
from single_rank_workers import (
    run_in_place_follows_new_weights,
    run_in_place_is_freed_with_its_model,
    run_in_place_matches_fsdp2,
    run_in_place_refused_above_one_rank,
)

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("precision", "tied"), [("32-true", False), ("bf16-mixed", False), ("bf16-mixed", True), ("bf16-true", False)]
)
def test_in_place_matches_fsdp2(precision: str, tied: bool) -> None:
    spawn(run_in_place_matches_fsdp2, 1, precision, tied)


def test_in_place_follows_new_weights() -> None:
    spawn(run_in_place_follows_new_weights, 1)


def test_in_place_is_freed_with_its_model() -> None:
    spawn(run_in_place_is_freed_with_its_model, 1)


def test_in_place_is_refused_above_one_rank() -> None:
    spawn(run_in_place_refused_above_one_rank, 2)
