"""``dither_master_weights`` on 2 gloo processes: the masters' draws depend on the parameter's name
and the element's global index only, so degree 2 (experts split, dense weights FSDP2-sharded) and
degree 1 (the experts FSDP2-sharded on their second dim) give the one-process masters exactly."""

from __future__ import annotations

import pytest
from dither_workers import run_dither_is_the_same_at_any_layout
from harness import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("degree", [2, 1])
def test_dither_is_the_same_at_any_layout(degree: int) -> None:
    spawn(run_dither_is_the_same_at_any_layout, 2, degree)
