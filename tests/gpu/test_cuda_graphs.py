"""``Execution(cuda_graphs=True)`` (``LayerExecution``) on 1 GPU (the local dispatch) and 2 GPUs (the
symmetric-memory exchange's static plan, NCCL): the replayed layers give the eager layers' bits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from graph_workers import (
    run_capture_again_after_release,
    run_fp32_experts_refuse_graphs,
    run_layer_replays_without_syncs,
    run_model_matches_eager,
)
from harness import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
# Degree 1 (one GPU, the local dispatch) and degree 2 (the symmetric-memory dispatch).
WORLDS = [1, pytest.param(2, marks=two_gpus)]


@pytest.mark.parametrize("world", WORLDS)
def test_layer_replays_without_host_syncs_and_equals_eager(world: int) -> None:
    spawn(run_layer_replays_without_syncs, world, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_model_with_cuda_graphs_equals_eager_under_fsdp2(world: int) -> None:
    spawn(run_model_matches_eager, world, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_fp32_experts_refuse_cuda_graphs_at_capture(world: int) -> None:
    spawn(run_fp32_experts_refuse_graphs, world, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_capture_after_release_while_a_pool_tensor_lives(world: int) -> None:
    spawn(run_capture_again_after_release, world, backend="nccl")
