"""LoRA from the example YAML: PEFT in (``get_peft_model`` in ``configure_model``), PEFT out.

``examples/configs/cpu_tiny_lora.yaml`` trains a tiny Mixtral's LoRA adapters (attention and both
expert weights) on 4 gloo processes at degree 2 with activation checkpointing, and exports the merged
model, the base and the adapter in PEFT's format from the live run. The adapter loads with
``PeftModel.from_pretrained(base, folder)`` and gives the merged model's logits, and
``python -m lightning_ep.export CKPT OUT --adapter`` writes the same adapter from the checkpoint.
The same job runs in bf16-mixed and bf16-true on 2 processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune.py"
CONFIG = ROOT / "examples" / "configs" / "cpu_tiny_lora.yaml"

pytestmark = pytest.mark.distributed


def _run(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout + result.stderr


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(32).reshape(2, 16) * 7 % 256
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_lora_example_trains_and_round_trips_through_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _run(tmp_path, str(SCRIPT), "fit", "--config", str(CONFIG), "--trainer.max_steps", "3")
    run = tmp_path / "runs" / "tiny_lora"
    adapter = run / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    factors = load_file(adapter / "adapter_model.safetensors")
    expert_B = [v for k, v in factors.items() if "experts" in k and "lora_B" in k]
    assert expert_B and all(bool(b.abs().max() > 0) for b in expert_B), "the expert adapters did not train"

    merged = _logits(AutoModelForCausalLM.from_pretrained(run / "hf"))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), str(adapter))
    torch.testing.assert_close(_logits(peft_model), merged, rtol=1e-5, atol=1e-5)

    # From the checkpoint, on one process: the same adapter, and the same merged model.
    from_ckpt = tmp_path / "from_ckpt"
    export = ["-m", "lightning_ep.export", str(run / "last.ckpt")]
    _run(tmp_path, *export, str(from_ckpt / "adapter"), "--config", str(run / "hf"), "--adapter")
    _run(tmp_path, *export, str(from_ckpt / "hf"), "--config", str(run / "hf"))
    again = load_file(from_ckpt / "adapter" / "adapter_model.safetensors")
    assert again.keys() == factors.keys()
    for key, value in factors.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(from_ckpt / "hf")), merged)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_lora_example_in_bf16(tmp_path: Path, precision: str) -> None:
    _run(
        tmp_path,
        str(SCRIPT),
        "fit",
        "--config",
        str(CONFIG),
        "--trainer.devices",
        "2",
        "--trainer.precision",
        precision,
        "--trainer.max_steps",
        "2",
        "--trainer.callbacks",
        "null",
        # Lightning's AMP plugin refuses to clip for the example's fused AdamW (it would unscale itself).
        "--trainer.gradient_clip_val",
        "null",
    )


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_lora_on_a_fine_grained_family_through_the_trainer(tmp_path: Path, precision: str) -> None:
    """Qwen3-MoE (many small experts, no shared expert) with LoRA on attention and both expert weights,
    through the example's Trainer run at degree 2 with activation checkpointing, from a saved folder."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    folder = tmp_path / "qwen3"
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    out = _run(
        tmp_path,
        str(SCRIPT),
        "fit",
        "--config",
        str(CONFIG),
        "--model.model",
        "null",
        "--model.pretrained",
        str(folder),
        "--trainer.devices",
        "2",
        "--trainer.precision",
        precision,
        "--trainer.max_steps",
        "2",
        "--trainer.callbacks",
        "null",
        "--trainer.gradient_clip_val",
        "null",
        "--trainer.log_every_n_steps",
        "1",
    )
    assert "Traceback" not in out
    lines = next((tmp_path / "runs" / "tiny_lora").rglob("metrics.csv")).read_text().splitlines()
    column = lines[0].split(",").index("train_loss")
    losses = [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses


def test_lora_example_with_fp8_frozen_experts(tmp_path: Path) -> None:
    """The LoRA example with ``frozen_experts="fp8"`` on 2 processes at degree 2: the setup table says so,
    the adapter round-trips through PEFT against the merged export, the sharded checkpoint exports the
    same merged model, the checkpoint resumes at degree 1,
    and a resume that does not keep the experts in FP8 is refused by name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fp8 = ["--trainer.strategy.init_args.frozen_experts", "fp8"]
    fit = [str(SCRIPT), "fit", "--config", str(CONFIG), "--trainer.devices", "2"]
    out = _run(tmp_path, *fit, "--trainer.max_steps", "3", *fp8)
    assert "frozen_experts  fp8" in out
    run = tmp_path / "runs" / "tiny_lora"
    merged = _logits(AutoModelForCausalLM.from_pretrained(run / "hf"))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), str(run / "adapter"))
    torch.testing.assert_close(_logits(peft_model), merged, rtol=1e-5, atol=1e-5)
    # From the sharded checkpoint, on one process: the same merged model (the FP8 experts dequantized).
    _run(
        tmp_path,
        "-m",
        "lightning_ep.export",
        str(run / "last.ckpt"),
        str(tmp_path / "from_ckpt"),
        "--config",
        str(run / "hf"),
    )
    torch.testing.assert_close(
        _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "from_ckpt")), merged, rtol=0, atol=0
    )

    resume = ["--ckpt_path", str(run / "last.ckpt"), "--trainer.max_steps", "4", "--trainer.callbacks", "null"]
    _run(tmp_path, *fit, *resume, *fp8, "--trainer.strategy.init_args.degree", "1")
    refused = subprocess.run([sys.executable, *fit, *resume], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0
    assert "keeps its frozen expert weights in fp8, this run in the parameters' dtype" in refused.stderr
