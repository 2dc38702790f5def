"""The plots of ``MoEMonitor``: an expert-load heatmap and load imbalance over steps (matplotlib, no pyplot).

Legend: L MoE layers, E experts per layer, N logging windows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

#: Width and height in pixels of every PNG the monitor writes.
PLOT_SIZE_PX = (640, 480)
DPI = 80


def normalised_load(tokens_LE: Tensor) -> Tensor:
    """Tokens per expert divided by the layer's mean (1 = an even share); 0 for a layer without tokens."""
    tokens_LE = tokens_LE.double()
    mean_L1 = tokens_LE.mean(dim=1, keepdim=True)
    return torch.where(mean_L1 > 0, tokens_LE / mean_L1.clamp_min(1e-30), torch.zeros_like(tokens_LE))


def _figure() -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(PLOT_SIZE_PX[0] / DPI, PLOT_SIZE_PX[1] / DPI), dpi=DPI)
    FigureCanvasAgg(figure)  # no pyplot: no global state, no GUI backend
    return figure


def heatmap_figure(load_LE: Tensor, title: str = "expert load / mean load") -> Figure:
    """A layers x experts heatmap of ``load_LE`` (``normalised_load``), cells labelled when few."""
    figure = _figure()
    axes = figure.add_subplot()
    values = load_LE.double().numpy()
    num_layers, num_experts = values.shape
    image = axes.imshow(values, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
    figure.colorbar(image, ax=axes, label="tokens / mean tokens per expert")
    axes.set_xlabel("expert")
    axes.set_ylabel("MoE layer")
    axes.set_title(title)
    if num_experts <= 32:
        axes.set_xticks(range(num_experts))
    if num_layers <= 32:
        axes.set_yticks(range(num_layers))
    if num_layers * num_experts <= 128:
        threshold = 0.5 * float(values.max()) if values.size else 0.0
        for row in range(num_layers):
            for col in range(num_experts):
                value = float(values[row, col])
                color = "black" if value > threshold else "white"
                axes.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=8, color=color)
    figure.tight_layout()
    return figure


def imbalance_figure(steps: list[int], imbalance_NL: list[list[float]]) -> Figure:
    """Load imbalance (max / mean tokens per expert) of each layer against the optimizer step."""
    from matplotlib.ticker import MaxNLocator

    figure = _figure()
    axes = figure.add_subplot()
    num_layers = len(imbalance_NL[0]) if imbalance_NL else 0
    marker = "." if len(steps) < 50 else None
    for layer in range(num_layers):
        axes.plot(steps, [row[layer] for row in imbalance_NL], marker=marker, label=f"layer {layer}")
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("max / mean tokens per expert")
    axes.set_title("load imbalance per MoE layer (1 = even)")
    if 0 < num_layers <= 16:
        axes.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    return figure


def rgb(figure: Figure) -> np.ndarray:
    """The rendered figure as ``[H, W, 3]`` uint8 (for ``SummaryWriter.add_image``)."""
    import numpy as np

    canvas = figure.canvas
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # type: ignore[attr-defined]
