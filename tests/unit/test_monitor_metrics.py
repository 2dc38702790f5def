"""``MoELoadMetric`` and ``MoEMonitor`` on one process: exact values on hand-built token counts, the
layers' ``router_entropy``, argument errors, the windowing of a real (one-device) Trainer fit, and
the plots' pixel size.

Counts are small integers and the inputs powers of two, so float64 results are exact: compared with
``==`` unless a logarithm is involved.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from PIL import Image
from torch import nn

import lightning_ep
from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.routing.route import mean_entropy
from lightning_ep.monitor.callback import STAT_NAMES, MoELoadMetric, MoEMonitor
from lightning_ep.monitor.plots import PLOT_SIZE_PX, heatmap_figure, imbalance_figure, normalised_load

H, I, E, K = 64, 32, 8, 2  # noqa: E741 (shape letters)


def _counts(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# ---------------------------------------------------------------- the metric, by hand


def test_metric_values_on_hand_built_counts_are_exact():
    metric = MoELoadMetric(num_layers=3, num_experts=E, top_k=K)
    # Batch 1: layer 0 sends 16 assignments (8 tokens) to experts 0-1, layer 1 is even, layer 2 idle.
    metric.update(
        _counts([8, 8, 0, 0, 0, 0, 0, 0], [2] * 8, [0] * 8),
        router_entropy_L=torch.tensor([0.5, 2.0, 0.0]),
        aux_loss_L=torch.tensor([0.25, 1.0, 0.0]),
        z_loss_L=torch.tensor([0.5, 0.125, 0.0]),
    )
    # Batch 2: layer 0 sends 8 assignments (4 tokens) to experts 2-3, two of them dropped.
    metric.update(
        _counts([0, 0, 4, 4, 0, 0, 0, 0], [2] * 8, [0] * 8),
        router_entropy_L=torch.tensor([2.0, 2.0, 0.0]),
        aux_loss_L=torch.tensor([0.75, 1.0, 0.0]),
        z_loss_L=torch.tensor([0.25, 0.125, 0.0]),
        tokens_dropped_L=torch.tensor([2, 0, 0]),
        selection_gap_L=torch.tensor([0.25, 0.5, 0.0]),
    )
    stats = metric.compute()
    layers, model = stats["layers"], stats["model"]
    assert stats["tokens_per_expert"].tolist() == [[8, 8, 4, 4, 0, 0, 0, 0], [4] * 8, [0] * 8]
    # Layer 0 over the window: 24 assignments, mean 3 per expert, max 8; experts 4-7 never used.
    assert layers["load_imbalance"].tolist() == [8 / 3, 1.0, 0.0]
    std0 = math.sqrt((2 * 5**2 + 2 * 1**2 + 4 * 3**2) / 8)
    assert layers["load_cv"][0].item() == pytest.approx(std0 / 3, rel=1e-15)
    assert layers["load_cv"][1:].tolist() == [0.0, 0.0]
    assert layers["dead_experts"].tolist() == [4, 0, 8]  # over the window, not per batch (6 in each)
    # Token-weighted: (8 tokens * 0.5 + 4 tokens * 2.0) / 12 tokens = 1.0.
    assert layers["router_entropy"].tolist() == [1.0, 2.0, 0.0]
    # Token-weighted too: batch 1 had no gap (0 x 8 tokens), batch 2 a quarter of 4 tokens.
    assert layers["selection_gap"].tolist() == [1 / 12, 0.5 * 16 / 32, 0.0]
    assert layers["tokens_dropped_frac"].tolist() == [2 / 24, 0.0, 0.0]
    assert layers["aux_loss"].tolist() == [0.5, 1.0, 0.0]
    assert layers["z_loss"].tolist() == [0.375, 0.125, 0.0]
    assert model["load_imbalance"].item() == pytest.approx((8 / 3 + 1.0) / 3, rel=1e-15)
    assert model["dead_experts"].item() == 12
    assert model["router_entropy"].item() == 1.0
    assert model["selection_gap"].item() == pytest.approx((1 / 12 + 0.25) / 3, rel=1e-15)
    assert model["tokens_dropped_frac"].item() == 2 / 56
    assert model["aux_loss"].item() == 1.5
    assert model["z_loss"].item() == 0.5
    assert stats["moe_tokens"].item() == (24 + 32) / K
    assert set(layers) == set(model) == set(STAT_NAMES)
    assert all(torch.isfinite(v).all() for v in (*layers.values(), *model.values()))


def test_metric_reset_starts_a_new_window():
    metric = MoELoadMetric(1, 4, 1)
    metric.update(_counts([4, 0, 0, 0]), torch.zeros(1), torch.zeros(1), torch.zeros(1))
    assert metric.compute()["layers"]["load_imbalance"].item() == 4.0
    metric.reset()
    metric.update(_counts([1, 1, 1, 1]), torch.zeros(1), torch.zeros(1), torch.zeros(1))
    stats = metric.compute()
    assert stats["layers"]["load_imbalance"].item() == 1.0
    assert stats["tokens_per_expert"].tolist() == [[1, 1, 1, 1]]


def test_metric_errors_name_the_argument():
    with pytest.raises(ValueError, match=re.escape("MoELoadMetric(num_experts=0): pass an int >= 1.")):
        MoELoadMetric(2, 0, 1)
    with pytest.raises(ValueError, match=re.escape("MoELoadMetric(top_k=3): must not exceed num_experts=2.")):
        MoELoadMetric(2, 2, 3)
    metric = MoELoadMetric(2, 8, 2)
    with pytest.raises(ValueError, match=re.escape("has shape (8,), expected (2, 8)")):
        metric.update(torch.zeros(8, dtype=torch.int64), torch.zeros(2), torch.zeros(2), torch.zeros(2))


# ---------------------------------------------------------------- MoELayer.router_entropy


def _layer(seed: int = 0, weight: torch.Tensor | None = None, num_experts: int = E, top_k: int = K) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    w = weight if weight is not None else torch.randn(num_experts, H, generator=g) * 0.3
    gate = TopKRouter(nn.Parameter(w), top_k=top_k, mode="aux_loss")
    experts = GroupedExperts(
        nn.Parameter(torch.randn(num_experts, 2 * I, H, generator=g) * 0.1),
        nn.Parameter(torch.randn(num_experts, H, I, generator=g) * 0.1),
        F.silu,
    )
    return MoELayer(gate, experts, MoEConfig(moe_load_balancing="aux_loss"))


def test_router_entropy_on_hand_built_probabilities():
    probs_TE = torch.tensor([[0.5, 0.5] + [0.0] * 6, [1 / 8] * 8, [1.0] + [0.0] * 7], dtype=torch.float64)
    entropy = mean_entropy(probs_TE)
    # (log 2 + log 8 + 0) / 3 = 4/3 log 2; experts with probability 0 add 0, not NaN.
    assert entropy.shape == ()
    assert entropy.item() == pytest.approx(4 / 3 * math.log(2), rel=1e-15)
    assert mean_entropy(probs_TE[:0]).item() == 0.0  # a rank without tokens


def test_router_entropy_after_forward():
    uniform = _layer(weight=torch.zeros(E, H)).train()
    uniform(torch.randn(2, 8, H))
    assert uniform.router_entropy.item() == pytest.approx(math.log(E), rel=1e-6)

    layer = _layer(seed=3).train()
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(4))
    layer(x)
    probs = torch.softmax(x.reshape(-1, H).double() @ layer.gate.weight.detach().double().t(), dim=-1)
    expected = -(probs * probs.log()).sum(dim=-1).mean()
    assert not layer.router_entropy.requires_grad
    assert layer.router_entropy.item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------- the callback's arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every_n_steps": 0}, ValueError, "MoEMonitor(every_n_steps=0): pass an int >= 1, or None to follow"),
        ({"every_n_steps": True}, ValueError, "MoEMonitor(every_n_steps=True): pass an int >= 1"),
        ({"heatmap_every_n_steps": 2.5}, TypeError, "MoEMonitor(heatmap_every_n_steps=2.5): pass an int."),
        ({"heatmap_every_n_steps": -1}, ValueError, "MoEMonitor(heatmap_every_n_steps=-1): pass an int >= 1, or 0"),
        ({"plots": "yes"}, TypeError, "MoEMonitor(plots='yes'): pass True or False."),
        ({"prefix": "moe/"}, ValueError, "MoEMonitor(prefix='moe/'): pass a non-empty name without a trailing '/'."),
    ],
)
def test_monitor_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MoEMonitor(**kwargs)


def test_monitor_without_matplotlib_says_how_to_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=re.escape("`pip install matplotlib`, or pass plots=False")):
        MoEMonitor()
    MoEMonitor(plots=False)


def test_monitor_refuses_a_model_without_moe_layers():
    with pytest.raises(ValueError, match=re.escape("MoEMonitor found no MoELayer in Linear: train with")):
        MoEMonitor().on_train_start(None, nn.Linear(2, 2))  # type: ignore[arg-type]


def test_monitor_refuses_layers_of_different_shapes():
    model = nn.ModuleList([_layer(), _layer(num_experts=4)])
    with pytest.raises(
        ValueError, match=re.escape("the same (num_experts, top_k) in every MoE layer, found [(4, 2), (8, 2)]")
    ):
        MoEMonitor().on_train_start(None, model)  # type: ignore[arg-type]


def test_top_level_export_is_lazy():
    code = (
        "import json, sys\n"
        "import lightning_ep\n"
        "heavy = ('lightning_ep.monitor.callback', 'lightning', 'matplotlib', 'torchmetrics')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m in heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    assert lightning_ep.MoEMonitor is MoEMonitor and "MoEMonitor" in lightning_ep.__all__


# ---------------------------------------------------------------- plots


def test_normalised_load_and_plot_sizes(tmp_path: Path):
    load = normalised_load(_counts([4, 4, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]))
    assert load.tolist() == [[2.0, 2.0, 0.0, 0.0], [1.0] * 4, [0.0] * 4]
    heatmap_figure(load).savefig(tmp_path / "heat.png", dpi=80)
    imbalance_figure([1, 2, 3], [[2.0, 1.0, 0.0]] * 3).savefig(tmp_path / "imbalance.png", dpi=80)
    for name in ("heat.png", "imbalance.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.size == PLOT_SIZE_PX


# ---------------------------------------------------------------- a real one-device fit


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call; no directory, so PNGs go to ``default_root_dir``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


class Recorder(Callback):
    """Sums each layer's ``tokens_per_expert`` per optimizer step, independently of the monitor."""

    def __init__(self) -> None:
        self.per_step: list[torch.Tensor] = []
        self._current: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        counts = torch.stack([layer.tokens_per_expert for layer in lightning_ep.moe_layers(pl_module)])
        self._current = counts if self._current is None else self._current + counts
        if len(self.per_step) < trainer.global_step:
            self.per_step.append(self._current)
            self._current = None


class TinyMoE(LightningModule):
    """Two ``MoELayer``s with a skewed router on a regression target; one micro-batch = 8 tokens."""

    def __init__(self) -> None:
        super().__init__()
        weight = torch.randn(E, H, generator=torch.Generator().manual_seed(5)) * 0.1
        weight[6:] = -1.0  # inputs are positive: experts 6 and 7 never win
        self.layers = nn.ModuleList([_layer(seed=0, weight=weight.clone()), _layer(seed=1, weight=weight.clone())])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, monitor: MoEMonitor, **trainer_kwargs) -> tuple[MemoryLogger, Recorder]:
    torch.manual_seed(0)
    logger, recorder = MemoryLogger(), Recorder()
    data = torch.rand(64, 4, H)  # micro-batches of 2 x 4 = 8 tokens
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[recorder, monitor],
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(TinyMoE(), loader)
    return logger, recorder


def test_fit_windows_follow_optimizer_steps_under_accumulation(tmp_path: Path):
    monitor = MoEMonitor(every_n_steps=2, heatmap_every_n_steps=4)
    logger, recorder = _fit(tmp_path, monitor, max_steps=5, accumulate_grad_batches=2, log_every_n_steps=1)
    rows = [(step, m) for step, m in logger.rows if "moe_monitor/load_imbalance" in m]
    # Windows end after optimizer steps 2 and 4, and at the end of fit (step 5); Lightning's step index is one less.
    assert [step for step, _ in rows] == [1, 3, 4]
    assert len(recorder.per_step) == 5
    windows = [
        recorder.per_step[0] + recorder.per_step[1],
        recorder.per_step[2] + recorder.per_step[3],
        recorder.per_step[4],
    ]
    for (_, metrics), counts in zip(rows, windows, strict=True):
        assert len([k for k in metrics if k.startswith("moe_monitor/")]) == 8 * 2 + 9
        for i in range(2):
            c = counts[i].double()
            assert c.sum().item() == (2 if counts is windows[2] else 4) * 8 * K  # micro-batches x tokens x K
            assert metrics[f"moe_monitor/layer_{i}/dead_experts"] == (c == 0).sum().item() >= 2
            assert metrics[f"moe_monitor/layer_{i}/load_imbalance"] == pytest.approx(
                (c.max() / c.mean()).item(), rel=1e-12
            )
            assert metrics[f"moe_monitor/layer_{i}/tokens_dropped_frac"] == 0.0
            assert 0 < metrics[f"moe_monitor/layer_{i}/router_entropy"] < math.log(E)
        assert metrics["moe_monitor/tokens_per_sec"] > 0
    moe_dir = tmp_path / "moe"
    assert sorted(p.name for p in moe_dir.iterdir()) == [
        "expert_load.png",
        "expert_load_step000004.png",
        "load_imbalance.png",
    ]
    with Image.open(moe_dir / "expert_load.png") as image:
        assert image.size == PLOT_SIZE_PX
    assert monitor.history_steps == [2, 4, 5]


def test_fit_resets_state_left_from_before(tmp_path: Path):
    monitor = MoEMonitor(heatmap_every_n_steps=0, plots=False)
    # Leave stale state behind, as a pickled copy in a spawned worker would carry it.
    monitor.on_train_start(SimpleNamespace(global_step=0, log_every_n_steps=1), TinyMoE())  # type: ignore[arg-type]
    monitor.metric.update(torch.full((2, E), 1000), torch.ones(2), torch.ones(2), torch.ones(2))
    monitor.history_steps.append(99)
    logger, recorder = _fit(tmp_path, monitor, max_steps=2, log_every_n_steps=1)
    rows = [m for _, m in logger.rows if "moe_monitor/aux_loss" in m]
    assert len(rows) == 2 and monitor.history_steps == [1, 2]
    for metrics, counts in zip(rows, recorder.per_step, strict=True):
        c = counts[0].double()
        assert metrics["moe_monitor/layer_0/load_imbalance"] == pytest.approx((c.max() / c.mean()).item(), rel=1e-12)
        assert metrics["moe_monitor/layer_0/aux_loss"] < 100
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("layer1_has_attribute", [True, False])
def test_monitor_reads_tokens_dropped_where_a_layer_has_it(layer1_has_attribute):
    model = nn.ModuleList([_layer(seed=0), _layer(seed=1)]).train()
    monitor = MoEMonitor(plots=False)
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=1, loggers=[])
    monitor.on_train_start(trainer, model)  # type: ignore[arg-type]
    x = torch.rand(2, 8, H)
    for layer in model:
        layer(x)
    model[0].tokens_dropped = torch.tensor(4)  # as a capacity-limited layer sets it
    model[1].tokens_dropped = torch.zeros((), dtype=torch.int64)
    if not layer1_has_attribute:
        del model[1].tokens_dropped  # a layer without the attribute counts as dropless
    monitor.on_train_batch_end(trainer, model, None, None, 0)  # type: ignore[arg-type]
    metrics = monitor._flush(trainer)  # type: ignore[arg-type]
    assert metrics["moe_monitor/layer_0/tokens_dropped_frac"] == 4 / (16 * K)
    assert metrics["moe_monitor/layer_1/tokens_dropped_frac"] == 0.0
    assert metrics["moe_monitor/tokens_dropped_frac"] == 4 / (2 * 16 * K)
