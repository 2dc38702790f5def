"""``MoEMonitor`` in a real 2-step fit (2 gloo processes, expert-parallel degree 2) with a CSVLogger
and a TensorBoardLogger: the scalars reach both, their values match token counts recorded apart
from the monitor, and the PNGs (and the TensorBoard images) exist at ``PLOT_SIZE_PX``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_strategy import FORKRUN

from lightning_ep.monitor.callback import STAT_NAMES
from lightning_ep.monitor.plots import PLOT_SIZE_PX

WORKER = Path(__file__).with_name("monitor_fit_worker.py")
LAYERS, E, K = 2, 8, 2

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("monitor_fit")
    cmd = [
        *FORKRUN, "--nproc-per-node=2", f"--master-port={_free_port()}",
        str(WORKER), "--root", str(root),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"fit failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return root


def test_csv_scalars_match_recorded_counts(run: Path) -> None:
    expected = json.loads((run / "expected.json").read_text())
    counts = torch.tensor(expected["counts"], dtype=torch.float64)  # [step, L, E], summed over ranks
    rows = list(csv.DictReader((run / "csv" / "version_0" / "metrics.csv").open()))
    monitor_rows = [r for r in rows if r.get("moe_monitor/load_imbalance")]
    assert [int(r["step"]) for r in monitor_rows] == [0, 1]
    keys = [f"moe_monitor/{n}" for n in (*STAT_NAMES, "tokens_per_sec")]
    keys += [f"moe_monitor/layer_{i}/{n}" for i in range(LAYERS) for n in STAT_NAMES]
    assert sorted(k for k in rows[0] if k.startswith("moe_monitor/")) == sorted(keys)  # 7 L + 8 series
    for step, row in enumerate(monitor_rows):
        assert all(math.isfinite(float(row[k])) for k in keys)
        for i in range(LAYERS):
            c = counts[step, i]
            assert c.sum().item() == expected["tokens_per_step"] * K  # each token counted once, not per EP rank
            assert float(row[f"moe_monitor/layer_{i}/dead_experts"]) == (c == 0).sum().item()
            assert float(row[f"moe_monitor/layer_{i}/load_imbalance"]) == pytest.approx((c.max() / c.mean()).item())
            assert 0 < float(row[f"moe_monitor/layer_{i}/router_entropy"]) <= math.log(E)
            assert float(row[f"moe_monitor/layer_{i}/tokens_dropped_frac"]) == 0.0
            assert 1.0 < float(row[f"moe_monitor/layer_{i}/aux_loss"]) < 4.0  # ~K for a near-uniform router
        assert float(row["moe_monitor/tokens_per_sec"]) > 0
    # The strategy's own per-step losses are still there, under their own names.
    assert any(r.get("moe/aux_loss") for r in rows)


def test_pngs_open_at_the_expected_size(run: Path) -> None:
    moe_dir = run / "csv" / "version_0" / "moe"  # trainer.log_dir: the first logger's
    names = sorted(p.name for p in moe_dir.iterdir())
    assert names == [
        "expert_load.png",
        "expert_load_step000001.png",
        "expert_load_step000002.png",
        "load_imbalance.png",
    ]
    for name in names:
        with Image.open(moe_dir / name) as image:
            image.load()
            assert image.format == "PNG" and image.size == PLOT_SIZE_PX
        assert (moe_dir / name).stat().st_size < 100_000


def test_tensorboard_gets_scalars_and_heatmaps(run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb" / "version_0"), size_guidance={"images": 0, "scalars": 0}).Reload()
    tags = events.Tags()
    assert {"moe_monitor/load_imbalance", "moe_monitor/layer_1/router_entropy", "moe_monitor/tokens_per_sec"} <= set(
        tags["scalars"]
    )
    assert [e.step for e in events.Scalars("moe_monitor/dead_experts")] == [0, 1]
    images = events.Images("moe_monitor/expert_load")
    assert [e.step for e in images] == [0, 1]
    assert all((e.width, e.height) == PLOT_SIZE_PX for e in images)
