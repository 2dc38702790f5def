"""The all-to-all padded to a row budget, at degree 2 and 4 on gloo (``padded_workers.py``)."""

from __future__ import annotations

import pytest
from harness import spawn
from padded_workers import run_execution_given_again_rebuilds_the_dispatchers, run_padded_matches_dynamic

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4])
def test_padded_all_to_all_matches_dynamic(world: int) -> None:
    spawn(run_padded_matches_dynamic, world)


def test_execution_given_again_rebuilds_the_dispatchers() -> None:
    spawn(run_execution_given_again_rebuilds_the_dispatchers, 2)
