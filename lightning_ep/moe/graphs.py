"""One MoE layer's dispatch, experts and combine replayed as CUDA graphs (``Execution(cuda_graphs=True)``).

With a static plan (``Dispatcher.static_plan``: the symmetric-memory dispatch with a row budget, or
the local dispatch at degree 1), nothing in a layer between its routing and its output depends on
the host, and at fine-grained shapes launching that part's hundred-odd small kernels takes the host
longer than the GPU takes to run them. ``LayerGraphs`` captures the part once in a CUDA graph for
the forward and one for the backward, then launches each with one call. At degree 1 the routing is
captured too when nothing of it is needed outside the layer (``GraphedLayer.take_routing``).

- the first ``WARMUP`` training calls of a layer run eagerly (Triton, ``torch.compile`` and NCCL
  initialise there); the next one captures the forward, and its backward the backward;
- each replay copies its inputs (tokens, expert ids, routing weights, or with the routing the
  router's parameters and buffers, which FSDP2 gathers anew each step; the output's gradient and
  the losses') into the graph's own buffers; the expert weights are read where they are, so the
  optimizer's in-place updates reach the graph (a weight that moved raises, see ``_check_weights``);
- the captured kernels are the eager ones, on the same values, so the results are the same bits;
- all layers' forward graphs share one memory pool and all their backward graphs another, captured
  in the order they replay (forwards in layer order, backwards in reverse), as
  ``torch.cuda.make_graphed_callables`` does; so a buffer one backward graph leaves behind may hold
  another backward graph's temporaries by the next backward pass (graphs captured after all earlier
  ones were released start new pools, see ``_shared_pools``);
- a call runs eagerly whenever the graph's shapes, dtypes or ``requires_grad`` differ, grad is off
  (evaluation), or the layer's last replayed forward still awaits its backward (a second forward
  before the backward would overwrite the activations the graph keeps).

Gradients: the gradients the backward graph returns live in its buffers. Autograd consumes the
input gradients before any other replay; a weight's first gradient of a step becomes that weight's
``.grad`` as is. Forward replays never write the backward pool, so that ``.grad`` survives the next
forward (Lightning zeroes gradients between the forward and the backward); before the first
backward replay of the next backward pass (of any layer) a ``.grad`` still pointing into a graph's
buffer is copied out (``_release_grads``): only under gradient accumulation.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_ep.moe.dispatch.base import Dispatcher
from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.experts.grouped import RoutedExperts, grouped_mm_supported, local_tensor
from lightning_ep.moe.graph_inputs import (
    backward_of,
    gate_tensors,
    plain_key,
    routed_key,
    static_copy,
    swapped,
    with_grad,
)
from lightning_ep.moe.routing.route import RouterStats
from lightning_ep.moe.tokens import LayerTokens

#: Eager training calls of a layer before its graphs are captured.
WARMUP = 2


class GraphedLayer:
    """``MoELayer._route_and_run`` replayed as CUDA graphs where a call allows it, and eagerly where
    not; the layer runs this in its place while ``LayerExecution.cuda_graphs`` is on. A dispatcher
    without a static plan, or on its dynamic plan (the budget fallback's rerun), runs eagerly."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.graphs: LayerGraphs | None = None

    def __call__(
        self,
        x_TH: torch.Tensor,
        tokens: LayerTokens,
        z_weight_T: torch.Tensor | None,
        draw_id: int,
        shuffle_state: Any,
        shape: torch.Size,
    ) -> tuple[torch.Tensor, torch.Tensor | None, RouterStats, torch.Tensor, torch.Tensor]:
        layer, graphs = self.layer, self._graphs()
        if graphs is None:
            return layer._route_and_run(x_TH, tokens, z_weight_T, draw_id, shuffle_state, shape)
        routed = self.take_routing(tokens, z_weight_T)
        if routed and graphs.applies_routed(x_TH, layer.gate, layer.check_finite):
            out_TH, counts_E, losses = graphs.routed(x_TH, layer.gate, layer._route, layer.check_finite)
            return out_TH, layer._shared(x_TH), RouterStats(*losses, out_TH[:0]), counts_E, counts_E
        ids_TK, weights_TK, stats = layer._route_tokens(x_TH, tokens, z_weight_T, shuffle_state, shape)
        if not routed and tokens.valid_T is None and graphs.applies(x_TH, ids_TK, weights_TK):
            out_TH, counts_E = graphs(x_TH, ids_TK, weights_TK)
            return out_TH, layer._shared(x_TH), stats, counts_E, counts_E
        out_TH, shared_TH, counts_E, kept_E = layer._dispatch_and_combine(x_TH, ids_TK, weights_TK, draw_id, tokens)
        return out_TH, shared_TH, stats, counts_E, kept_E

    def take_routing(self, tokens: LayerTokens, z_weight_T: torch.Tensor | None) -> bool:
        """Whether the graphs replay the routing too: degree 1, all tokens real, no shuffle, no logits kept."""
        layer = self.layer
        plain = tokens.valid_T is None and z_weight_T is None and layer.shuffle is None
        return plain and layer.dispatcher.group is None and not layer.router_logits.active()

    def release(self) -> None:
        """Drop the graphs (see ``LayerGraphs.release``); the next training calls warm up and capture anew."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _graphs(self) -> LayerGraphs | None:
        """The graphs of the layer's dispatcher (made on first use), or ``None`` where it runs eagerly."""
        dispatcher = self.layer.dispatcher
        if not dispatcher.static_plan or dispatcher.dynamic:
            return None
        if self.graphs is None or self.graphs.dispatcher is not dispatcher:
            self.graphs = LayerGraphs(dispatcher, self.layer.experts)
        return self.graphs


class LayerGraphs:
    """The forward and backward CUDA graphs of one layer's dispatch (with a static plan), experts
    (whose weights must not move, see ``_check_weights``) and combine."""

    #: Per device, the memory pools the live forward and backward graphs share, and the layers whose
    #: graphs live in them.
    _pools: ClassVar[dict[int, tuple[Any, Any]]] = {}
    _members: ClassVar[dict[int, weakref.WeakSet[LayerGraphs]]] = {}
    _streams: ClassVar[dict[int, torch.cuda.Stream]] = {}
    #: Per device, the layers whose backward replayed since the last forward replay, and those whose
    #: backward replayed before it (an earlier backward pass): their weights' ``.grad`` may still be
    #: their graph's buffer (see ``_release_grads``).
    _replayed_backward: ClassVar[dict[int, weakref.WeakValueDictionary[int, LayerGraphs]]] = {}
    _earlier_pass: ClassVar[dict[int, weakref.WeakValueDictionary[int, LayerGraphs]]] = {}

    def __init__(self, dispatcher: Dispatcher, experts: RoutedExperts) -> None:
        if not dispatcher.static_plan:
            raise ValueError(
                f"Execution(cuda_graphs=True) needs a dispatch with a static plan, got {type(dispatcher).__name__} "
                "without one: the local dispatch (degree 1), or exchange='symmetric_memory' with an int row_budget."
            )
        if any(isinstance(m, FrozenExpertWeight) for m in experts.children()):
            raise ValueError(
                "Execution(cuda_graphs=True) replays the experts' GEMMs on their weights in place, but this layer "
                "keeps its frozen experts quantized (frozen_experts) and dequantizes them in every forward and "
                "backward; use cuda_graphs='auto' or False."
            )
        self.dispatcher, self.experts = dispatcher, experts
        self.calls = 0
        self.device = -1  # the CUDA device index, from the capture
        self.fwd: torch.cuda.CUDAGraph | None = None
        self.bwd: torch.cuda.CUDAGraph | None = None
        self._token: weakref.ref[_Pending] | None = None  # the last replayed forward's
        self._key: tuple[Any, ...] | None = None
        # x_TH, ids_TK, weights_TK (routed: x_TH, the router's tensors), then the weights' local shards
        self._static: list[torch.Tensor] = []
        self._writable: list[torch.Tensor] = []  # those before the weights, written before each replay
        # out_TH, counts_E (routed: then aux_loss, z_loss, entropy, logits_finite); the loads apart
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._loads: torch.Tensor | None = None  # the symmetric-memory dispatch's received rows per rank
        self._grad_outs: list[torch.Tensor] = []  # the output's gradient (routed: then the losses')
        self._grads: list[torch.Tensor | None] = []
        self._gate: nn.Module | None = None  # the router, when the routing is captured
        self._gate_names: list[str] = []
        self._takes: list[int] = []  # positions in ``_outputs`` whose gradients the backward takes
        self._pointers: list[int] = []
        self._layer_pools: tuple[Any, Any] | None = None  # forward, backward

    @property
    def pending(self) -> bool:
        """Whether the last replayed forward's autograd graph is alive and its backward has not run."""
        token = self._token() if self._token is not None else None
        return token is not None and not token.done

    def applies(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> bool:
        """Whether this call replays the graphs from the dispatch on (else the caller runs eagerly)."""
        return self._applies(x_TH, lambda: plain_key(x_TH, expert_ids_TK, weights_TK, self._weights()))

    def applies_routed(self, x_TH: torch.Tensor, gate: nn.Module, check_finite: bool) -> bool:
        """Whether this call replays the graphs with the routing (``routed``; else it runs eagerly)."""
        return self._applies(x_TH, lambda: routed_key(x_TH, gate, check_finite, self._weights()))

    def _applies(self, x_TH: torch.Tensor, make_key: Any) -> bool:
        if not (torch.is_grad_enabled() and x_TH.is_cuda) or self.pending:
            return False
        key = make_key()
        if not any(key[-1]):  # nothing needs a gradient
            return False
        if self.fwd is not None:
            return key == self._key
        self.calls += 1
        return self.calls > WARMUP

    def __call__(
        self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out_TH`` and the tokens per expert ``counts_E``, as the eager layer computes them."""
        weights = [local_tensor(p) for p in self._weights()]
        budget = self.dispatcher.budget  # the symmetric-memory dispatch's row budget
        if budget is not None and budget.raise_at_dispatch:
            budget.check(wait=False)
        if self.fwd is None:
            self._capture_forward(x_TH, expert_ids_TK, weights_TK, weights)
        out_TH, counts_E = _Replay.apply(self, x_TH, expert_ids_TK, weights_TK, *weights)[:2]
        if budget is not None:
            assert self._loads is not None
            budget.note(self._loads)
        return out_TH, counts_E

    def routed(
        self, x_TH: torch.Tensor, gate: nn.Module, route: Any, check_finite: bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``out_TH``, the tokens per expert and ``(aux_loss, z_loss, entropy, logits_finite,
        selection_gap)`` as the layer's ``route(gate, x_TH, check_finite)`` and the eager dispatch,
        experts and combine give them (``logits_finite`` all true unless checked). Degree 1 only."""
        if self.fwd is None:
            self._capture_routed(x_TH, gate, route, check_finite)
        tensors = [getattr(gate, name) for name in self._gate_names]
        weights = [local_tensor(p) for p in self._weights()]
        out_TH, counts_E, aux, zl, entropy, finite, gap = _Replay.apply(self, x_TH, *tensors, *weights)
        return out_TH, counts_E, (aux, zl, entropy, finite, gap)

    def replay_forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The graph's outputs (``_outputs``), cloned out of its buffers."""
        written = len(self._writable)
        self._check_weights(inputs[written:])
        replayed = LayerGraphs._replayed_backward.pop(self.device, None)
        if replayed is not None:  # the next backward replay starts a new backward pass
            LayerGraphs._earlier_pass.setdefault(self.device, weakref.WeakValueDictionary()).update(replayed)
        with torch.no_grad():
            for static, value in zip(self._writable, inputs[:written], strict=True):
                static.copy_(value)
        assert self.fwd is not None
        self.fwd.replay()
        return tuple(t.clone() for t in self._outputs)

    def replay_backward(self, grads_in: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads_in``: the gradients of the output (and of the losses), ``None`` for zero."""
        if self.bwd is None:
            self._capture_backward()
        assert self.bwd is not None
        for graphs in list(LayerGraphs._earlier_pass.pop(self.device, {}).values()):
            graphs._release_grads()
        for static, grad in zip(self._grad_outs, grads_in, strict=True):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        self.bwd.replay()
        LayerGraphs._replayed_backward.setdefault(self.device, weakref.WeakValueDictionary())[id(self)] = self
        return self._grads

    def _release_grads(self) -> None:
        """Copy out a weight's ``.grad`` that is still the backward graph's buffer, which any layer's next
        backward replay may reuse (the module docstring's Gradients); none after ``zero_grad(set_to_none=True)``."""
        # What each of ``_grads`` is the gradient of, now (the router's tensors as FSDP2 holds them in
        # backward); ``None`` for the graph's other inputs.
        gate = [getattr(self._gate, n) for n in self._gate_names] if self._gate is not None else []
        owners = [None] * (len(self._writable) - len(gate)) + gate + list(self._weights())
        for p, grad in zip(owners, self._grads, strict=True):
            if p is None or grad is None or p.grad is None:
                continue
            if local_tensor(p.grad).data_ptr() == grad.data_ptr():
                p.grad = p.grad.clone()

    def release(self) -> None:
        """Drop the graphs and their buffers (a later training call captures anew after its warm-up).
        A process must do this before ``torch.distributed.destroy_process_group``: NCCL does not tear
        down a communicator that a live graph still launches on (``ExpertParallelStrategy.teardown``
        does it; elsewhere ``MoELayer.release_graphs``)."""
        if self.fwd is not None:
            torch.cuda.synchronize()
        self.fwd = self.bwd = self._layer_pools = None
        self._static, self._writable, self._outputs, self._grads, self._grad_outs = [], [], (), [], []
        self._key, self._token, self.calls, self._gate, self._gate_names = None, None, 0, None, []
        self._loads = None
        for registry in (LayerGraphs._replayed_backward, LayerGraphs._earlier_pass):
            if self.device in registry:
                registry[self.device].pop(id(self), None)

    def _weights(self) -> list[nn.Parameter]:
        return list(self.experts.parameters())

    def _check_weights(self, weights: tuple[torch.Tensor, ...]) -> None:
        if [w.data_ptr() for w in weights] != self._pointers:
            raise RuntimeError(
                "Execution(cuda_graphs=True): the experts' weights moved in memory since their CUDA graphs were "
                "captured (assigned anew, or gathered by FSDP2 each step), so the graphs would read stale "
                "memory. Keep the experts outside FSDP2 (expert-parallel degree = world size) and update their "
                "weights in place, or set cuda_graphs=False."
            )

    def _core(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, weights: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        dispatched, loads_D = self.dispatcher.dispatch_static(x_TH, ids_TK)
        names = [name for name, _ in self.experts.named_parameters()]
        y_MH = torch.func.functional_call(
            self.experts, dict(zip(names, weights, strict=True)), (dispatched.x_MH, dispatched.counts_L, None)
        )
        out_TH = self.dispatcher.combine(y_MH, weights_TK, dispatched)
        return out_TH, dispatched.tokens_per_expert_E, loads_D

    def _capture_forward(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, weights: list[torch.Tensor]
    ) -> None:
        self._check_grouped(x_TH)
        self._key = plain_key(x_TH, ids_TK, weights_TK, self._weights())
        self._set_static([x_TH, ids_TK, weights_TK], weights)
        with torch.enable_grad(), self._capturing(self.fwd, self._layer_pools[0]):  # type: ignore[index]
            x, ids, w = self._static[:3]
            out_TH, counts_E, self._loads = self._core(x, ids, w, self._static[3:])
        self._outputs = (out_TH, counts_E)
        self._takes = with_grad(self._outputs)

    def _capture_routed(self, x_TH: torch.Tensor, gate: nn.Module, route: Any, check_finite: bool) -> None:
        self._check_grouped(x_TH)
        self._key = routed_key(x_TH, gate, check_finite, self._weights())
        self._gate = gate
        named = gate_tensors(gate)
        self._gate_names = [name for name, _ in named]
        self._set_static([x_TH, *(t for _, t in named)], [local_tensor(p) for p in self._weights()])
        gate_static = self._static[1 : len(self._writable)]

        def routed() -> tuple[torch.Tensor, ...]:
            with swapped(gate, dict(zip(self._gate_names, gate_static, strict=True))):
                ids_TK, weights_TK, stats = route(gate, self._static[0], check_finite, None, None)
            weights = self._static[len(self._writable) :]
            out_TH, counts_E, _ = self._core(self._static[0], ids_TK, weights_TK, weights)  # no loads at degree 1
            finite = stats.logits_finite
            if finite is None:
                finite = torch.ones((), dtype=torch.bool, device=out_TH.device)
            return out_TH, counts_E, stats.aux_loss, stats.z_loss, stats.entropy, finite, stats.selection_gap

        # One forward and backward before the capture, on the capture's stream and inputs: a
        # compilation or lazy initialisation they trigger happens here, not inside the capture.
        stream = LayerGraphs._streams[self.device]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.enable_grad():
            backward_of(routed(), self._static)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.enable_grad(), self._capturing(self.fwd, self._layer_pools[0]):  # type: ignore[index]
            self._outputs = routed()
        self._takes = with_grad(self._outputs)

    def _check_grouped(self, x_TH: torch.Tensor) -> None:
        """Refuse experts whose GEMMs would fall back to the per-expert loop (host counts)."""
        dtype = self.experts.compute_dtype

        def on_meta(w: torch.Tensor) -> torch.Tensor:  # what a GEMM multiplies: only its dtype and shape matter
            return local_tensor(w).detach().to(device="meta", dtype=dtype or w.dtype)

        names = ("gate_up_proj", "down_proj")
        gemm_local = [on_meta(w) for w in (getattr(self.experts, n, None) for n in names) if w is not None]
        if self.experts.use_grouped_mm is False or not grouped_mm_supported(x_TH, *gemm_local):
            raise ValueError(
                "Execution(cuda_graphs=True) needs the experts' grouped GEMM (bf16 or fp16 rows and weights on CUDA, "
                f"use_grouped_mm not False), but the rows are {x_TH.dtype} and the weights "
                f"{[w.dtype for w in gemm_local]}: the per-expert loop reads the counts on the host, which a graph "
                "cannot. Train in bf16 (precision='bf16-true' or 'bf16-mixed') or set cuda_graphs=False."
            )
        if not self.experts.grouped_mm_runs(x_TH, [on_meta(w) for w in self._weights()]):
            raise ValueError(
                "Execution(cuda_graphs=True) needs the grouped GEMM for every weight of the experts, LoRA factors "
                f"included, whose rows must be 16-byte aligned, but their shapes are "
                f"{[tuple(w.shape) for w in self._weights()]}: the per-expert loop reads the counts on the host, which "
                "a graph cannot. Use a LoRA rank that is a multiple of 8, or set cuda_graphs=False."
            )

    def _set_static(self, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
        """The graph's input buffers: copies of ``inputs`` (written before each replay), then ``weights``
        where they are; the memory pools and the forward graph to capture into."""
        # ``.data``: aliases with a version counter of their own. The capture's autograd graph saves the
        # inputs at version 0; the replays' writes into them, and the optimizer's into the weights, must
        # not count as changes before the backward's capture checks those versions.
        self._static = [static_copy(t) for t in inputs]
        self._static += [w.data.requires_grad_(w.requires_grad) for w in weights]
        self._writable = [t.data for t in self._static[: len(inputs)]]
        self._pointers = [w.data_ptr() for w in weights]
        self.device = inputs[0].device.index
        self._layer_pools = self._shared_pools()
        if self.device not in LayerGraphs._streams:
            LayerGraphs._streams[self.device] = torch.cuda.Stream()
        self.fwd = torch.cuda.CUDAGraph()

    def _capture_backward(self) -> None:
        self._grad_outs = [torch.zeros_like(self._outputs[i]) for i in self._takes]
        self.bwd = torch.cuda.CUDAGraph()
        assert self._layer_pools is not None
        with self._capturing(self.bwd, self._layer_pools[1]):
            self._grads = backward_of(self._outputs, self._static, self._grad_outs)
        self._outputs = tuple(t.detach() for t in self._outputs)  # frees the capture's autograd graph

    def _shared_pools(self) -> tuple[Any, Any]:
        """The device's forward and backward pools while another layer's graphs live in them, else new
        ones: once every graph of a pool is gone, CUDA's caching allocator refuses new captures into it
        (an internal assert) as long as any tensor it allocated there lives on (a gradient, say)."""
        members = LayerGraphs._members.setdefault(self.device, weakref.WeakSet())
        if not any(m.fwd is not None for m in members if m is not self):
            LayerGraphs._pools[self.device] = (torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle())
        members.add(self)
        return LayerGraphs._pools[self.device]

    def _capturing(self, graph: torch.cuda.CUDAGraph | None, pool: Any) -> Any:
        assert graph is not None
        # thread_local: NCCL's watchdog thread may query its events while this thread captures.
        return torch.cuda.graph(
            graph, pool=pool, stream=LayerGraphs._streams[self.device], capture_error_mode="thread_local"
        )


class _Pending:
    """Held by a replayed forward's autograd node, and weakly by its layer (``LayerGraphs.pending``)."""

    __slots__ = ("__weakref__", "done")

    def __init__(self) -> None:
        self.done = False


class _Replay(torch.autograd.Function):
    """The replayed graphs: ``out_TH``, ``counts_E`` (routed: then ``aux_loss``, ``z_loss``, ``entropy``,
    ``logits_finite``, ``selection_gap``); the gradients of ``out_TH`` and of the losses flow back."""

    @staticmethod
    def forward(ctx: Any, graphs: LayerGraphs, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = graphs.replay_forward(inputs)
        ctx.graphs, ctx.token = graphs, _Pending()
        graphs._token = weakref.ref(ctx.token)
        ctx.mark_non_differentiable(*(t for i, t in enumerate(outputs) if i not in (0, 2, 3)))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.token.done:
            raise RuntimeError(
                "Execution(cuda_graphs=True): a second backward through the same forward (retain_graph=True) cannot "
                "replay the backward graph, whose buffers the first backward reused; set cuda_graphs=False."
            )
        ctx.token.done = True
        return (None, *ctx.graphs.replay_backward([grads[i] for i in ctx.graphs._takes]))
