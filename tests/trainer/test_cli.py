"""LightningCLI: the example YAML parses, `--print_config` round-trips, and `fit` runs from it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune.py"
CONFIG = ROOT / "examples" / "configs" / "cpu_tiny.yaml"

pytestmark = pytest.mark.distributed


def _cli(cwd: Path, *args: str, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout


def _strip_header(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# lightning"))


@pytest.mark.parametrize("config", ["cpu_tiny.yaml", "gpu_mixtral.yaml"])
def test_print_config_round_trips(tmp_path: Path, config: str) -> None:
    first = _cli(tmp_path, "fit", "--config", str(CONFIG.with_name(config)), "--print_config")
    (tmp_path / "printed.yaml").write_text(first)
    second = _cli(tmp_path, "fit", "--config", str(tmp_path / "printed.yaml"), "--print_config")
    assert _strip_header(first) == _strip_header(second)
    strategy = yaml.safe_load(first)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_ep.ExpertParallelStrategy"
    expected = {"cpu_tiny.yaml": (2, "aux_loss", False), "gpu_mixtral.yaml": (8, "aux_loss", True)}[config]
    args = strategy["init_args"]
    assert (args["degree"], args["moe"]["moe_load_balancing"], args["activation_checkpointing"]) == expected


def test_fit_two_steps_from_example_yaml(tmp_path: Path) -> None:
    _cli(tmp_path, "fit", "--config", str(CONFIG), "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1")
    rows = list(csv.DictReader(next((tmp_path / "runs" / "tiny").rglob("metrics.csv")).open()))
    assert any(r.get("moe/aux_loss") for r in rows) and any(r.get("train_loss") for r in rows)
    export = tmp_path / "runs" / "tiny" / "hf"
    assert (export / "config.json").is_file()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.num_local_experts == 8 and model.config.vocab_size == 256
