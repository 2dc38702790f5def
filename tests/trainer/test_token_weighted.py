"""The token-weighted objective through the Trainer equals its one-process definition.

``token_weighted_worker.py`` runs the first optimizer step of ``ExpertParallelStrategy(degree=2)``
on 2 gloo ranks with ``accumulate_grad_batches=2`` and a ``TokenWeightedDataLoader`` whose four
micro-batches hold 30, 2, 13 and 3 labelled tokens (with padding, and labels at position 0 that the
shifted loss never predicts), and the same step on one process by hand: the gradient of the sum of
the per-token cross-entropies over all the step's labelled tokens divided by their count (one
forward of the step's rows), plus the MoE aux and z losses as their mean over the step's
micro-batches and ranks.

Tolerance: ``1e-5`` relative (norm) per parameter, in fp32. Only the order of the floating-point
sums differs (over micro-batches, ranks and FSDP2's reductions, each a few terms at float32's
``6e-8``); the mistakes this guards against are orders of magnitude larger: the unshifted count
(``+3`` on 48 tokens here), the per-micro-batch mean or a router-loss scale off by a factor of 2
(the test checks that each moves the gradients by more than ``1e-3``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err

WORKER = Path(__file__).with_name("token_weighted_worker.py")
FORKRUN = [sys.executable, str(Path(__file__).parents[1] / "forkrun.py")]
RTOL = 1e-5

pytestmark = pytest.mark.distributed


def _run(tmp: Path, name: str, *args: str, nproc: int) -> Path:
    out = tmp / name
    if nproc == 0:
        cmd = [sys.executable, str(WORKER), "--reference", "--out", str(out)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [*FORKRUN, f"--nproc-per-node={nproc}", f"--master-port={port}", str(WORKER), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([*cmd, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out


def test_trainer_step_is_the_token_weighted_gradient(tmp_path: Path) -> None:
    reference = torch.load(_run(tmp_path, "ref", nproc=0).with_suffix(".pt"))
    trainer_out = _run(tmp_path, "trainer", nproc=2)
    grads = torch.load(trainer_out.with_suffix(".pt"))
    seen = json.loads(trainer_out.with_suffix(".json").read_text())["seen"]

    # The data: micro-batches of very different label counts, as the Trainer saw them, each with
    # num_items_in_batch = the step's count / (accumulate * world).
    counts = reference["counts"]
    assert [[c for c, _ in rank] for rank in seen] == counts
    total = sum(map(sum, counts))
    assert counts == [[30, 2], [13, 3]]
    assert all(abs(d - total / 4) < 1e-6 for rank in seen for _, d in rank), (seen, total)

    expected = reference["token_weighted"]
    assert grads.keys() == expected.keys()
    errors = {name: rel_err(grads[name], expected[name]) for name in expected}
    assert max(errors.values()) <= RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:5]

    # What the comparison can tell apart: the per-micro-batch mean, and the router losses left out
    # (or, equivalently, scaled by 2: they are linear in their weight).
    routers = [name for name in expected if name.endswith("gate.weight")]
    assert routers
    assert min(rel_err(reference["mean_objective"][n], expected[n]) for n in expected) > 1e-3
    assert min(rel_err(reference["cross_entropy"][n], expected[n]) for n in routers) > 1e-3
