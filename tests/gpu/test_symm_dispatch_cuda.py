"""``Execution(exchange="symmetric_memory")`` on 2 GPUs (NCCL), and the padded all-to-all
(``Execution(row_budget=...)``) on 1 and 2: bit for bit the all-to-all dispatcher, no host sync.

The full-model equivalence against data parallelism runs in ``test_nccl_equivalence.py`` (cases with
``symm=True``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from harness import spawn
from symm_workers import (
    run_padded_matches_all_to_all,
    run_static_plan_matches_all_to_all,
    run_step_checks_stop_an_over_budget_step,
    run_symm_matches_all_to_all,
)

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@one_gpu
def test_padded_all_to_all_on_one_gpu_is_sync_free_and_exact() -> None:
    spawn(run_padded_matches_all_to_all, 1, backend="nccl")


@two_gpus
def test_padded_all_to_all_on_two_gpus_is_sync_free_and_exact() -> None:
    spawn(run_padded_matches_all_to_all, 2, backend="nccl")


@two_gpus
def test_symmetric_memory_dispatch_equals_all_to_all() -> None:
    spawn(run_symm_matches_all_to_all, 2, backend="nccl")


@two_gpus
def test_static_plan_with_a_row_budget_is_sync_free_and_exact() -> None:
    spawn(run_static_plan_matches_all_to_all, 2, backend="nccl")


@two_gpus
def test_step_checks_stop_a_step_over_the_row_budget() -> None:
    spawn(run_step_checks_stop_an_over_budget_step, 2, backend="nccl")
