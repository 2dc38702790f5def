"""The chat fine-tune example (``examples/chat_finetune.py``) end to end, and its parts.

The CPU config runs for 30 optimizer steps instead of 150 (2 gloo processes, degree 2): the training
loss falls, the held-out loss is measured before training and after it and falls, and the Hugging
Face export, loaded with ``AutoModelForCausalLM`` and ``AutoTokenizer``, generates a reply to a
chat-templated prompt. On one process: the shipped data and tokenizer are reproducible, assistant
labels are the same from ``{% generation %}`` marks and from rendered prefixes (the path for a model
folder's template without marks, e.g. ChatML), and the GPU config parses.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "chat_finetune.py"
CONFIGS = EXAMPLES / "configs"
DATA = EXAMPLES / "data" / "chat.jsonl"
# A ChatML template as Qwen's chat models ship it: no {% generation %} marks.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _example() -> ModuleType:
    """``examples/chat_finetune.py`` as a module (it imports ``finetune`` from its own folder)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("chat_finetune", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def _conversations(n: int) -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in DATA.read_text().splitlines()[:n]]


@pytest.mark.distributed
def test_cpu_chat_config_learns_validates_and_exports(tmp_path: Path) -> None:
    result = _run(
        tmp_path, "fit", "--config", str(CONFIGS / "cpu_chat.yaml"), "--trainer.max_steps", "30",
        "--trainer.log_every_n_steps", "2",
    )  # fmt: skip
    run = tmp_path / "runs" / "chat"
    rows = list(csv.DictReader(next(run.rglob("metrics.csv")).open()))
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(train) >= 10 and sum(train[-3:]) / 3 < 0.7 * sum(train[:3]) / 3, train
    # The held-out loss: before training (the sanity check runs the whole split) and at step 30.
    held_out = re.search(r"held-out loss per assistant token: ([\d.]+) at step 0 -> ([\d.]+) at step 30", result.stdout)
    assert held_out is not None, result.stdout[-2000:]
    assert float(held_out.group(2)) < 0.7 * float(held_out.group(1))
    assert [float(r["val_loss"]) for r in rows if r.get("val_loss")] == [
        pytest.approx(float(held_out.group(2)), abs=5e-4)
    ]
    assert re.search(r"^  model: .+$", result.stdout, re.MULTILINE), result.stdout[-2000:]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = run / "hf"
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert model.config.model_type == "mixtral" and model.config.vocab_size == len(tokenizer) == 512
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]  # fmt: skip
    assert tokenizer.decode(prompt[0]) == "<|user|>What is 12 + 30?<|end|><|assistant|>"
    with torch.no_grad():
        reply = model.generate(prompt, max_new_tokens=16, do_sample=False)
    new = reply[0, prompt.shape[1] :]
    assert len(new) > 0 and tokenizer.decode(new, skip_special_tokens=True).strip()


def test_shipped_data_and_tokenizer_are_reproducible(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_chat_data", EXAMPLES / "data" / "make_chat_data.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    lines = [json.dumps(c, ensure_ascii=True) for c in make.conversations()]
    assert DATA.read_text().splitlines() == lines
    assert DATA.stat().st_size < 1_000_000
    roles = {m["role"] for line in lines for m in json.loads(line)["messages"]}
    assert roles == {"system", "user", "assistant"}

    example = _example()
    first = example.build_tokenizer(DATA, tmp_path / "a", vocab_size=512)
    example.build_tokenizer(DATA, tmp_path / "b", vocab_size=512)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert len(first) == 512 and first.eos_token == "<|end|>"
    assert first.tokenize("2025") == ["2", "0", "2", "5"]  # one digit a token


def test_assistant_labels_from_marks_and_from_prefixes(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    example = _example()
    example.build_tokenizer(DATA, tmp_path / "tok", vocab_size=512)
    marked = AutoTokenizer.from_pretrained(tmp_path / "tok")
    unmarked = AutoTokenizer.from_pretrained(tmp_path / "tok")
    unmarked.chat_template = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", marked.chat_template)
    chatml = AutoTokenizer.from_pretrained(tmp_path / "tok")
    chatml.chat_template = CHATML
    for messages in _conversations(40):
        by_marks = example.assistant_labels(marked, messages)
        assert example.assistant_labels(unmarked, messages) == by_marks
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        # The labelled runs are exactly the assistant's turns, each with its end token.
        runs = re.findall(r"(?:\d+ ?)+", " ".join(str(t) if t != -100 else "|" for t in by_marks["labels"]))
        assert [marked.decode([int(t) for t in r.split()]) for r in runs] == [f"{r}<|end|>" for r in replies]
        labels = example.assistant_labels(chatml, messages)["labels"]
        runs = re.findall(r"(?:\d+ ?)+", " ".join(str(t) if t != -100 else "|" for t in labels))
        assert [chatml.decode([int(t) for t in r.split()]) for r in runs] == [f"{r}<|im_end|>\n" for r in replies]


def test_gpu_config_parses(tmp_path: Path) -> None:
    import yaml

    printed = _run(tmp_path, "fit", "--config", str(CONFIGS / "gpu_chat.yaml"), "--print_config").stdout
    config = yaml.safe_load("\n".join(line for line in printed.splitlines() if not line.startswith("# lightning")))
    assert config["trainer"]["precision"] == "bf16-mixed"
    assert config["trainer"]["strategy"]["init_args"]["degree"] == 4
    assert config["trainer"]["strategy"]["init_args"]["dither_master_weights"] is True
    assert config["model"]["pretrained"] == config["data"]["tokenizer"]
    assert config["model"]["lr"] == pytest.approx(1e-5) and config["data"]["objective"] == "token_weighted"
