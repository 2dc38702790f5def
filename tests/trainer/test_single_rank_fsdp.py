"""``Execution.single_rank_fsdp`` in real Trainer fits at world size 1 (gloo, CPU): the model's dense
parameters skip FSDP2 and are used in place, and the weights and losses come out bit for bit those
of the FSDP2 path every larger world takes (fp32 reduction, the parameters freed after forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_strategy import run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("precision", "mode"), [("bf16-true", "aux_loss"), ("bf16-mixed", "sinkhorn"), ("32-true", "none")]
)
def test_single_rank_fsdp_gives_the_bits_of_the_sharded_path(tmp_path: Path, precision: str, mode: str) -> None:
    args = ("--degree", "1", "--precision", precision, "--mode", mode, "--steps", "3")
    auto = run(tmp_path, "auto", *args, nproc=1)
    off = run(tmp_path, "off", *args, "--single-rank-fsdp", "off", nproc=1)
    assert auto["fsdp"] == {"in_place": True}
    assert off["fsdp"] == {
        "reshard_after_forward": True,
        "reduce_dtype": "torch.float32" if precision != "32-true" else "None",
    }
    assert auto["losses"] == off["losses"] and len(auto["losses"]) == 3
    assert auto["weights_sha256"] == off["weights_sha256"]


def test_gradient_accumulation_keeps_the_fp32_reduction(tmp_path: Path) -> None:
    """Under accumulation FSDP2 sums the micro-batches in its reduce dtype, so the automatic choice
    stays off there: the setup is that of every larger world."""
    result = run(
        tmp_path, "acc", "--degree", "1", "--precision", "bf16-true", "--accumulate", "2", "--steps", "2", nproc=1
    )
    assert result["fsdp"] == {"reshard_after_forward": True, "reduce_dtype": "torch.float32"}


def test_compiled_layers_see_the_parameters_in_place(tmp_path: Path) -> None:
    """With ``Execution(compile=True)`` the compiled dense children read the stand-ins the forward
    swaps in: the same bits as the compiled FSDP2 path, and no more graphs (no recompile per step)."""
    args = ("--degree", "1", "--precision", "bf16-mixed", "--mode", "sinkhorn", "--steps", "4", "--compile")
    auto = run(tmp_path, "auto", *args, nproc=1)
    off = run(tmp_path, "off", *args, "--single-rank-fsdp", "off", nproc=1)
    assert auto["fsdp"] == {"in_place": True} and auto["compiled_blocks"] == 2
    assert auto["compiled_graphs"] == off["compiled_graphs"]
    assert auto["losses"] == off["losses"] and len(auto["losses"]) == 4
    assert auto["weights_sha256"] == off["weights_sha256"]
