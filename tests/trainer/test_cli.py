"""LightningCLI: the example YAML parses, `--print_config` round-trips, and `fit` runs from it,
quietly: no warning from this library or the example, and a progress bar in steps."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune.py"
CONFIG = ROOT / "examples" / "configs" / "cpu_tiny.yaml"

pytestmark = pytest.mark.distributed


def _run(cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _cli(cwd: Path, *args: str, timeout: int = 600) -> str:
    return _run(cwd, *args, timeout=timeout).stdout


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


@pytest.fixture(scope="module")
def two_step_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The main job of the README for 2 steps, once for the tests below: its folder and its output."""
    cwd = tmp_path_factory.mktemp("fit")
    args = ("fit", "--config", str(CONFIG), "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1")
    return cwd, _run(cwd, *args)


def test_fit_two_steps_from_example_yaml(two_step_fit: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    cwd, result = two_step_fit
    rows = list(csv.DictReader(next((cwd / "runs" / "tiny").rglob("metrics.csv")).open()))
    assert any(r.get("moe/aux_loss") for r in rows) and any(r.get("train_loss") for r in rows)
    export = cwd / "runs" / "tiny" / "hf"
    assert (export / "config.json").is_file()
    # The end of the run says where everything landed, and those places exist.
    for label in ("checkpoint", "Hugging Face export", "metrics", "expert-load plots"):
        path = re.search(rf"^{label}: (.+)$", result.stdout, re.MULTILINE)
        assert path is not None, f"no {label!r} line in:\n{result.stdout[-2000:]}"
        assert (cwd / path.group(1)).exists(), path.group(0)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.num_local_experts == 8 and model.config.vocab_size == 256


# A warning line as Python prints it (`path:line: Category: message`) or as Lightning does (no category).
_WARNING_LINE = re.compile(r"^(?P<path>\S+\.py):\d+: (?P<message>.*)$", re.MULTILINE)
# Framework warnings that this library's own calls used to cause.
_AVOIDABLE = ("Slicing a flattened dim", "`weights_only` was not set")


def test_main_job_prints_no_warning_of_its_own(two_step_fit: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    _, result = two_step_fit
    output = result.stdout + result.stderr
    ours = [
        m.group(0)
        for m in _WARNING_LINE.finditer(output)
        if "lightning_ep" in Path(m.group("path")).parts or "examples" in Path(m.group("path")).parts
    ]
    assert not ours, "warnings from lightning_ep or the example:\n" + "\n".join(ours)
    assert not [text for text in _AVOIDABLE if text in output], output[-4000:]
    assert "Warning" not in result.stdout, result.stdout[-3000:]
    # The bar counts optimizer steps out of max_steps and shows the losses, not "Epoch 0/-2 ... v_num".
    assert re.search(r"step: 100%\S* 2/2 \[.*train_loss=.*moe/aux_loss=.*moe/z_loss=", result.stdout)
    assert "/-2" not in result.stdout and "v_num" not in result.stdout
