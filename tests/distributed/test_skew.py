"""Skewed routing at degree 4: dropless survives with bounded memory, a token budget fails fast."""

from __future__ import annotations

import pytest
from harness import spawn
from skew_workers import run_budget_fails_fast, run_skew_survives

pytestmark = pytest.mark.distributed


def test_all_tokens_to_one_expert_survives_dropless() -> None:
    spawn(run_skew_survives, 4)


def test_token_budget_fails_fast_on_every_rank() -> None:
    spawn(run_budget_fails_fast, 4)
