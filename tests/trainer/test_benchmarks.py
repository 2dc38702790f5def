"""The benchmark scripts still run: each one on CPU at the ``tiny`` shape, in real processes (2
gloo ranks with ``torchrun``'s environment where the script is distributed, ``tests/forkrun.py``),
recording its table.

Nothing is timed here (the numbers of a CPU run mean nothing); what is checked is that every row
ran and that the recorded section carries the command and the table. A change to the layer's
internals that a script mirrors (``bench_layer`` steps through ``MoELayer.forward``) fails here,
not on the GPU machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_strategy import FORKRUN

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.distributed


def _run(script: str, args: list[str], tmp_path: Path, nproc: int) -> str:
    results = tmp_path / "results.md"
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = [*FORKRUN, f"--nproc-per-node={nproc}", f"--master-port={port}"]
    else:
        launch = [sys.executable]
    cmd = [*launch, str(BENCHMARKS / script), *args, "--record", "--results", str(results)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    text = results.read_text()
    assert f"benchmarks/{script}" in text and "|---|" in text  # the command, and a table
    return text


def _table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


VARIANTS = ["--variants", "fast", "dedup"]


def test_bench_layer_runs_every_phase(tmp_path: Path) -> None:
    text = _run(
        "bench_layer.py",
        ["--shapes", "tiny", "tiny-shared", "--iters", "2", "--warmup", "1", *VARIANTS],
        tmp_path,
        nproc=2,
    )
    rows = _table_rows(text)
    # (tiny, tiny-shared) x (local; a2a, allgather) x 2 variants
    assert len(rows) == 2 * 3 * 2, text
    assert {row[2] for row in rows} == {"local", "a2a", "allgather"}


def test_bench_step_runs_the_baseline_and_this_library(tmp_path: Path) -> None:
    rows = [  # every kind of row, options combined where they can be (each row costs a Trainer run)
        "grouped_mm+lora",
        "ep:allgather+zero2@root-head",
        "ep:a2a+dedup+adamw@grouped-experts",
        "ep:a2a+lora+eager",
        "ep:a2a+autobudget",  # the padded all-to-all (degree 2)
    ]
    text = _run(
        "bench_step.py",
        ["--shape", "tiny", "--precision", "32-true", "--steps", "2", "--warmup", "1", "--rows", *rows],
        tmp_path,
        nproc=2,
    )
    table = _table_rows(text)
    assert len(table) == len(rows), text
    assert all(row[-1] == "ok" for row in table), text


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("ep:a2a+nographs", "unknown option(s) ['nographs']"),
        ("ep:a2a@widened-wgrads", "unknown variant 'widened-wgrads'"),
        ("ep:a2a+graph+nograph", "+graph and +nograph contradict each other"),
        ("ep:a2a+none+sinkhorn", "balancing modes ['none', 'sinkhorn'] contradict each other"),
        ("ep:a2b", "'ep:a2b' is not one of"),
    ],
)
def test_bench_step_refuses_a_bad_row_before_any_work(row: str, message: str, tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCHMARKS / "bench_step.py"), "--shape", "tiny", "--rows", "grouped_mm", row]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and f"row {row!r}" in result.stderr, result.stderr
    assert "dense GEMM" not in result.stdout  # refused before the first measurement


def test_bench_experts_runs(tmp_path: Path) -> None:
    text = _run(
        "bench_experts.py",
        ["--sizes", "tiny", "--experts", "4", "--rows", "16", "64", "--iters", "2", "--warmup", "1"],
        tmp_path,
        nproc=1,
    )
    rows = _table_rows(text)
    assert len(rows) == 2 and all(row[-1] == "grouped" for row in rows), text  # off CUDA: always grouped


def test_bench_optim_runs(tmp_path: Path) -> None:
    args = ["--shapes", "tiny", "--degrees", "1", "2", "--iters", "2", "--warmup", "1", "--blocks", "512"]
    text = _run("bench_optim.py", args, tmp_path, nproc=1)
    table = _table_rows(text)
    assert len(table) == 8, text  # 2 degrees x (3 optimizers + 1 block size)
    assert [row[-1] for row in table] == ["reference", "-", "yes", "-"] * 2, text
    assert all("block 512" in row[3] for row in table[3::4]), text


def test_bench_quant_error_ranks_the_formats(tmp_path: Path) -> None:
    table = _table_rows(_run("bench_quant_error.py", ["--size", "256"], tmp_path, nproc=1))
    errors = {row[0]: [float(x) for x in row[2:]] for row in table}
    assert list(errors) == ["fp8", "mxfp4", "nf4"], table
    assert all(fp8 < nf4 < mxfp4 for fp8, mxfp4, nf4 in zip(*errors.values(), strict=True)), errors


def test_bench_sinkhorn_runs(tmp_path: Path) -> None:
    text = _run(
        "bench_sinkhorn.py", ["--sizes", "64x8", "100x60", "--iterations", "3", "--calls", "2"], tmp_path, nproc=1
    )
    table = _table_rows(text)
    assert [row[0] for row in table] == ["64 x 8", "100 x 60"], text
    assert all(row[3] == "-" for row in table), text  # off CUDA: the torch iterations only


PRECISION_SMOKE = ["--shape", "tiny", "--steps", "3", "--seq", "64", "--warmup", "2", "--time-from", "1"]


def test_bench_precision_trains_every_row_from_one_start(tmp_path: Path) -> None:
    rows = ["bf16-true", "bf16-mixed", "bf16-true+adamw", "bf16-mixed+dither"]  # +sr needs torchao: GPU only
    curves = tmp_path / "curves.json"
    args = [*PRECISION_SMOKE, "--rows", *rows, "--init-dir", str(tmp_path / "init"), "--out", str(curves)]
    text = _run("bench_precision.py", args, tmp_path, nproc=1)
    table = _table_rows(text)
    assert [row[0] for row in table] == rows and all(row[-1] == "ok" for row in table), text
    runs = json.loads(curves.read_text())["runs"]
    assert [run["row"] for run in runs] == rows
    for run in runs:
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"]), run
        assert run["lrs"] == pytest.approx([5e-6, 1e-5, 1e-5], rel=1e-6), run  # warm-up 2, then the cosine's top
    dtypes = [set(run["parameter_numel_by_dtype"]) for run in runs]
    assert dtypes == [{"torch.bfloat16"}, {"torch.float32"}, {"torch.bfloat16"}, {"torch.float32"}]  # bf16-mixed: fp32
    # One start, one stream, one order: lightning_ep.optim.AdamW (torch's fused AdamW bit for bit) repeats
    # bf16-true's losses exactly; bf16-mixed starts from the same weights, computed with fp32 ones.
    assert runs[2]["losses"] == runs[0]["losses"]
    assert runs[1]["losses"][0] == pytest.approx(runs[0]["losses"][0], abs=1e-2)
    assert runs[1]["gap_to_bf16_mixed"] == 0.0
    # Dithered masters keep their bf16 view: the first step is bf16-mixed's, bit for bit.
    assert runs[3]["losses"][0] == runs[1]["losses"][0]


def test_bench_precision_freezes_exactly_the_norm_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``+frozen-norms`` rows: every RMSNorm weight (input, post-attention, final) and nothing else."""
    from conftest import tiny_mixtral

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_precision")
    model = tiny_mixtral()
    norms = {n for n, _ in model.named_parameters() if "layernorm" in n or n == "model.norm.weight"}
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    frozen = bench.freeze_norms(model)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == norms
    assert frozen == (2 * model.config.num_hidden_layers + 1) * model.config.hidden_size
    with pytest.raises(RuntimeError, match="has no module named"):
        bench.freeze_norms(torch.nn.Linear(2, 2))


def test_bench_precision_schedule_fills_a_tensor_lr(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's optimizers hold ``lr`` as a Tensor and step with that object: the schedule must fill it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_precision")
    p = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(1e-3)
    optimizer = torch.optim.AdamW([p], lr=lr, foreach=False)
    scheduler = bench.make_scheduler(optimizer, warmup=2, steps=4)
    applied = []
    for _ in range(4):
        applied.append(float(optimizer.param_groups[0]["lr"]))
        p.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr
    assert applied == pytest.approx([1e-3 * bench.lr_factor(s, 2, 4) for s in range(4)], rel=1e-6)
    assert applied == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4], rel=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--time-from", "3"], "--time-from 3 must lie in 0..2"),
        (["--degree", "2"], "--degree 2 must divide the 1 process(es) launched"),
        pytest.param(
            ["--rows", "bf16-true", "bf16-true+sr"],
            "--rows bf16-true+sr needs torchao (torchao.optim._AdamW)",
            marks=pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed"),
        ),
    ],
)
def test_bench_precision_refuses_before_any_work(args: list[str], message: str, tmp_path: Path) -> None:
    init = tmp_path / "init"
    cmd = [sys.executable, str(BENCHMARKS / "bench_precision.py"), *PRECISION_SMOKE, "--init-dir", str(init), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert not list(tmp_path.glob("init*"))  # refused before the initial checkpoint was written
