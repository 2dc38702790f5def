"""Every supported family at degree 2 under NCCL on 2 GPUs; the shared experts' overlap and the kept
exchanges of activation checkpointing there.

The same checks as the gloo suite (``tests/distributed/test_families_ep.py``, ``test_overlap.py``)
on CUDA: loss and every full gradient of data parallelism of the untouched model within 1e-5
(fp32, TF32 off); the shared experts run inside the dispatch exchange's window and match running
them after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from families_workers import FAMILY_NAMES, run_families_cuda
from harness import spawn
from overlap_workers import run_shared_overlap
from recompute_workers import run_keep_all_to_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def test_families_at_degree_2_nccl() -> None:
    spawn(run_families_cuda, 2, list(FAMILY_NAMES), backend="nccl")


def test_shared_experts_overlap_the_dispatch_nccl() -> None:
    spawn(run_shared_overlap, 2, ["qwen2_moe", "deepseek_v3"], "cuda", backend="nccl")


def test_keep_all_to_all_nccl() -> None:
    spawn(run_keep_all_to_all, 2, False, "cuda", backend="nccl")
