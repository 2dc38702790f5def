"""Resuming through the real Trainer (gloo, ``torchrun``): every balancing mode reproduces the
uninterrupted run, the ``"balanced"`` bias moves by the counts of its own step, and a checkpoint's
MoE record refuses a resume under another MoE configuration unless it is allowed by name.

The uninterrupted runs (4 processes, degree 2, a checkpoint after optimizer step 2 of 4) are shared
by the module; the refusals run on 2 processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from test_strategy import FORKRUN, WORKER, _free_port, assert_close, run

from lightning_ep import ExpertParallelStrategy

pytestmark = pytest.mark.distributed

RATE = 0.001  # MoEConfig.balance_update_rate's default, which fit_worker.py keeps
# Per mode: the uninterrupted run's extra arguments. "balanced" accumulates two micro-batches per step
# and saves a full checkpoint file; the others save sharded (DCP) checkpoints. ("aux_loss" keeps no
# state of its own beyond what "sinkhorn" and "none" resume: its resume is left to them.)
MODES = {
    "sinkhorn": (),
    "balanced": ("--batch", "1", "--accumulate", "2", "--full-checkpoint"),
    "none": (),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each mode's uninterrupted run, saving ``<mode>.ckpt`` after step 2."""
    tmp = tmp_path_factory.mktemp("resume")
    runs = {
        mode: run(tmp, mode, "--degree", "2", "--mode", mode, *args, "--save-to", str(tmp / f"{mode}.ckpt"))
        for mode, args in MODES.items()
    }
    return {"tmp": tmp, **runs}


def _strip_record(checkpoint: Path) -> None:
    """Make ``checkpoint`` (sharded) look saved before the MoE record existed."""
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    meta.pop("lightning_ep")
    torch.save(meta, checkpoint / "meta.pt")


def _record_of_an_older_release(checkpoint: Path, moved: dict[str, bool]) -> None:
    """Make ``checkpoint`` (sharded) look saved by a release whose ``MoEConfig`` still held the fields
    that moved to ``Execution`` (``MOVED_TO_EXECUTION``), with the values ``moved``."""
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    assert not set(moved) & set(meta["lightning_ep"]["moe_config"])  # this release no longer records them
    meta["lightning_ep"]["moe_config"].update(moved)
    torch.save(meta, checkpoint / "meta.pt")


def _fails(tmp: Path, name: str, *args: str) -> str:
    """Run the worker on 2 processes, expect it to fail, and return its stderr."""
    cmd = [
        *FORKRUN, "--nproc-per-node=2", f"--master-port={_free_port()}",
        str(WORKER), "--out", str(tmp / f"{name}.json"), "--degree", "2", *args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and not (tmp / f"{name}.json").exists(), result.stderr[-3000:]
    return result.stderr


def _bias_after_each_step(result: dict) -> dict[int, torch.Tensor]:
    """``{global_step: [layers, experts] biases}`` as they were after that optimizer step."""
    return {record["step"]: torch.tensor(record["biases"]) for record in result["biases"]}


def _check_bias_steps(result: dict, first_step: int = 0) -> None:
    """After each optimizer step the bias moved by ``RATE * sign(mean - load)``, ``load`` the tokens per
    expert that the layer recorded in that step's own micro-batches, summed over ranks; the bias after
    ``first_step`` is zero (a fresh model, or a bias the resume did not find in the checkpoint)."""
    after = _bias_after_each_step(result)
    loads: dict[int, torch.Tensor] = {}
    for record in result["loads"]:  # the step a micro-batch belongs to is the global step during its forward
        load = torch.tensor(record["load"], dtype=torch.float32)
        loads[record["step"]] = loads.get(record["step"], 0) + load
    bias = after.get(first_step, torch.zeros(2, 8))
    assert torch.count_nonzero(bias) == 0
    steps = range(first_step + 1, result["global_step"] + 1)
    assert list(steps) and set(loads) == {s - 1 for s in steps}
    for step in steps:
        load = loads[step - 1]
        bias = bias + RATE * torch.sign(load.mean(dim=1, keepdim=True) - load)  # as TopKRouter.update_bias
        assert torch.equal(after[step], bias), (step, after[step], bias)
    assert torch.count_nonzero(bias) > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_reproduces_the_uninterrupted_run(saved: dict, mode: str) -> None:
    """Resumed from step 2, the losses are the uninterrupted run's (1e-6), and so are the biases.

    ``"none"`` resumes from a checkpoint stripped of its MoE record, as saved before the record existed:
    it loads unchecked. (``test_strategy.py`` resumes ``"none"`` with the record, at degrees 1 and 4.)
    """
    tmp, full = saved["tmp"], saved[mode]
    checkpoint = tmp / f"{mode}.ckpt"
    if mode == "none":
        shutil.copytree(checkpoint, tmp / "old.ckpt")
        _strip_record(checkpoint := tmp / "old.ckpt")
    resumed = run(tmp, f"resumed-{mode}", "--degree", "2", "--mode", mode, *MODES[mode], "--resume", str(checkpoint))
    micro = len(full["losses"]) // 4  # micro-batches per step
    assert len(resumed["losses"]) == 2 * micro
    assert_close(resumed["losses"], full["losses"][2 * micro :], rtol=1e-6)
    if mode == "balanced":
        # From the bias loaded at step 2 on, after every step, the same bits.
        after = {s: b.tolist() for s, b in _bias_after_each_step(full).items() if s >= 2}
        assert {s: b.tolist() for s, b in _bias_after_each_step(resumed).items()} == after


def test_balanced_bias_moves_by_the_counts_of_its_own_step(saved: dict) -> None:
    """Automatic optimization, two micro-batches per step: each step's update uses exactly that
    step's counts (a pre-step hook would apply the previous step's, and none at step 1)."""
    _check_bias_steps(saved["balanced"])


def test_balanced_bias_under_manual_optimization(tmp_path: Path) -> None:
    """``manual_backward`` per batch and ``opt.step()`` every second batch: one update per step, with
    the counts of both of its batches. The module transforms its model itself in ``configure_model``
    with the strategy's config, which the strategy accepts."""
    args = ("--degree", "2", "--mode", "balanced", "--manual", "--accumulate", "2", "--pre-transform", "balanced")
    result = run(tmp_path, "manual", *args, nproc=2)
    assert result["global_step"] == 4 and len(result["losses"]) == 8
    _check_bias_steps(result)


def test_execution_options_may_change_on_resume(saved: dict) -> None:
    """How a step runs (``Execution``) does not change the math and is not in the checkpoint's record:
    resuming with ``Execution(token_dedup=True)`` is accepted without being allowed, and reproduces the
    run."""
    tmp = saved["tmp"]
    resumed = run(
        tmp, "dedup", "--degree", "2", "--mode", "sinkhorn", "--token-dedup", "--resume", str(tmp / "sinkhorn.ckpt")
    )
    assert_close(resumed["losses"], saved["sinkhorn"]["losses"][2:], rtol=1e-6)


def test_a_record_naming_the_fields_that_moved_to_execution_still_resumes(saved: dict) -> None:
    """A checkpoint of an older release records ``token_dedup``, ``symmetric_memory_dispatch`` and
    ``cuda_graphs`` in its ``moe_config`` (``MoEConfig`` no longer has them; they are ``Execution``'s
    now): they changed how the math ran, so the resume is accepted without being allowed (whatever
    their values) and reproduces the run."""
    tmp = saved["tmp"]
    checkpoint = tmp / "older-release.ckpt"
    shutil.copytree(tmp / "sinkhorn.ckpt", checkpoint)
    _record_of_an_older_release(
        checkpoint, {"token_dedup": True, "symmetric_memory_dispatch": False, "cuda_graphs": True}
    )
    resumed = run(tmp, "older-release", "--degree", "2", "--mode", "sinkhorn", "--resume", str(checkpoint))
    assert_close(resumed["losses"], saved["sinkhorn"]["losses"][2:], rtol=1e-6)


@pytest.mark.parametrize(
    ("saved_mode", "mode"), [("sinkhorn", "aux_loss"), ("balanced", "none")], ids=["sharded", "full-file"]
)
def test_resume_under_another_moe_config_is_refused(saved: dict, saved_mode: str, mode: str) -> None:
    tmp = saved["tmp"]
    extra = ("--full-checkpoint",) if saved_mode == "balanced" else ()
    stderr = _fails(tmp, f"refused-{mode}", "--mode", mode, *extra, "--resume", str(tmp / f"{saved_mode}.ckpt"))
    assert (
        f"checkpoint {str(tmp / f'{saved_mode}.ckpt')!r} was saved with another MoE configuration: "
        f"MoEConfig.moe_load_balancing={saved_mode!r} (this run: {mode!r}). Resume with the MoEConfig and model it "
        "was saved with; to change them on purpose (e.g. another balancing mode for the next phase of training), "
        "pass ExpertParallelStrategy(allow_moe_config_change=['moe_load_balancing'])."
    ) in stderr, stderr[-3000:]


def test_allowed_switch_into_balanced_starts_from_a_zero_bias(saved: dict) -> None:
    """A sinkhorn checkpoint has no ``gate.expert_bias``; resumed as ``"balanced"`` (allowed) the bias
    starts at zero and moves by each step's own counts."""
    tmp = saved["tmp"]
    args = ("--mode", "balanced", "--allow", "moe_load_balancing", "--resume", str(tmp / "sinkhorn.ckpt"))
    result = run(tmp, "into-balanced", "--degree", "2", *args, nproc=2)
    assert result["has_expert_bias"] == [True, True]
    _check_bias_steps(result, first_step=2)


def test_allowed_switch_out_of_balanced_drops_the_bias(saved: dict) -> None:
    """A full checkpoint file of a ``"balanced"`` run holds ``gate.expert_bias``, which a sinkhorn model
    lacks; resumed as ``"sinkhorn"`` (allowed) it loads every other weight and trains on."""
    tmp = saved["tmp"]
    args = ("--mode", "sinkhorn", "--allow", "moe_load_balancing", "--full-checkpoint")
    result = run(tmp, "out-of-balanced", "--degree", "2", *args, "--resume", str(tmp / "balanced.ckpt"), nproc=2)
    assert result["has_expert_bias"] == [False, False] and result["global_step"] == 4


def test_model_transformed_with_another_config_is_refused(tmp_path: Path) -> None:
    stderr = _fails(tmp_path, "pre", "--mode", "sinkhorn", "--pre-transform", "aux_loss", "--steps", "1")
    assert (
        "ExpertParallelStrategy(moe=...): the model's MoE layers were already built by transform() with another "
        "MoEConfig, which stays in force: moe_load_balancing='aux_loss' (asked: 'sinkhorn'). A model is transformed "
        "once; drop the transform() call (the strategy transforms with its moe=) or pass it the same config."
    ) in stderr, stderr[-3000:]


def test_allow_moe_config_change_takes_known_names() -> None:
    assert ExpertParallelStrategy(allow_moe_config_change="top_k").allow_moe_config_change == ("top_k",)
    both = ExpertParallelStrategy(allow_moe_config_change=["moe_load_balancing", "num_experts"])
    assert both.allow_moe_config_change == ("moe_load_balancing", "num_experts")
    with pytest.raises(ValueError, match=r"allow_moe_config_change=\['load_balancing'\]\): \['load_balancing'\] are"):
        ExpertParallelStrategy(allow_moe_config_change=["load_balancing"])
    with pytest.raises(TypeError, match=r"allow_moe_config_change=True\): pass a list of MoEConfig field names"):
        ExpertParallelStrategy(allow_moe_config_change=True)  # type: ignore[arg-type]


def test_allow_moe_config_change_from_the_command_line(tmp_path: Path) -> None:
    from test_cli import CONFIG, _cli

    argument = "--trainer.strategy.init_args.allow_moe_config_change=[moe_load_balancing]"
    printed = yaml.safe_load(_cli(tmp_path, "fit", "--config", str(CONFIG), argument, "--print_config"))
    assert printed["trainer"]["strategy"]["init_args"]["allow_moe_config_change"] == ["moe_load_balancing"]
