"""Published folders through the documented path: ``from_pretrained(folder)`` in ``configure_model``
and ``ExpertParallelStrategy(degree=2)`` on 2 gloo processes (``published_fit_worker.py``).

DeepSeek-V3's FP8 release with its multi-token-prediction layer, a GPTQ release of a Qwen3-MoE
(act-order) and GPT-OSS's MXFP4 experts, each with ``"dtype": "bfloat16"`` in its config: at the
start of training every parameter equals the folder dequantized (transformers' own fp32 load, or a
dequantization by hand where transformers does not dequantize the format) bit for bit (under
``bf16-mixed`` the parameters are fp32 master weights, whatever dtype the config names), the
multi-token-prediction weights are named once (on rank 0) as ignored, and two steps train. The same
folders, and llm-compressor's FP8 of a Qwen3-MoE (groups of 16) and a bitsandbytes NF4 one, with
their experts frozen and kept as published (``frozen_experts="fp8"`` / ``"mxfp4"`` / ``"nf4"``) at
degree 1, each rank holding half of every expert's bytes: the experts gathered and dequantized equal
that reference bit for bit too, and the setup table says where their bytes are split.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from families_workers import tiny_family
from published import (
    dequantized_by_hand,
    edit_config,
    write_compressed_fp8,
    write_fp8,
    write_mxfp4,
    write_shards,
)
from published_int import (
    bnb4_dequantized,
    gptq_dequantized,
    write_bnb4,
    write_gptq,
)

WORKER = Path(__file__).with_name("published_fit_worker.py")
FORKRUN = [sys.executable, str(Path(__file__).parents[1] / "forkrun.py")]

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformers_state(folder: Path) -> dict[str, torch.Tensor]:
    """transformers' dequantized fp32 load of ``folder``; of its tensors dequantized by hand (saved
    beside it) where transformers does not dequantize the format (compressed-tensors' groups, GPTQ,
    bitsandbytes' 4-bit per-expert layers)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
    kwargs = {}
    by_hand = {"bitsandbytes": bnb4_dequantized, "gptq": gptq_dequantized, "compressed-tensors": dequantized_by_hand}
    if method in by_hand:
        hand = folder.with_name("by_hand")
        shutil.copytree(folder, hand)
        tensors = by_hand[method](folder)
        write_shards({k: v.contiguous() for k, v in tensors.items()}, hand, shards=1)
        edit_config(hand, quantization_config=None)
        folder = hand
    else:
        fp8 = method == "fp8"
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True) if fp8 else Mxfp4Config(dequantize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return model.float().state_dict()  # transformers 5.17 keeps the unquantized weights in bf16 (exact in fp32)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "gpt_oss"])
def test_fit_from_a_published_folder(model_type: str, tmp_path: Path) -> None:
    model = tiny_family(model_type, seed=3)
    if model_type == "deepseek_v3":
        folder = write_fp8(model, tmp_path / "hf", block=(8, 8), mtp=True)
    elif model_type == "qwen3_moe":  # Qwen's GPTQ-Int4 releases: act-order, groups of 32 here
        folder = write_gptq(model, tmp_path / "hf", bits=4, group=32, act_order=True)
    else:
        folder = write_mxfp4(model, tmp_path / "hf")
    edit_config(folder, dtype="bfloat16")  # as the releases say; the fp32 master weights must not follow it
    torch.save(transformers_state(folder), tmp_path / "reference.pt")
    out = tmp_path / "result.json"
    cmd = [
        *FORKRUN, "--nproc-per-node=2", f"--master-port={_free_port()}", str(WORKER),
        str(folder), str(tmp_path / "reference.pt"), str(out), "bf16-mixed",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["differ"] == [] and len(result["equal"]) == len(list(model.parameters()))
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    if model_type == "deepseek_v3":
        rank0, rank1 = result["ignored"]
        assert len(rank0) == 1 and "multi-token-prediction weights" in rank0[0] and rank1 == []


@pytest.mark.parametrize(
    ("model_type", "fmt"), [("deepseek_v3", "fp8"), ("qwen3_moe", "fp8"), ("qwen3_moe", "nf4"), ("gpt_oss", "mxfp4")]
)
def test_fit_from_a_published_folder_with_its_experts_kept_as_published(
    model_type: str, fmt: str, tmp_path: Path
) -> None:
    model = tiny_family(model_type, seed=3, **({"moe_intermediate_size": 64} if fmt == "nf4" else {}))
    if model_type == "deepseek_v3":
        folder = write_fp8(model, tmp_path / "hf", block=(8, 8), mtp=True)
    elif fmt == "nf4":  # a bitsandbytes load_in_4bit release: NF4 with double-quantized absmax
        folder = write_bnb4(model, tmp_path / "hf")
    elif model_type == "qwen3_moe":  # llm-compressor's FP8 in groups of 16: kept as blocks of 1 x 16
        folder = write_compressed_fp8(model, tmp_path / "hf", "group", group=16)
    else:
        folder = write_mxfp4(model, tmp_path / "hf")
    torch.save(transformers_state(folder), tmp_path / "reference.pt")
    out = tmp_path / "result.json"
    cmd = [
        *FORKRUN, "--nproc-per-node=2", f"--master-port={_free_port()}", str(WORKER),
        str(folder), str(tmp_path / "reference.pt"), str(out), "bf16-mixed", fmt,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert "each expert's bytes split over 2 ranks" in run.stdout + run.stderr
    result = json.loads(out.read_text())
    frozen = [name for name in result["equal"] if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert result["differ"] == [] and len(result["equal"]) == len(list(model.parameters()))
    assert len(frozen) == 2 * sum(1 for name, _ in model.named_parameters() if name.endswith("experts.down_proj"))
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
