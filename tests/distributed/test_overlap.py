"""The all-to-all dispatch overlaps the shared experts, on 2 gloo processes.

``start_all_to_all`` / ``finish_all_to_all`` equal the plain all-to-all in values and gradients, and
what is computed between them runs while the exchange is outstanding, in forward and in backward
(autograd runs later-created nodes first). In Qwen2-MoE and DeepSeek-V3 models at degree 2 the
shared experts run inside that window (combine is the only other all-to-all: it brackets nothing),
with bitwise the results of running them after the rows arrived.
"""

from __future__ import annotations

import pytest
from harness import spawn
from overlap_workers import run_shared_overlap, run_start_finish

pytestmark = pytest.mark.distributed


def test_start_finish_all_to_all() -> None:
    spawn(run_start_finish, 2)


def test_shared_experts_overlap_the_dispatch() -> None:
    spawn(run_shared_overlap, 2, ["qwen2_moe", "deepseek_v3"])
