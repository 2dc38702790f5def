"""Frozen expert weights kept in FP8 and MXFP4 under expert parallelism, on 2 and 4 gloo processes.

Tiny PEFT LoRA models (Mixtral with adapters on attention and on both expert weights; GPT-OSS with
adapters on attention), their base weights read by ``load_pretrained_sharded``:

- from a bf16 folder, the experts quantized on the rank that holds them: at degree 2 (each rank
  quantizes its 4 experts) and at degree 1 (each rank holds half of every expert's rows, as FSDP2
  holds half of its LoRA factors, and quantizes the whole FP8 blocks covering them; blocks of 24 rows
  straddle the two ranks' halves);
- from an FP8 folder (DeepSeek-V3's layout, blocks of 16; AutoFP8's, one scale per expert matrix
  spread over blocks of 16), an MXFP4 one (GPT-OSS's) and a bitsandbytes NF4 one (a Mixtral with
  experts 64 wide), each rank's rows of the published bytes copied as they are; the MXFP4 one into
  NF4, dequantized and quantized again on the rank that holds the rows.

Every rank's bytes equal the one-process model's rows it holds, its gathered experts equal the
one-process model's whole, and the loss and every LoRA gradient equal the one-process model's fed
every rank's micro-batch (averaged) within 1e-5 (fp32; the same dequantized operands, the sums
grouped otherwise). On 4 processes at degree 2, experts split on both axes. A DCP checkpoint saved at
degree 2 loads at degree 1 (the bytes split) and back, each rank holding exactly its rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_mixtral
from families_workers import tiny_family
from frozen_workers import GPT_OSS, run_frozen, run_initialised, run_resharded
from harness import spawn
from lora_workers import tiny_base
from published import (
    write_autofp8,
    write_fp8,
    write_mxfp4,
)
from published_int import (
    write_bnb4,
)

pytestmark = pytest.mark.distributed

BLOCK = (128, 128)


def _folders(root: Path) -> Path:
    tiny_base("mixtral").to(torch.bfloat16).save_pretrained(root / "bf16")
    write_fp8(tiny_base("mixtral"), root / "fp8", block=(16, 16))
    write_autofp8(tiny_base("mixtral"), root / "autofp8")
    write_bnb4(tiny_mixtral(0, intermediate_size=64), root / "bnb4")
    write_mxfp4(tiny_family("gpt_oss", **GPT_OSS), root / "mxfp4")
    return root


def test_frozen_experts_on_2_processes(tmp_path: Path) -> None:
    cases = [
        ("mixtral", "fp8", 2, "bf16", BLOCK),
        ("mixtral", "mxfp4", 2, "bf16", BLOCK),
        ("mixtral", "fp8", 1, "bf16", BLOCK),
        ("mixtral", "fp8", 1, "bf16", (24, 24)),
        ("mixtral", "mxfp4", 1, "bf16", BLOCK),
        ("mixtral", "fp8", 1, "fp8", (16, 16)),
        ("mixtral", "fp8", 1, "autofp8", (16, 16)),
        ("mixtral64", "nf4", 1, "bnb4", BLOCK),
        ("gpt_oss", "mxfp4", 1, "mxfp4", BLOCK),
        ("gpt_oss", "nf4", 1, "mxfp4", BLOCK),
    ]
    spawn(run_frozen, 2, str(_folders(tmp_path)), cases)


def test_frozen_experts_on_4_processes(tmp_path: Path) -> None:
    cases = [
        ("mixtral", "fp8", 2, "bf16", (24, 24)),
        ("gpt_oss", "mxfp4", 2, "mxfp4", BLOCK),
        ("gpt_oss", "nf4", 2, "mxfp4", BLOCK),
        ("mixtral64", "nf4", 2, "bnb4", BLOCK),
    ]
    spawn(run_frozen, 4, str(_folders(tmp_path)), cases)


def test_frozen_checkpoint_loads_at_another_degree(tmp_path: Path) -> None:
    spawn(run_resharded, 2, str(_folders(tmp_path)))


def test_split_random_init_equals_one_process() -> None:
    spawn(run_initialised, 2)
