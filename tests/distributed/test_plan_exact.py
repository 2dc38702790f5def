"""``lightning_ep.plan`` counts exactly what the strategy's sharding holds, on 2 and 4 gloo processes:
every family at layouts (world, degree, replicate) (2,1,1), (2,2,1), (4,2,1), (4,4,1), (4,2,2)
(see ``plan_workers``)."""

from __future__ import annotations

import pytest
from harness import spawn
from plan_workers import run_plan_checks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world", "layouts"), [(2, [(1, 1), (2, 1)]), (4, [(2, 1), (4, 1), (2, 2)])])
def test_plan_counts_equal_local_shards(world: int, layouts: list[tuple[int, int]]) -> None:
    spawn(run_plan_checks, world, layouts)
