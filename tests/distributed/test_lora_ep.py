"""PEFT's LoRA under expert parallelism on 2 and 4 gloo processes: same math as PEFT on one process.

At ``(world, degree, replicate)`` = (2,1,1), (2,2,1), (4,2,1), (4,4,1), (4,2,2), a tiny Mixtral and
a tiny Qwen3-MoE wrapped by ``peft.get_peft_model`` (LoRA on the attention projections and on both
expert weights) under ``transform(mesh=...)`` + ``shard_model`` give the loss and every LoRA gradient
of PEFT's model on one process fed every rank's micro-batch (averaged), within 1e-5 (fp32); the
expert factors are sharded with the experts, and the frozen weights get no gradient and no AdamW
state (see ``lora_workers.check_lora_layout``). One spawn per world size.
"""

from __future__ import annotations

import pytest
from harness import spawn
from lora_workers import run_lora_bf16, run_lora_layouts

pytestmark = pytest.mark.distributed


def test_lora_on_2_processes() -> None:
    spawn(run_lora_layouts, 2, [(1, 1), (2, 1)], ["mixtral", "qwen3_moe"])


def test_lora_on_4_processes() -> None:
    spawn(run_lora_layouts, 4, [(2, 1), (4, 1), (2, 2)], ["mixtral", "qwen3_moe"])


def test_lora_fine_grained_in_bf16_with_activation_checkpointing() -> None:
    spawn(run_lora_bf16, 2, ["olmoe", "qwen3_moe"])
