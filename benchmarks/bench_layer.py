"""One MoE layer, forward + backward: time per phase, host syncs, and the floor beside it.

Pure torch (no Lightning, no transformers). For each shape, expert-parallel degree, dispatcher and
code variant it reports:

- ``fwd+bwd ms``: the median of ``layer(x).backward(g)`` timed with CUDA events;
- the phases router, permutation, all-to-all, experts, combine (forward + backward), from a second
  run whose tensors carry identity autograd marks that record a CUDA event in forward and in
  backward (so backward phases are timed too); the marks cost a few microseconds each;
- ``syncs``: device-to-host synchronisations of one fwd+bwd (``torch.cuda.set_sync_debug_mode``);
- the floor: expert compute ``18 * M * H * I`` at the grouped-GEMM rate, measured in this run on
  the layer's own per-expert row counts, plus four all-to-alls of the dispatched rows at the
  bandwidth measured in this run (``4 * t_a2a``; 0 at degree 1).

Variants (each toggles one change of the hot path, so its effect is measured in the same run):
``fast`` (the code as it is), ``sync-counts`` (counts per expert by ``torch.bincount``, which
reads the maximum id back to the host), ``atomic-bwd`` (permutations by ``index_select``, whose
backward zero-fills and scatter-adds), ``reference`` (both), ``serial-shared`` (shapes with a
shared expert: it runs after the dispatch exchange instead of during it). With a shared expert,
``all-to-all`` is the exchange time left exposed after the shared expert's work. Dispatcher
``symm`` (``LayerExecution(exchange="symmetric_memory")``) has no separate exchange: its pulls are
timed in ``permutation`` (dispatch) and ``combine``; ``symm-budget`` is the same with
``row_budget = --row-budget x tokens x top_k`` (the static plan: no host sync), and ``symm-graph``
that plan with ``cuda_graphs=True`` (dispatch, experts and combine replayed as CUDA graphs, captured
during the warm-up; no phases: the marked run would be eager). The ``dedup`` variant runs the
``a2a`` dispatcher deduplicated (``LayerExecution(token_dedup=True)``).

Run (two GPUs; degree 1 runs on each GPU alone):

    torchrun --nproc-per-node 2 benchmarks/bench_layer.py --shapes coarse fine --record
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    SHAPES,
    Shape,
    Timer,
    add_record_args,
    all_to_all_ms,
    count_host_syncs,
    dense_gemm_tflops,
    elapsed_ms,
    grouped_gemm_fwd_bwd_ms,
    log,
    markdown_table,
    rank,
    report,
    stamp,
    world,
)
from _variants import VARIANTS, variant
from torch import nn

from lightning_ep import LayerExecution
from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.dispatch import all_gather as dispatch_ag
from lightning_ep.moe.dispatch import all_to_all as dispatch_ep
from lightning_ep.moe.dispatch import dedup as dispatch_dedup

PHASES = ("router", "permutation", "all-to-all", "shared", "experts", "combine")


# ---------------------------------------------------------------- phase marks


class Timeline:
    """Stamps recorded in forward and in backward, each closing an interval with a label."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fwd: list[tuple[str | None, Any]] = []
        self.bwd: list[tuple[str | None, Any]] = []
        self.side = "dispatch"  # which side of the layer the collectives belong to

    def record(self, events: list[tuple[str | None, Any]], label: str | None) -> None:
        events.append((label, stamp(self.device)))

    def phases(self) -> dict[str, float]:
        """Milliseconds per phase, forward and backward together."""
        totals = dict.fromkeys(PHASES, 0.0)
        for events in (self.fwd, self.bwd):
            for (_, start), (label, end) in itertools.pairwise(events):
                if label in totals:
                    totals[label] += elapsed_ms(start, end)
        return totals


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, timeline: Timeline, fwd: str | None, bwd: str | None) -> torch.Tensor:
        timeline.record(timeline.fwd, fwd)
        ctx.timeline, ctx.label = timeline, bwd
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.timeline.record(ctx.timeline.bwd, ctx.label)
        return grad, None, None, None


def mark(x: torch.Tensor, timeline: Timeline, fwd: str | None, bwd: str | None) -> torch.Tensor:
    """Identity; closes the forward interval ``fwd`` now and the backward interval ``bwd`` when
    the gradient of ``x`` is ready."""
    if not x.requires_grad:
        timeline.record(timeline.fwd, fwd)
        return x
    return _Mark.apply(x, timeline, fwd, bwd)


@contextlib.contextmanager
def marked_collectives(timeline: Timeline) -> Iterator[None]:
    """Wrap the dispatchers' differentiable collectives with marks (the all-to-all phase)."""

    def side() -> str:
        return "permutation" if timeline.side == "dispatch" else "combine"

    def wrap(fn: Any) -> Any:
        def wrapped(x: torch.Tensor, *args: Any) -> torch.Tensor:
            x = mark(x, timeline, side(), "all-to-all")
            return mark(fn(x, *args), timeline, "all-to-all", side())

        return wrapped

    def wrap_start(fn: Any) -> Any:  # the launch closes the phase before it; the wait opens the next
        return lambda x, *args: fn(mark(x, timeline, side(), "all-to-all"), *args)

    def wrap_finish(fn: Any) -> Any:
        return lambda pending, *args: mark(fn(pending, *args), timeline, "all-to-all", side())

    wrappers = {
        "all_to_all": wrap,
        "all_gather_rows": wrap,
        "reduce_scatter_rows": wrap,
        "start_all_to_all": wrap_start,
        "finish_all_to_all": wrap_finish,
        "send_tokens": wrap_start,
        "receive_tokens": wrap_finish,
    }
    modules = (dispatch_ep, dispatch_ag, dispatch_dedup)
    saved = [(m, name, getattr(m, name)) for m in modules for name in wrappers if name in vars(m)]
    for module, name, fn in saved:
        setattr(module, name, wrappers[name](fn))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def marked_forward(layer: MoELayer, x_TH: torch.Tensor, timeline: Timeline) -> torch.Tensor:
    """``MoELayer.forward`` step by step (no jitter, no shuffle), with marks between the phases."""
    x_gate = mark(x_TH, timeline, None, "router")
    x_disp = mark(x_TH, timeline, "-", "permutation")
    expert_ids_TK, weights_TK, stats = layer._route(layer.gate, x_gate, layer.check_finite)
    weights_TK = mark(weights_TK, timeline, "router", "combine")
    timeline.side = "dispatch"
    with marked_collectives(timeline):
        dispatched = layer.dispatcher.dispatch(x_disp, expert_ids_TK, weights_TK)
        shared_TH = None
        if layer.overlap_shared:
            shared_TH = marked_shared(layer, x_TH, timeline)  # while the rows travel
        x_MH = mark(dispatched.x_MH, timeline, "permutation", "experts")
        if not layer.overlap_shared:
            shared_TH = marked_shared(layer, x_TH, timeline)
        y_MH = mark(layer.experts(x_MH, dispatched.counts_L, dispatched.counts_host), timeline, "experts", "combine")
        timeline.side = "combine"
        out_TH = layer.dispatcher.combine(y_MH, weights_TK, dispatched)
    if shared_TH is not None:
        out_TH = out_TH + shared_TH
    out_TH = mark(out_TH, timeline, "combine", "router")
    # The layer's own finiteness flag and loss bookkeeping, timed as router.
    if layer.check_finite:
        assert stats.logits_finite is not None
        layer.nonfinite = ~(stats.logits_finite & layer._all_finite(out_TH))
    counts_E = dispatched.tokens_per_expert_E
    kept_E = dispatched.kept_per_expert_E
    out_TH = layer._account(out_TH, stats, counts_E, kept_E if kept_E is not None else counts_E)
    return mark(out_TH, timeline, "router", None)


def marked_shared(layer: MoELayer, x_TH: torch.Tensor, timeline: Timeline) -> torch.Tensor | None:
    """The layer's shared experts, their forward and backward timed as ``shared``."""
    if layer.child_names["shared_experts"] not in layer._modules:
        return None
    x_TH = mark(x_TH, timeline, "-", "shared")
    shared_TH = layer._shared(x_TH)
    assert shared_TH is not None
    return mark(shared_TH, timeline, "shared", "-")


# ---------------------------------------------------------------- the layer


def build_layer(shape: Shape, balancing: str, device: torch.device, dtype: torch.dtype) -> MoELayer:
    """A Mixtral-style MoE layer with random weights (same on every rank), ``dtype`` parameters."""
    g = torch.Generator(device=device).manual_seed(0)
    H, I, E = shape.hidden, shape.inter, shape.experts  # noqa: E741
    gate_w = torch.randn(E, H, device=device, generator=g, dtype=dtype) * H**-0.5
    w1 = torch.randn(E, 2 * I, H, device=device, generator=g, dtype=dtype) * 0.02
    w2 = torch.randn(E, H, I, device=device, generator=g, dtype=dtype) * 0.02
    config = MoEConfig(moe_load_balancing=balancing)  # type: ignore[arg-type]
    gate = TopKRouter(nn.Parameter(gate_w), top_k=shape.top_k, mode=config.moe_load_balancing)
    experts = GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu)
    if not shape.shared_inter:
        return MoELayer(gate, experts, config).train()
    shared = SharedExpert(H, shape.shared_inter).to(device=device, dtype=dtype)
    shared_gate = nn.Linear(H, 1, bias=False).to(device=device, dtype=dtype)
    return MoELayer(gate, experts, config, shared_experts=shared, shared_experts_gate=shared_gate).train()


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP, as Qwen2-MoE's ``shared_expert``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def parallelize(
    layer: MoELayer, degree: int, dispatcher: str, device: torch.device, budget: int | None = None
) -> MoELayer:
    """Shard the experts over ``degree`` ranks (``degree == world``) and pick the dispatcher, as
    ``transform(..., mesh=..., execution=...)`` does for a model: the layer's ``LayerExecution``, then
    ``parallelize_moe_layers`` (``make_dispatcher``). ``budget``: the ``row_budget`` of ``symm-budget``
    and ``symm-graph``."""
    if degree == 1:
        return layer
    import dataclasses

    from lightning_ep.parallel.expert import parallelize_moe_layers
    from lightning_ep.parallel.mesh import init_mesh

    layer.config = dataclasses.replace(layer.config, moe_all_to_all_dispatcher=dispatcher != "allgather")
    execution = LayerExecution(
        exchange="symmetric_memory" if dispatcher.startswith("symm") else "collective",
        row_budget=budget if dispatcher in ("symm-budget", "symm-graph") else None,
        cuda_graphs=dispatcher == "symm-graph",
    )
    layer.set_execution(execution)  # make_dispatcher checks it for the degree
    holder = nn.ModuleDict({"moe": layer})
    parallelize_moe_layers(holder, init_mesh(degree, device_type=device.type))
    return layer


def median_ms(step: Any, device: torch.device, warmup: int, iters: int) -> float:
    """The median device time of ``step()`` over ``iters`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(iters):
        timer = Timer(device)
        timer.start()
        step()
        timer.stop()
        samples.append(timer.ms())
    return statistics.median(samples)


def measure(
    layer: MoELayer, shape: Shape, tokens: int, device: torch.device, dtype: torch.dtype, args: Any
) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(100 + rank())
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, generator=g).requires_grad_(True)
    grad = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    params = list(layer.parameters())

    def step() -> None:
        layer(x).backward(grad)
        x.grad = None
        for p in params:
            p.grad = None

    total = median_ms(step, device, args.warmup, args.iters)
    syncs = count_host_syncs(step)
    if layer.execution.cuda_graphs:  # the marked run is eager: no phases of the graphs
        return {"total": total, "marked": float("nan"), "syncs": syncs, **dict.fromkeys(PHASES, float("nan"))}

    phase_samples: dict[str, list[float]] = {p: [] for p in PHASES}
    marked = []
    for i in range(args.warmup + args.iters):
        timeline = Timeline(device)
        timer = Timer(device)
        timer.start()
        marked_forward(layer, x, timeline).backward(grad)
        timer.stop()
        x.grad = None
        for p in params:
            p.grad = None
        if i >= args.warmup:
            marked.append(timer.ms())
            for p, ms in timeline.phases().items():
                phase_samples[p].append(ms)
    phases = {p: statistics.median(v) for p, v in phase_samples.items()}
    return {"total": total, "marked": statistics.median(marked), "syncs": syncs, **phases}


def floor_ms(
    layer: MoELayer, shape: Shape, tokens: int, device: torch.device, dtype: torch.dtype, dense_tflops: float
) -> dict:
    """The floor (the module docstring's), from ceilings measured now on this layer's own routing; a shared
    expert adds its ``18 * T * H * I_shared`` FLOPs at the dense GEMM rate (no overlap assumed)."""
    with torch.no_grad():
        x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
        routing = layer.gate(x)
        dispatched = layer.dispatcher.dispatch(x, routing.expert_ids_TK, routing.weights_TK)
        counts = dispatched.counts_L.tolist()
        assert dispatched.x_MH.shape[0] >= sum(counts)  # also completes the exchange (symm-budget pads)
    rows = int(sum(counts))
    gemm = grouped_gemm_fwd_bwd_ms(counts, shape.hidden, shape.inter, device, dtype)
    shared = 18 * tokens * shape.hidden * shape.shared_inter / (dense_tflops * 1e12) * 1e3
    gemm_tflops = 18 * rows * shape.hidden * shape.inter / (gemm * 1e-3) / 1e12
    degree = getattr(layer.dispatcher, "degree", 1)
    a2a = all_to_all_ms(tokens * shape.top_k, shape.hidden, device, dtype) if degree > 1 else 0.0
    crossing = tokens * shape.top_k * shape.hidden * dtype.itemsize * (degree - 1) / degree
    bandwidth = crossing / (a2a * 1e-3) / 1e9 if a2a else float("nan")
    return {
        "rows": rows,
        "gemm_ms": gemm,
        "gemm_tflops": gemm_tflops,
        "a2a_ms": 4 * a2a,
        "a2a_GBps": bandwidth,
        "floor": gemm + shared + 4 * a2a,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["coarse", "fine"], choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GPU (batch x sequence)")
    parser.add_argument("--degrees", nargs="+", type=int, default=None, help="default: 1 and the world size")
    dispatchers = ["a2a", "allgather", "symm", "symm-budget", "symm-graph"]
    parser.add_argument("--dispatchers", nargs="+", default=["a2a", "allgather"], choices=dispatchers)
    parser.add_argument(
        "--row-budget",
        type=float,
        default=1.25,
        help="symm-budget and symm-graph rows: LayerExecution(row_budget=...) over tokens x top_k",
    )
    parser.add_argument(
        "--compile", action="store_true", help="MoELayer.compile_routing(): the routing (and a symm plan) compiled"
    )
    layer_variants = [v for v in VARIANTS if v not in ("root-head", "eager-loss")]  # model-level variants
    parser.add_argument("--variants", nargs="+", default=layer_variants, choices=layer_variants)
    parser.add_argument("--balancing", default="none", choices=["none", "aux_loss", "sinkhorn", "balanced"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    add_record_args(parser)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if world() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    dense = dense_gemm_tflops(device)
    log(f"dense GEMM: {dense:.0f} TFLOP/s on {device}")
    degrees = args.degrees or sorted({1, world()})

    rows: list[dict[str, Any]] = []
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for degree in degrees:
            if degree not in (1, world()):
                log(f"skip degree {degree}: runs at degree 1 or the world size ({world()})")
                continue
            for dispatcher in args.dispatchers if degree > 1 else ["local"]:
                budget = -(-int(args.row_budget * args.tokens * shape.top_k) // 128) * 128
                layer = build_layer(shape, args.balancing, device, dtype)
                layer = parallelize(layer, degree, dispatcher, device, budget)
                if args.compile:
                    layer.compile_routing()
                floor = floor_ms(layer, shape, args.tokens, device, dtype, dense)
                for name in args.variants:
                    if name == "serial-shared" and not shape.shared_inter:
                        continue
                    layer.overlap_shared = name != "serial-shared"
                    if hasattr(layer.dispatcher, "dedup"):  # the all-to-all: LayerExecution(token_dedup=...)
                        layer.dispatcher.dedup = name == "dedup"  # type: ignore[attr-defined]
                    with variant(name):
                        result = measure(layer, shape, args.tokens, device, dtype, args)
                    row = {
                        "shape": shape_name,
                        "D": degree,
                        "dispatcher": dispatcher,
                        "variant": name,
                        "fwd+bwd ms": result["total"],
                        **{p: result[p] for p in PHASES},
                        "marked ms": result["marked"],
                        "syncs": result["syncs"],
                        "floor ms": floor["floor"],
                        "x floor": result["total"] / floor["floor"],
                        "GEMM ms": floor["gemm_ms"],
                        "GEMM TF/s": floor["gemm_tflops"],
                        "4xA2A ms": floor["a2a_ms"],
                        "A2A GB/s": floor["a2a_GBps"],
                    }
                    rows.append(row)
                    log(
                        f"{shape_name} D={degree} {dispatcher:9s} {name:11s} "
                        f"{result['total']:8.2f} ms  floor {floor['floor']:7.2f}  syncs {result['syncs']}  "
                        + " ".join(f"{p}={result[p]:.2f}" for p in PHASES)
                    )
                del layer
                if cuda:
                    torch.cuda.empty_cache()

    notes = (
        f"Tokens per GPU {args.tokens}, balancing {args.balancing!r}, bf16 weights and activations, "
        + ("routing compiled (compile_routing), " if args.compile else "")
        + f"symm-budget and symm-graph rows: budget {args.row_budget} x tokens x top_k; "
        f"median of {args.iters} after {args.warmup} warm-ups; dense bf16 GEMM {dense:.0f} TFLOP/s. "
        "Phases are forward + backward; `marked ms` is the run that carries the phase marks. "
        "Floor = expert GEMMs at the grouped-GEMM rate measured now on the layer's own row counts "
        "(+ a shared expert's GEMMs at the dense rate) + 4 all-to-alls of the dispatched rows measured now "
        "(no overlap: a layer that overlaps its shared expert with the exchange can beat it). "
        "`syncs`: device-to-host synchronisations in one forward + backward."
    )
    title = f"bench_layer: one MoE layer, forward + backward ({world()} process(es))"
    report(title, markdown_table(rows), notes, args.record, args.results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
