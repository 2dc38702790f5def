"""Frozen expert weights kept in FP8 and MXFP4 under expert parallelism, on 2 gloo processes.

A tiny PEFT LoRA Mixtral (adapters on attention and on both expert weights), its base weights read
from a bf16 folder by ``load_pretrained_sharded`` with the experts quantized on the rank that holds
them: at degree 2 (each rank quantizes its 4 experts) and at degree 1 (every rank holds all experts,
its LoRA factors sharded by FSDP2 over the 2 ranks), every rank's quantized bytes equal the
one-process model's, and the loss and every LoRA gradient equal the one-process model's fed both
ranks' micro-batches (averaged) within 1e-5 (fp32; the same dequantized operands, the sums grouped
otherwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from frozen_workers import run_frozen
from harness import spawn
from lora_workers import tiny_base

pytestmark = pytest.mark.distributed


def test_frozen_experts_on_2_processes(tmp_path: Path) -> None:
    tiny_base("mixtral").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    spawn(run_frozen, 2, str(tmp_path / "bf16"), [("fp8", 2), ("mxfp4", 2), ("fp8", 1)])
