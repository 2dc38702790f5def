"""``MoEConfig.cuda_graphs`` on 2 GPUs (NCCL): the replayed layers give the eager layers' bits."""

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def test_layer_replays_without_host_syncs_and_equals_eager() -> None:
    spawn(run_layer_replays_without_syncs, 2, backend="nccl")


def test_model_with_cuda_graphs_equals_eager_under_fsdp2() -> None:
    spawn(run_model_matches_eager, 2, backend="nccl")


def test_fp32_experts_refuse_cuda_graphs_at_capture() -> None:
    spawn(run_fp32_experts_refuse_graphs, 2, backend="nccl")


def test_capture_after_release_while_a_pool_tensor_lives() -> None:
    spawn(run_capture_again_after_release, 2, backend="nccl")
