"""``MoEMonitor``: expert load and router statistics of the MoE layers, through Lightning's loggers.

Legend: L MoE layers, E experts per layer, K experts per token.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from typing_extensions import override

from lightning_ep.moe.layer import MoELayer
from lightning_ep.monitor.metric import STAT_NAMES, MoELoadMetric
from lightning_ep.monitor.plots import DPI as _DPI
from lightning_ep.monitor.plots import heatmap_figure, imbalance_figure, normalised_load
from lightning_ep.monitor.plots import rgb as _rgb
from lightning_ep.transform import moe_layers

if TYPE_CHECKING:
    import lightning.pytorch as pl

# What each MoELayer kept from its last forward, in the order of MoELoadMetric.update's arguments.
_RECORDED = ("tokens_per_expert", "router_entropy", "aux_loss", "z_loss", "tokens_dropped", "selection_gap")


class MoEMonitor(Callback):
    """Log expert load balance and router health of every ``MoELayer`` through the Trainer's loggers.

    After every training batch it adds what each ``MoELayer`` kept from its last forward to a
    ``MoELoadMetric`` on the device, without a host sync. Every ``every_n_steps`` optimizer steps and
    at the end of fit, it logs, over the batches of the window and all ranks:

    - per layer ``<prefix>/layer_<i>/<name>`` and for the model ``<prefix>/<name>``, with ``name``
      in ``STAT_NAMES`` (described in ``MoELoadMetric``);
    - ``<prefix>/tokens_per_sec``: token passes through MoE layers per second, summed over layers
      and ranks, over the host wall time between the window's batch ends (validation excluded).

    That is ``8 * L + 9`` series whatever the expert count; each window costs one all-reduce and one
    device-to-host copy.

    With ``plots=True``, global rank 0 writes every ``heatmap_every_n_steps`` steps
    ``<trainer.log_dir>/moe/expert_load_step<NNNNNN>.png`` (layers x experts, tokens / mean tokens per
    expert since the previous heatmap) and ``load_imbalance.png`` (per layer, over steps), and at the
    end of fit ``expert_load.png``. Each heatmap also goes to every ``TensorBoardLogger`` as the image
    ``<prefix>/expert_load``. PNGs are ``PLOT_SIZE_PX`` pixels.

    Args:
        every_n_steps: optimizer steps per logging window; ``None`` uses ``Trainer(log_every_n_steps)``
            (a Trainer value of 0 logs once, at the end of fit).
        heatmap_every_n_steps: optimizer steps between heatmaps; 0 renders only at the end of fit.
        plots: render the PNGs and TensorBoard images (needs matplotlib); ``False`` logs scalars only.
        prefix: first component of every logged name.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        heatmap_every_n_steps: int = 500,
        *,
        plots: bool = True,
        prefix: str = "moe_monitor",
    ) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(
                f"MoEMonitor(every_n_steps={every_n_steps!r}): pass an int >= 1, or None to follow "
                "Trainer(log_every_n_steps)."
            )
        if isinstance(heatmap_every_n_steps, bool) or not isinstance(heatmap_every_n_steps, int):
            raise TypeError(f"MoEMonitor(heatmap_every_n_steps={heatmap_every_n_steps!r}): pass an int.")
        if heatmap_every_n_steps < 0:
            raise ValueError(
                f"MoEMonitor(heatmap_every_n_steps={heatmap_every_n_steps!r}): pass an int >= 1, or 0 for a "
                "heatmap only at the end of fit."
            )
        if not isinstance(plots, bool):
            raise TypeError(f"MoEMonitor(plots={plots!r}): pass True or False.")
        if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
            raise ValueError(f"MoEMonitor(prefix={prefix!r}): pass a non-empty name without a trailing '/'.")
        if plots and importlib.util.find_spec("matplotlib") is None:
            raise ModuleNotFoundError(
                "MoEMonitor(plots=True) renders its heatmaps with matplotlib, which is not installed: "
                "`pip install matplotlib`, or pass plots=False to log scalars only."
            )
        self.every_n_steps = every_n_steps
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.plots = plots
        self.prefix = prefix
        self.metric: MoELoadMetric | None = None
        self._layers: list[MoELayer] = []
        self._reset()

    def _reset(self) -> None:
        """Forget everything of a previous run (the metric keeps its shape and device)."""
        if self.metric is not None:
            self.metric.reset()
        self._every = 0
        self._step = 0  # optimizer steps done, as counted by this monitor
        self._seen_global_step = 0
        self._window_batches = 0
        self._clock: float | None = None
        self._paused = 0.0
        self._validation_start: float | None = None
        self._log_dir: Path | None = None
        self._heat_LE: Tensor | None = None  # tokens since the last heatmap, summed over ranks (CPU)
        self._heat_first_step = 1
        self._last_heat: tuple[Tensor, int, int] | None = None
        self.history_steps: list[int] = []
        self.history_imbalance: list[list[float]] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # State pickled into spawned workers, or left over from an earlier fit, would be counted again.
        self._reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = moe_layers(pl_module)
        if not layers:
            raise ValueError(
                f"MoEMonitor found no MoELayer in {type(pl_module).__name__}: train with ExpertParallelStrategy "
                "(MoEConfig(smp_moe=True)) or call lightning_ep.transform(model) in configure_model()."
            )
        shapes = {(layer.num_experts, layer.top_k) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(
                f"MoEMonitor needs the same (num_experts, top_k) in every MoE layer, found {sorted(shapes)}; "
                "monitor such a model with one MoEMonitor per group of equal layers."
            )
        ((num_experts, top_k),) = shapes
        metric = self.metric
        if metric is None or (metric.num_layers, metric.num_experts, metric.top_k) != (len(layers), num_experts, top_k):
            metric = MoELoadMetric(len(layers), num_experts, top_k)
        # A LightningModule knows its device; a plain module (tests, Fabric) is where its layers are.
        device = getattr(pl_module, "device", None) or next(layers[0].parameters()).device
        self.metric = metric.to(device)
        self.metric.reset()
        self._layers = layers
        every = self.every_n_steps  # log_every_n_steps: set by Lightning's logger connector, not on the class
        self._every = every if every is not None else int(getattr(trainer, "log_every_n_steps", 50))
        self._step = self._seen_global_step = trainer.global_step
        self._heat_first_step = self._step + 1
        if self.plots:
            log_dir = trainer.log_dir  # a broadcast: every rank must ask
            self._log_dir = Path(log_dir if log_dir is not None else trainer.default_root_dir) / "moe"

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            self._clock = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._record()
        if trainer.global_step == self._seen_global_step:
            return  # accumulating gradients: the window goes on
        self._seen_global_step = trainer.global_step
        self._step += 1
        heatmap_due = self.heatmap_every_n_steps > 0 and self._step % self.heatmap_every_n_steps == 0
        if heatmap_due or (self._every > 0 and self._step % self._every == 0):
            self._flush(trainer)
        if heatmap_due:
            self._render(trainer, final=False)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            self._paused += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window_batches > 0:
            self._flush(trainer)
        self._render(trainer, final=True)

    def _record(self) -> None:
        """Add the layers' latest forward to the window, on the device."""
        assert self.metric is not None, "MoEMonitor: on_train_start must run before the first batch"
        device = self.metric.stats.device
        stacked: list[Any] = [_stack(self._layers, name, device) for name in _RECORDED]
        self.metric.update(*stacked)
        self._window_batches += 1

    def _flush(self, trainer: pl.Trainer) -> dict[str, float]:
        """Reduce the window over ranks (one all-reduce), log it, and start a new window."""
        assert self.metric is not None
        L, E = self.metric.num_layers, self.metric.num_experts
        stats = self.metric.compute()
        self.metric.reset()
        per_layer_SL = torch.stack([stats["layers"][name].reshape(L) for name in STAT_NAMES])
        model_S = torch.stack([stats["model"][name].reshape(()) for name in STAT_NAMES])
        flat = torch.cat(
            [per_layer_SL.reshape(-1), model_S, stats["moe_tokens"].reshape(1), stats["tokens_per_expert"].reshape(-1)]
        ).cpu()  # the window's one device-to-host copy
        now = time.perf_counter()
        seconds = now - self._clock - self._paused if self._clock is not None else math.inf
        self._clock, self._paused = now, 0.0
        self._window_batches = 0

        n = len(STAT_NAMES)
        per_layer = flat[: n * L].view(n, L).tolist()
        model = flat[n * L : n * L + n].tolist()
        moe_tokens = float(flat[n * L + n])
        tokens_LE = flat[n * L + n + 1 :].view(L, E)
        metrics = {f"{self.prefix}/{name}": model[s] for s, name in enumerate(STAT_NAMES)}
        metrics[f"{self.prefix}/tokens_per_sec"] = moe_tokens / max(seconds, 1e-9)
        for s, name in enumerate(STAT_NAMES):
            metrics |= {f"{self.prefix}/layer_{i}/{name}": per_layer[s][i] for i in range(L)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self._step - 1)  # Lightning's own step index for this step

        self._heat_LE = tokens_LE if self._heat_LE is None else self._heat_LE + tokens_LE
        self.history_steps.append(self._step)
        self.history_imbalance.append(per_layer[STAT_NAMES.index("load_imbalance")])
        return metrics

    def _render(self, trainer: pl.Trainer, *, final: bool) -> None:
        """Heatmap of the steps since the last one (the last one again at the end if none since)."""
        if not self.plots or not trainer.is_global_zero or self._log_dir is None:
            return
        fresh = self._heat_LE is not None
        if self._heat_LE is not None:
            self._last_heat = (self._heat_LE, self._heat_first_step, self._step)
            self._heat_LE, self._heat_first_step = None, self._step + 1
        if self._last_heat is None:
            return
        tokens_LE, first, last = self._last_heat
        self._log_dir.mkdir(parents=True, exist_ok=True)
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        figure = heatmap_figure(normalised_load(tokens_LE), title=f"expert load / mean load, {steps}")
        name = "expert_load.png" if final else f"expert_load_step{last:06d}.png"
        figure.savefig(self._log_dir / name, dpi=_DPI)
        if fresh:
            image = _rgb(figure)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_image(f"{self.prefix}/expert_load", image, last - 1, dataformats="HWC")
        if self.history_steps:
            imbalance = imbalance_figure(self.history_steps, self.history_imbalance)
            imbalance.savefig(self._log_dir / "load_imbalance.png", dpi=_DPI)


def _stack(layers: list[MoELayer], name: str, device: torch.device) -> Tensor | None:
    """The attribute ``name`` of each layer stacked on ``device`` (``[L, ...]``); of ``tokens_dropped``,
    0 where a layer has none, ``None`` if none has."""
    values: list[Any] = [getattr(layer, name, None) for layer in layers]
    if all(isinstance(value, Tensor) for value in values):
        return torch.stack([value.to(device) for value in values])
    if all(value is None for value in values):
        return None
    return torch.stack(
        [torch.as_tensor(0 if value is None else value).to(device, torch.float64).reshape(()) for value in values]
    )
