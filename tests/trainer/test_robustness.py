"""Robustness through the Trainer: non-finite values, interrupted checkpoint saves, determinism."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import kill_tree
from test_strategy import WORKER, _free_port, assert_close, run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("accumulate", [1, 2])
def test_non_finite_router_input_stops_every_rank(tmp_path: Path, accumulate: int) -> None:
    """One poisoned micro-batch on one rank stops every rank before the optimizer step, also when it
    is the first of two accumulated micro-batches (the flags are kept until the step)."""
    out = tmp_path / "poison.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
        str(WORKER), "--out", str(out), "--degree", "2", "--poison-step", "1", "--accumulate", str(accumulate),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and not out.exists()
    message = "non-finite router logits or outputs in MoE layer(s) [1] at global step 1"
    assert result.stderr.count(message) >= 2, result.stderr[-4000:]  # both ranks stop, not only the poisoned one


def test_killed_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while step 3's checkpoint is being written: step 2's stays loadable and resuming from it
    reproduces the uninterrupted run; the interrupted one is left as `.partial` and refused."""
    uninterrupted = run(tmp_path, "uninterrupted", "--degree", "2")
    template = str(tmp_path / "ck-{step}")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={_free_port()}",
        str(WORKER), "--out", str(tmp_path / "killed.json"), "--degree", "2",
        "--save-at", "2,3", "--save-to", template, "--slow-save-from", "3",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = tmp_path / "ck-3.partial"
    deadline = time.monotonic() + 240
    try:
        while not (partial / ".metadata").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
    finally:
        # torchrun and its workers, which torchrun starts in sessions of their own (a process-group
        # kill misses them); the workers are listed before torchrun dies and they are re-parented.
        kill_tree(proc.pid)
        proc.wait(timeout=60)

    assert (tmp_path / "ck-2").is_dir() and not (tmp_path / "ck-3").exists() and partial.is_dir()
    resumed = run(tmp_path, "resumed", "--degree", "2", "--resume", str(tmp_path / "ck-2"))
    assert_close(resumed["losses"], uninterrupted["losses"][2:], rtol=1e-6)
    out = tmp_path / "from-partial.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
        str(WORKER), "--out", str(out), "--degree", "2", "--resume", str(partial),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "is incomplete: the run was interrupted while saving it" in result.stderr


def test_deterministic_runs_are_bitwise_identical(tmp_path: Path) -> None:
    first = run(tmp_path, "det1", "--degree", "2", "--mode", "sinkhorn", "--deterministic")
    second = run(tmp_path, "det2", "--degree", "2", "--mode", "sinkhorn", "--deterministic")
    assert first["losses"] == second["losses"]


def test_checkpoint_from_a_different_model_is_refused(tmp_path: Path) -> None:
    """The checkpoint's MoE record refuses another expert count before any weight is read; allowed
    by name, the weights themselves do not fit, which is refused as well."""
    run(tmp_path, "eight", "--degree", "2", "--steps", "2", "--save-to", str(tmp_path / "ck-{step}"), nproc=2)
    checkpoint = tmp_path / "ck-2"
    stderr = {}
    for name, allow in (("four", ()), ("four-allowed", ("--allow", "num_experts"))):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
            str(WORKER), "--out", str(tmp_path / f"{name}.json"), "--degree", "2", "--experts", "4",
            "--resume", str(checkpoint), *allow,
        ]  # fmt: skip
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode != 0
        stderr[name] = result.stderr
    assert (
        f"checkpoint {str(checkpoint)!r} was saved with another MoE configuration: the model's num_experts=8 "
        "(this run: 4). Resume with the MoEConfig and model it was saved with; to change them on purpose"
    ) in stderr["four"], stderr["four"][-3000:]
    assert "allow_moe_config_change=['num_experts']" in stderr["four"]
    # In full once (rank 0); rank 1, if torchrun had not stopped it yet, adds a one-line note.
    assert stderr["four"].count("was saved with another MoE configuration") == 1, stderr["four"][-3000:]
    assert stderr["four"].count("[rank 1] ValueError: a configuration error, shown in full by rank 0.") <= 1
    allowed = stderr["four-allowed"]
    assert "was saved from a different model (Size mismatch between saved torch.Size([8, 64])" in allowed
    assert "Resume with the model configuration it was saved from" in allowed
