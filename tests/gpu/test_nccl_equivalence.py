"""Expert parallelism under NCCL on 2 GPUs: the same equivalence as the gloo suite.

fp32 runs the per-expert loop (grouped_mm on CUDA takes bf16), bf16 the grouped GEMM path; both
against data parallelism of the unsharded model on one GPU. bf16 tolerances: 8 mantissa bits,
sums of ~100 terms in different orders, so 2e-2 relative.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from harness import spawn
from workers import Case, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

FP32 = [
    Case(degree=1, device="cuda"),
    Case(degree=2, device="cuda"),
    Case(degree=2, device="cuda", all_to_all=False),
    Case(degree=2, device="cuda", mode="sinkhorn"),
    Case(degree=2, device="cuda", shuffle=True),
    Case(degree=2, device="cuda", skew=True),
    Case(degree=2, device="cuda", dedup=True),
    Case(degree=2, device="cuda", symm=True),
    Case(degree=2, device="cuda", symm=True, skew=True, mode="aux_loss"),
    Case(degree=2, device="cuda", symm=True, budget=1000, skew=True),
]
BF16 = [
    Case(degree=2, device="cuda", dtype="bfloat16", rtol=2e-2),
    Case(degree=2, device="cuda", dtype="bfloat16", rtol=2e-2, all_to_all=False, mode="aux_loss"),
    # One step: in bf16 a second step flips top-4 choices, deduplicated or not.
    Case(degree=2, device="cuda", dtype="bfloat16", rtol=2e-2, top_k=4, dedup=True, steps=1),
    Case(degree=2, device="cuda", dtype="bfloat16", rtol=2e-2, symm=True),
    Case(degree=2, device="cuda", dtype="bfloat16", rtol=2e-2, symm=True, budget=1000),
]


@pytest.mark.parametrize("cases", [FP32, BF16], ids=["fp32", "bf16"])
def test_two_gpus_match_data_parallel(cases: list[Case]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    spawn(run_cases, 2, cases, backend="nccl")
