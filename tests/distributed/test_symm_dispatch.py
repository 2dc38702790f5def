"""``Execution(exchange="symmetric_memory")`` on 2 gloo processes: refused before any token moves.

The dispatch itself needs CUDA GPUs of one node: ``tests/gpu/test_symm_dispatch_cuda.py``; its index
plan is checked on the CPU in ``tests/unit/test_dispatch_symm.py``.
"""

from __future__ import annotations

import pytest
from graph_workers import run_sharded_experts_refuse_graphs
from harness import spawn
from symm_workers import run_gloo_rejects

pytestmark = pytest.mark.distributed


def test_gloo_group_is_refused_with_the_fix() -> None:
    spawn(run_gloo_rejects, 2)


def test_cuda_graphs_refuse_experts_sharded_by_fsdp2() -> None:
    spawn(run_sharded_experts_refuse_graphs, 2)
