"""Under torchrun every rank builds the Trainer: a configuration error is shown in full once (rank 0)
and as a one-line note by each other rank, at Trainer construction and in the strategy's setup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_strategy import WORKER, _free_port

pytestmark = pytest.mark.distributed

NOTE = "[rank {rank}] ValueError: a configuration error, shown in full by rank 0."


def _torchrun(tmp: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
        str(WORKER), "--out", str(tmp / "never.json"), *args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def _assert_shown_once(result: subprocess.CompletedProcess[str], message: str, nproc: int) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert output.count(message) == 1, output[-6000:]  # rank 0's, once
    # One traceback from the workers (rank 0's); torchrun adds its own ChildFailedError summary.
    worker_tracebacks = output.count("Traceback (most recent call last)") - output.count("ChildFailedError:")
    assert worker_tracebacks == 1, output[-6000:]
    # The other ranks' notes, however far they got before torchrun stopped them once rank 0 failed.
    assert all(output.count(NOTE.format(rank=r)) <= 1 for r in range(1, nproc)), output[-6000:]
    assert "Root Cause (first observed failure):\n[0]:" in output, output[-3000:]


def test_bad_degree_at_trainer_construction_is_shown_once(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, 2, "--degree", "3")
    message = (
        "ValueError: ExpertParallelStrategy(degree=3, replicate_degree=1) with Trainer(devices=2, num_nodes=1): "
        "degree=3 does not divide the world size 2; choose one of [1, 2]."
    )
    _assert_shown_once(result, message, 2)
    assert "Initializing distributed" not in result.stdout + result.stderr  # before any process group


def test_two_moe_models_refused_in_setup_is_shown_once(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, 2, "--degree", "2", "--frozen-copy")
    message = (
        "ValueError: ExpertParallelStrategy(moe_model=None): Module holds 2 MoE models, at ['model', 'frozen']; "
        "name the one to parallelise by its attribute path, e.g. ExpertParallelStrategy(moe_model='model')."
    )
    _assert_shown_once(result, message, 2)
