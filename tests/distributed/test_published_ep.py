"""Published Hugging Face layouts loaded into sharded models on 2 and 4 gloo processes.

DeepSeek-V3's FP8 release (blocks of 16, so partial blocks; E8M0 scales; its multi-token-prediction
layer with per-expert keys; three shard files with an index) and GPT-OSS's MXFP4 experts (hidden
size 96, so that FSDP2's split of the experts' input dimension falls inside a group of 32), at
expert-parallel degree 2 on 2 ranks, and on 4 ranks with ``replicate_degree=2`` and without. Each rank reads only
its own blocks; the reference is the folder dequantized by hand (``published.dequantized_by_hand``),
which ``tests/unit/test_published_layouts.py`` checks against transformers' own load.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from families_workers import tiny_family
from harness import spawn
from published import dequantized_by_hand, write_fp8, write_mxfp4, write_shards
from published_workers import run_published

pytestmark = pytest.mark.distributed


def hand_model(folder: Path, hand: Path) -> torch.nn.Module:
    """transformers' load of the folder's tensors dequantized by hand (names and fusion its own)."""
    import json

    from transformers import AutoModelForCausalLM

    hand.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (hand / "config.json").write_text(json.dumps(config))
    write_shards(dequantized_by_hand(folder), hand, shards=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(hand, dtype=torch.float32)


def cases(tmp_path: Path) -> list[tuple[str, str, str, dict]]:
    deepseek = write_fp8(tiny_family("deepseek_v3", seed=3), tmp_path / "ds", block=(16, 16), e8m0=True, mtp=True)
    oss = write_mxfp4(tiny_family("gpt_oss", seed=3, hidden_size=96), tmp_path / "oss")
    out = []
    for model_type, folder, overrides in (("deepseek_v3", deepseek, {}), ("gpt_oss", oss, {"hidden_size": 96})):
        reference = tmp_path / f"{model_type}_reference.pt"
        torch.save(hand_model(folder, tmp_path / f"{model_type}_hand").state_dict(), reference)
        out.append((model_type, str(folder), str(reference), overrides))
    return out


def test_degree2_on_2_ranks(tmp_path: Path) -> None:
    spawn(run_published, 2, cases(tmp_path), [1])


def test_degree2_on_4_ranks_hsdp_and_expert_data_parallel(tmp_path: Path) -> None:
    """``replicate_degree=2`` (HSDP), then ``replicate_degree=1`` (two expert-data-parallel ranks per
    expert: FSDP2 splits the experts' input dimension, 96 and 32, inside MXFP4 groups of 32)."""
    spawn(run_published, 4, cases(tmp_path), [2, 1])
