"""ExpertParallelStrategy through the real Lightning Trainer, 4 gloo processes per run.

Each run is its own subprocess: ``tests/forkrun.py``, which gives each rank the environment that
``torchrun`` gives it, forked after the imports (``test_robustness.py`` and ``test_errors_once.py``
launch with ``torchrun`` itself). The reference is
the unsharded model on one process fed every rank's micro-batch (``fit_worker.py --reference``).
fp32 runs agree to 1e-5 relative: only the order of floating-point sums differs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fit_worker.py")
#: ``torchrun --nproc-per-node=N`` for these tests, with the workers forked from one process (``tests/forkrun.py``).
FORKRUN = [sys.executable, str(Path(__file__).parents[1] / "forkrun.py")]
RTOL = 1e-5

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp: Path, name: str, *args: str, nproc: int = 4) -> dict:
    out = tmp / f"{name}.json"
    if nproc == 0:
        cmd = [sys.executable, str(WORKER), "--reference", "--out", str(out), *args]
    else:
        cmd = [
            *FORKRUN, f"--nproc-per-node={nproc}", f"--master-port={_free_port()}", str(WORKER), "--out", str(out),
            *args,
        ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return json.loads(out.read_text())


def assert_close(a: list[float], b: list[float], rtol: float = RTOL) -> None:
    assert len(a) == len(b), (a, b)
    for x, y in zip(a, b, strict=True):
        assert math.isfinite(x) and abs(x - y) <= rtol * abs(y), (a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shared runs: reference, degree 2 (saving a sharded and a full checkpoint at step 2)."""
    tmp = tmp_path_factory.mktemp("strategy")
    return {
        "tmp": tmp,
        "ref": run(tmp, "ref", "--world", "4", nproc=0),
        "d2": run(tmp, "d2", "--degree", "2", "--save-to", str(tmp / "sharded.ckpt")),
    }


def test_degree_2_matches_reference(runs: dict) -> None:
    assert runs["d2"]["degree"] == 2
    assert_close(runs["d2"]["losses"], runs["ref"]["losses"])


def test_finetune_from_hf_folder_matches_reference(runs: dict) -> None:
    """``from_pretrained`` on the meta device, sharded loading in ``setup``: the same run as the reference."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from fit_worker import build_model
    finally:
        sys.path.remove(str(WORKER.parent))
    tmp = runs["tmp"]
    build_model().save_pretrained(tmp / "hf")  # seeded: the reference's initial weights
    result = run(tmp, "pretrained", "--degree", "2", "--pretrained", str(tmp / "hf"))
    assert result["degree"] == 2
    assert_close(result["losses"], runs["ref"]["losses"])


@pytest.mark.parametrize(
    ("args", "degree"),
    [
        (("--degree", "1"), 1),
        (("--degree", "auto"), 4),
        (("--degree", "2", "--replicate", "2"), 2),
        (("--degree", "2", "--activation-checkpointing"), 2),
        (("--degree", "2", "--activation-checkpointing", "keep_all_to_all", "--compile"), 2),
    ],
    ids=[
        "degree1",
        "auto-is-4",
        "degree2-replicate2",
        "degree2-activation-checkpointing",
        "degree2-keep-all-to-all-compile",
    ],
)
def test_every_layout_matches_reference(runs: dict, args: tuple[str, ...], degree: int) -> None:
    result = run(runs["tmp"], "layout-" + "-".join(args).replace("--", ""), *args)
    assert result["degree"] == degree
    assert result["checkpointed"] == ("--activation-checkpointing" in args)
    assert result["keep_all_to_all"] == ("keep_all_to_all" in args)
    # Compiled: both decoder layers, each split at its MoE layer (at least the graphs before and after it).
    assert result["compiled_blocks"] == (2 if "--compile" in args else 0)
    assert result["compiled_graphs"] >= (2 if "--compile" in args else 0)
    assert_close(result["losses"], runs["ref"]["losses"])


def test_gradient_clipping_matches_reference(runs: dict) -> None:
    tmp = runs["tmp"]
    ref = run(tmp, "ref-clip", "--world", "4", "--clip", "0.05", nproc=0)
    clipped = run(tmp, "clip", "--degree", "2", "--clip", "0.05")
    assert_close(clipped["losses"], ref["losses"])
    assert clipped["losses"][1:] != runs["d2"]["losses"][1:], "clipping at 0.05 must change the updates"


def test_gradient_accumulation_equals_double_batch(runs: dict) -> None:
    tmp = runs["tmp"]
    args = ("--degree", "2", "--batch", "1", "--accumulate", "2", "--steps", "4", "--log-dir", "logs-accumulate")
    acc = run(tmp, "accumulate", *args)
    micro = acc["losses"]
    assert len(micro) == 8
    merged = [(micro[2 * k] + micro[2 * k + 1]) / 2 for k in range(4)]
    assert_close(merged, runs["d2"]["losses"])
    # The logged MoE losses of a step are the mean over its micro-batches (logged at the optimizer step).
    rows = list(csv.DictReader((tmp / "logs-accumulate" / "run" / "version_0" / "metrics.csv").open()))
    aux = acc["aux_losses"]
    for layer in range(2):
        logged = [float(r[f"moe/layer_{layer}/aux_loss"]) for r in rows if r.get(f"moe/layer_{layer}/aux_loss")]
        assert_close(logged, [(aux[2 * k][layer] + aux[2 * k + 1][layer]) / 2 for k in range(4)])
    total = [float(r["moe/aux_loss"]) for r in rows if r.get("moe/aux_loss")]
    assert_close(total, [(sum(aux[2 * k]) + sum(aux[2 * k + 1])) / 2 for k in range(4)])


@pytest.mark.parametrize("degree", ["1", "4"])  # saved at 2; resuming at the same degree: test_resume.py
def test_resume_sharded_checkpoint_at_any_degree(runs: dict, degree: str) -> None:
    tmp = runs["tmp"]
    resumed = run(tmp, f"resume-{degree}", "--degree", degree, "--resume", str(tmp / "sharded.ckpt"))
    assert_close(resumed["losses"], runs["d2"]["losses"][2:], rtol=1e-6)


def test_resume_full_checkpoint_at_other_degree(runs: dict) -> None:
    tmp = runs["tmp"]
    full = run(tmp, "full", "--degree", "2", "--full-checkpoint", "--save-to", str(tmp / "full.ckpt"))
    assert (tmp / "full.ckpt").is_file()
    resumed = run(tmp, "resume-full", "--degree", "4", "--full-checkpoint", "--resume", str(tmp / "full.ckpt"))
    assert_close(resumed["losses"], full["losses"][2:], rtol=1e-6)


def test_bf16_mixed_logs_moe_losses(runs: dict) -> None:
    tmp = runs["tmp"]
    result = run(tmp, "bf16", "--degree", "2", "--precision", "bf16-mixed", "--mode", "aux_loss", "--log-dir", "logs")
    assert_close(result["losses"], runs["ref"]["losses"], rtol=3e-2)
    rows = list(csv.DictReader((tmp / "logs" / "run" / "version_0" / "metrics.csv").open()))
    keys = ["moe/aux_loss", "moe/z_loss", "moe/layer_0/aux_loss", "moe/layer_1/z_loss"]
    for key in keys:
        values = [float(r[key]) for r in rows if r.get(key)]
        assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values), (key, values)
    # The aux loss of a balanced router is ~1 per layer (E * sum f_i P_i with f, P ~ uniform, the f_i summing
    # to 1 as in SMP and Megatron-Core), so ~2 for the sum over the two layers.
    assert all(0.75 < float(r["moe/layer_0/aux_loss"]) < 1.5 for r in rows if r.get("moe/layer_0/aux_loss"))
    assert all(1.5 < float(r["moe/aux_loss"]) < 3.0 for r in rows if r.get("moe/aux_loss"))


def test_value_head_and_frozen_model_match_reference(runs: dict) -> None:
    """A trainable value head beside the model is sharded with FSDP2 over all ranks and a frozen second
    MoE model stays whole (``moe_model="model"`` names the parallelised one): losses and the head's
    trained weight equal data parallelism's."""
    tmp = runs["tmp"]
    beside = ("--value-head", "--frozen-copy")
    ref = run(tmp, "ref-beside", "--world", "4", *beside, nproc=0)
    result = run(tmp, "beside", "--degree", "2", *beside, "--moe-model", "model")
    assert result["head_sharded"] and result["frozen_untouched"]
    assert_close(result["losses"], ref["losses"])
    assert_close(result["head_weight"], ref["head_weight"])
