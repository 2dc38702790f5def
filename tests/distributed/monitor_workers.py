"""Worker bodies for ``test_monitor_reduction.py`` (imported by spawned processes).

The monitor is driven through its Callback hooks with a small stand-in for the Trainer (the hooks
read ``global_step``, ``log_every_n_steps`` and ``loggers``), around real ``MoELayer`` forwards on
each rank's own data. The reference is computed apart from the monitor: each rank sums its layers'
``tokens_per_expert`` and the sums are gathered after the monitor has done its work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.monitor.callback import STAT_NAMES, MoELoadMetric, MoEMonitor

H, I, E, K = 64, 32, 8, 2  # noqa: E741 (shape letters)
LAYERS = 2
STEPS, EVERY = 6, 3
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
    "barrier",
)  # fmt: skip


class Model(nn.Module):
    """``LAYERS`` residual ``MoELayer``s; experts 6 and 7 never win on positive inputs."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        layers = []
        for index in range(LAYERS):
            weight = torch.randn(E, H, generator=g) * 0.1
            weight[6:] = -1.0
            experts = GroupedExperts(
                nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.1),
                nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1),
                F.silu,
            )
            gate = TopKRouter(nn.Parameter(weight), top_k=K, mode="aux_loss")
            layers.append(MoELayer(gate, experts, MoEConfig(moe_load_balancing="aux_loss"), layer_index=index))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class ListLogger:
    """What the monitor needs of a Lightning logger: ``log_metrics``."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


class StubTrainer:
    def __init__(self) -> None:
        self.global_step = 0
        self.log_every_n_steps = EVERY
        self.loggers = [ListLogger()]


@contextlib.contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Record every torch.distributed collective called inside the block."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank-specific positive inputs; rank r has r + 1 sequences, so ranks weigh differently."""
    return torch.rand(rank + 1, 8, H, generator=torch.Generator().manual_seed(100 * step + rank))


def dirty_monitor() -> MoEMonitor:
    """A monitor with a window in progress, as if pickled mid-run into spawned workers."""
    monitor = MoEMonitor(plots=False)
    model = Model().train()
    trainer = StubTrainer()
    monitor.on_train_start(trainer, model)  # type: ignore[arg-type]
    model(torch.rand(4, 8, H))
    monitor.on_train_batch_end(trainer, model, None, None, 0)  # type: ignore[arg-type]
    monitor.history_steps.append(7)
    assert monitor.metric is not None and monitor.metric.stats.sum() > 0
    return monitor


def run_monitor_reduction(rank: int, world: int, monitor: MoEMonitor) -> None:
    assert monitor.metric is not None and monitor.metric.stats.sum() > 0, "the stale state must reach the worker"
    model = Model().train()
    trainer = StubTrainer()
    monitor.setup(trainer, model, "fit")  # type: ignore[arg-type]
    monitor.on_train_start(trainer, model)  # type: ignore[arg-type]

    local_LE = torch.zeros(STEPS // EVERY, LAYERS, E, dtype=torch.int64)
    entropy_x_tokens = torch.zeros(STEPS // EVERY, LAYERS, dtype=torch.float64)
    aux = torch.zeros(STEPS // EVERY, LAYERS, dtype=torch.float64)
    flush_calls = []
    for step in range(STEPS):
        window = step // EVERY
        x = batch(step, rank)
        monitor.on_train_batch_start(trainer, model, x, step)  # type: ignore[arg-type]
        model(x)
        for i, layer in enumerate(model.layers):
            local_LE[window, i] += layer.tokens_per_expert
            entropy_x_tokens[window, i] += layer.router_entropy.double() * x.shape[0] * x.shape[1]
            aux[window, i] += layer.aux_loss.double()
        trainer.global_step += 1
        with count_collectives() as calls:
            monitor.on_train_batch_end(trainer, model, None, None, step)  # type: ignore[arg-type]
        flush_calls.append(calls)
    # Nothing but the window's single all-reduce, and only at the window's end.
    assert flush_calls == [[], [], ["all_reduce"], [], [], ["all_reduce"]], flush_calls

    # The reference, gathered apart from the monitor.
    for tensor in (local_LE, entropy_x_tokens, aux):
        dist.all_reduce(tensor)
    total_LE = local_LE.sum(dim=0)
    assert torch.equal(monitor._heat_LE, total_LE.double()), (monitor._heat_LE, total_LE)
    assert monitor.history_steps == [EVERY, 2 * EVERY]
    if rank != 0:
        return
    tokens_per_step = sum(r + 1 for r in range(world)) * 8
    rows = trainer.loggers[0].rows
    assert [step for step, _ in rows] == [EVERY - 1, 2 * EVERY - 1]
    for window, (_, metrics) in enumerate(rows):
        counts_LE = local_LE[window].double()
        assert (counts_LE.sum(dim=1) == EVERY * tokens_per_step * K).all()  # no rank counted twice
        for i in range(LAYERS):
            c = counts_LE[i]
            assert metrics[f"moe_monitor/layer_{i}/dead_experts"] == (c == 0).sum().item()
            assert metrics[f"moe_monitor/layer_{i}/load_imbalance"] == (c.max() / c.mean()).item()
            cv = (c.std(correction=0) / c.mean()).item()
            assert abs(metrics[f"moe_monitor/layer_{i}/load_cv"] - cv) <= 1e-12 * cv
            entropy = (entropy_x_tokens[window, i] / (EVERY * tokens_per_step)).item()
            assert abs(metrics[f"moe_monitor/layer_{i}/router_entropy"] - entropy) <= 1e-12 * entropy
            mean_aux = (aux[window, i] / (EVERY * world)).item()
            assert abs(metrics[f"moe_monitor/layer_{i}/aux_loss"] - mean_aux) <= 1e-12 * mean_aux
        assert metrics["moe_monitor/dead_experts"] >= 2 * LAYERS
        assert metrics["moe_monitor/tokens_per_sec"] > 0
        assert len(metrics) == len(STAT_NAMES) * (LAYERS + 1) + 1


def run_metric_reduction(rank: int, world: int) -> None:
    """``MoELoadMetric`` alone: expert 5 gets tokens on the last rank only, so it is dead on every
    other rank but not in the job; reduced counts are the sum of the ranks' counts, twice over."""
    metric = MoELoadMetric(num_layers=1, num_experts=E, top_k=1)
    per_rank = [torch.tensor([[r + 1, 1, 1, 1, 1, 5 * (r == world - 1), 0, 0]]) for r in range(world)]
    for _ in range(2):
        metric.update(per_rank[rank], torch.ones(1), torch.full((1,), float(rank)), torch.zeros(1))
    with count_collectives() as calls:
        stats = metric.compute()
    assert calls == ["all_reduce"]
    expected = 2 * sum(per_rank)
    assert torch.equal(stats["tokens_per_expert"], expected.double())
    assert stats["layers"]["dead_experts"].item() == 2
    assert stats["layers"]["aux_loss"].item() == sum(range(world)) / world
    # compute() leaves this rank's own state in place (torchmetrics unsyncs): no double counting later.
    assert torch.equal(metric.stats[:E].view(1, E), 2 * per_rank[rank].double())


def run_reduction(rank: int, world: int, monitor: MoEMonitor) -> None:
    run_metric_reduction(rank, world)
    run_monitor_reduction(rank, world, monitor)
