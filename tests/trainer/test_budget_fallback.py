"""A static row budget under the Trainer: routing skewed past it is never an error, and the step
that went over runs again on the dynamic plan, so the run equals the dynamic plan's bit for bit.

Two gloo ranks at degree 2 (``budget_fit_worker.py``): router jitter and attention dropout draw
random numbers, the ``"balanced"`` bias counts the loads, and the first MoE layer sends every token
to experts 0 and 1 (both on rank 0) at optimizer steps 1 and 3.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_strategy import FORKRUN, _free_port

WORKER = Path(__file__).with_name("budget_fit_worker.py")

pytestmark = pytest.mark.distributed


def _fit(tmp: Path, budget: str) -> list[tuple[dict, dict]]:
    out = tmp / budget
    out.mkdir()
    cmd = [*FORKRUN, "--nproc-per-node=2", f"--master-port={_free_port()}", str(WORKER), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [*cmd, "--row-budget", budget], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{budget}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return [(json.loads((out / f"rank{r}.json").read_text()), torch.load(out / f"rank{r}.pt")) for r in (0, 1)]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[dict, dict]]]:
    tmp = tmp_path_factory.mktemp("budget")
    return {budget: _fit(tmp, budget) for budget in ("none", "auto", "24")}


@pytest.mark.parametrize("budget", ["auto", "24"])
def test_over_budget_steps_rerun_to_the_dynamic_plans_numbers(fits: dict, budget: str) -> None:
    for (want, want_weights), (got, got_weights) in zip(fits["none"], fits[budget], strict=True):
        assert got["dispatchers"] == ["PaddedAllToAllDispatcher"] * 2
        assert want["dispatchers"] == ["AllToAllDispatcher"] * 2
        assert set(got_weights) == set(want_weights)
        for name, value in want_weights.items():
            assert torch.equal(got_weights[name], value), name
        # What training_step logged, once per step, from the run that counted.
        assert [s["train_loss_step"] for s in got["logged"]] == [s["train_loss_step"] for s in want["logged"]]
        assert got["epoch"]["train_loss_epoch"] == want["epoch"]["train_loss_epoch"]
        assert got["epoch"]["calls"] == want["epoch"]["calls"] == 4.0
        assert all("moe/budget_reruns" not in s for s in want["logged"])


def test_an_automatic_budget_grows_once_and_a_forced_one_stays(fits: dict) -> None:
    for auto, _ in fits["auto"]:
        # Sized by the first step; step 1 went over and grew it to fit, so step 3 fits.
        assert [s["moe/budget_reruns"] for s in auto["logged"]] == [0.0, 1.0, 1.0, 1.0]
        first, second = auto["budgets"]
        assert first > second and first % 8 == 0 and second % 8 == 0, auto["budgets"]
        assert len(auto["losses"]) == 4  # training_step ran once per step: only the model forward ran again
    for forced, _ in fits["24"]:
        assert [s["moe/budget_reruns"] for s in forced["logged"]] == [1.0, 2.0, 3.0, 4.0]
        assert forced["budgets"] == [24, 24]
