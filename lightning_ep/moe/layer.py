"""``MoELayer``: route -> dispatch -> experts -> combine, the drop-in for a Hugging Face MoE block.

Legend: B batch, S sequence, T = B * S tokens on this rank, H hidden size, E experts, K experts
per token, M rows received by the local experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch.base import Dispatcher
from lightning_ep.moe.dispatch.rows import count_ids
from lightning_ep.moe.dispatch.select import make_dispatcher
from lightning_ep.moe.experts.grouped import RoutedExperts
from lightning_ep.moe.layer_execution import LayerExecution
from lightning_ep.moe.routing.losses import attach_losses
from lightning_ep.moe.routing.rng import DrawCounter, ForwardRecords, in_backward, jitter_factors, layer_generator
from lightning_ep.moe.routing.route import RouterLogits, RouterStats, all_finite, route
from lightning_ep.moe.routing.router import TopKRouter
from lightning_ep.moe.tokens import LayerTokens, TokenBatch, origin_weights, select_tokens

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.dispatch.shuffle import ShufflePlan, TokenShuffle
    from lightning_ep.moe.graphs import GraphedLayer

_MAX_KEPT = 4  # KeptExchange entries per layer awaiting their recomputation
_MAX_TOKEN_BATCHES = 64  # token batches of training forwards awaiting their recomputation, as DrawCounter
# The layer's roles for its children; ``MoELayer(child_names=...)`` maps them to Hugging Face names.
_ROLES = {"gate": "gate", "shared_experts": "shared_experts", "shared_experts_gate": "shared_experts_gate"}


class MoELayer(nn.Module):
    """A sparse MoE block: a top-k router (``gate``), routed experts (``experts``), optional shared
    experts, and the dispatcher that moves tokens between them.

    The children carry the Hugging Face block's names (``child_names`` maps this layer's roles to
    them, e.g. GPT-OSS's router is ``router``; ``layer.gate`` always reaches the router), and their
    parameters are the block's own ``Parameter`` objects, so state-dict keys, shapes and values are
    unchanged.

    Shared experts are dense modules applied to every token and added to the routed output, scaled
    by ``sigmoid(shared_experts_gate(x))`` if gated (Qwen2-MoE), sharded like dense weights. With
    ``overlap_shared`` (the default) they run while the all-to-all dispatch moves the rows (and its
    reverse their backward); ``False`` runs them after the rows arrived. Same numbers.

    ``keep_all_to_all`` (``ExpertParallelStrategy(activation_checkpointing="keep_all_to_all")``):
    the activation-checkpointing recomputation reuses the forward's exchange (``kept.KeptExchange``:
    all-to-all dispatcher only; same numbers, more memory held until the recomputation).

    After each forward the layer holds, for logging and balancing:

    - ``aux_loss``, ``z_loss``: the load-balancing and router z-losses of this rank's tokens (0-dim,
      detached, unweighted);
    - ``tokens_per_expert``: int64 ``[E]``, tokens this rank routed to each global expert;
    - ``router_entropy``: mean over this rank's tokens of the entropy (nats) of the router's
      softmax probabilities (0-dim, detached); ``log(E)`` for a uniform router, 0 for a one-hot one;
    - ``selection_gap``: the fraction of this rank's tokens whose training ``"sinkhorn"`` choice
      differs from the plain top-k of inference (0-dim, detached; 0 in every other case).

    The weighted losses reach the gradients by themselves (see ``losses.attach_losses``), except
    under a frozen router (``TopKRouter.frozen``); their gradient is multiplied by ``loss_scale``
    (``1 / accumulate_grad_batches`` under gradient accumulation, or a ``GradScaler``'s scale).

    Args:
        experts: the routed experts (local shard under expert parallelism).
        jitter_noise: multiplicative input jitter in training (Mixtral's ``router_jitter_noise``):
            ``x *= U(1 - j, 1 + j)``, applied to what the router and the experts see.
        layer_index: position among the model's MoE layers; separates the layers' random streams.
        shared_experts: ``[..., H] -> [..., H]``; ``shared_experts_gate``: ``[..., H] -> [..., 1]`` logits.
    """

    gate: TopKRouter  # registered under child_names["gate"]; see __getattr__

    def __init__(
        self,
        gate: TopKRouter,
        experts: RoutedExperts,
        config: MoEConfig,
        *,
        jitter_noise: float = 0.0,
        layer_index: int = 0,
        shared_experts: nn.Module | None = None,
        shared_experts_gate: nn.Module | None = None,
        child_names: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if gate.num_experts != experts.num_experts:
            raise ValueError(f"the gate routes to {gate.num_experts} experts but experts holds {experts.num_experts}.")
        if shared_experts_gate is not None and shared_experts is None:
            raise ValueError("MoELayer(shared_experts_gate=...) needs shared_experts: the gate scales their output.")
        self.child_names = {**_ROLES, **(child_names or {})}
        self.add_module(self.child_names["gate"], gate)
        self.experts = experts
        for role, module in (("shared_experts", shared_experts), ("shared_experts_gate", shared_experts_gate)):
            if module is not None:
                self.add_module(self.child_names[role], module)
        self.config = config
        self.jitter_noise = float(jitter_noise)
        self.layer_index = layer_index
        self.loss_scale = 1.0
        self.overlap_shared = True
        self.keep_all_to_all = False
        self._kept: ForwardRecords[KeptExchange | None] = ForwardRecords(_MAX_KEPT)
        self.dispatcher: Dispatcher = make_dispatcher(config, gate.num_experts)
        # With ``execution.cuda_graphs``: what runs in place of ``_route_and_run`` (``graphs.GraphedLayer``).
        self.graphed: GraphedLayer | None = None
        self.execution = LayerExecution()
        self.set_execution(self.execution)
        # A TokenShuffle when global_token_shuffle is on under expert parallelism.
        self.shuffle: TokenShuffle | None = None
        self.ep_rank = 0
        self._draws = DrawCounter()
        self.aux_loss = torch.zeros(())
        self.z_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(gate.num_experts, dtype=torch.int64)
        # (token, expert) pairs dropped by the capacity limit in the latest forward (0: dropless).
        self.tokens_dropped = torch.zeros((), dtype=torch.int64)
        # With check_finite: a 0-dim bool, set when the latest forward's router logits or output held a NaN or inf.
        self.check_finite = False
        self.nonfinite = torch.zeros((), dtype=torch.bool)
        self.router_entropy = torch.zeros(())
        self.selection_gap = torch.zeros(())
        # Eager by default; ``compile_routing`` swaps in compiled versions of the same functions.
        self._route = route
        self._all_finite = all_finite
        # Not a registered child: the layer's children stay the Hugging Face block's.
        self.router_logits: RouterLogits
        object.__setattr__(self, "router_logits", RouterLogits())
        # ``models.hf_compat``: transformers' experts of the replaced block, run as ``hf_experts(experts, x, ids,
        # weights)`` while ``hf_experts.active()`` (``config._experts_implementation``); ``None``: this library's.
        self.hf_experts: Any = None
        # The current call's padding, from the model's pre-hook (``models.padding``); ``None``: all tokens real.
        self.token_batch: TokenBatch | None = None
        self._token_batches: ForwardRecords[TokenBatch | None] = ForwardRecords(_MAX_TOKEN_BATCHES)

    def compile_routing(self, **compile_kwargs: Any) -> None:
        """Run the routing (``route``), the output's finiteness check and the dispatcher's plan
        (``compile_plan``) through ``torch.compile``: a few fused kernels instead of some thirty small
        ones per layer. The rest stays eager."""
        self._route = torch.compile(route, **compile_kwargs)
        self._all_finite = torch.compile(all_finite, **compile_kwargs)
        self.dispatcher.compile_plan(**compile_kwargs)

    def set_execution(self, execution: LayerExecution) -> None:
        """Run with ``execution``'s choices (the dispatcher takes them when the mesh is applied)."""
        self.execution = execution
        self.experts.host_counts_in_backward = not execution.cuda_graphs  # graph replays cannot read the host
        if not execution.cuda_graphs:
            self.release_graphs()
            self.graphed = None
        elif self.graphed is None:
            from lightning_ep.moe.graphs import GraphedLayer

            self.graphed = GraphedLayer(self)

    def release_graphs(self) -> None:
        """Drop this layer's CUDA graphs, e.g. before destroying the process group their NCCL exchange uses."""
        if self.graphed is not None:
            self.graphed.release()

    def __getattr__(self, name: str) -> Any:
        # Roles resolve to the Hugging Face child names (``layer.gate`` is GPT-OSS's ``router``).
        names = self.__dict__.get("child_names")
        if names is not None and name in names:
            name = names[name]
        return super().__getattr__(name)

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` in, same shape out; padded positions (``token_batch``) come out zero.

        On one process the layer is traceable (``torch.compile(model, fullgraph=True)``,
        ``torch.export``); under expert parallelism (host reads, Triton kernels behind custom autograd
        functions) it runs eagerly: a compiled decoder layer breaks its graph here (``parallel.compile``).
        """
        if self.dispatcher.group is None and self.shuffle is None and not self.execution.cuda_graphs:
            return self._forward(hidden_BSH)  # traceable: one process, no CUDA graphs
        return _eager_forward(self, hidden_BSH)

    def _forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        shape = hidden_BSH.shape
        draw_id = self._draw_id()
        group = self.shuffle.group if self.shuffle is not None else None
        if group is None and self.dispatcher.needs_group_tokens:
            group = self.dispatcher.group
        tokens = select_tokens(self._token_batch_of(draw_id), shape, self.config, group, hidden_BSH.device)
        x_TH = hidden_BSH.reshape(-1, shape[-1])
        if tokens.real_N is not None:
            x_TH = x_TH.index_select(0, tokens.real_N)  # [N, H]: padded positions are left out
        elif tokens.valid_T is not None:
            x_TH = torch.where(tokens.valid_T[:, None], x_TH, 0)  # same shapes: padded rows zero
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * jitter_factors(x_TH, self.jitter_noise, self._generator(draw_id, x_TH.device, shared=False))
        positions_T, shuffle_state, z_weight_T = tokens.positions_T, None, None
        if self.shuffle is not None:
            # The permutation is drawn on the CPU, so its split sizes need no device sync.
            generator = self._generator(draw_id, torch.device("cpu"), shared=True)
            x_TH, shuffle_state, positions_T = self.shuffle.shuffle(x_TH, generator, tokens.group_tokens, positions_T)
            z_weight_T = origin_weights(shuffle_state.source_T, tokens.group_tokens, x_TH.device)

        tokens = tokens._replace(positions_T=positions_T)
        run = self._route_and_run if self.graphed is None else self.graphed
        out_TH, shared_TH, stats, tokens_per_expert_E, kept_E = run(
            x_TH, tokens, z_weight_T, draw_id, shuffle_state, shape
        )
        if shared_TH is not None:
            out_TH = out_TH + shared_TH

        if self.check_finite:
            # A device-side flag, read by the caller once per step (no host sync here).
            assert stats.logits_finite is not None
            self.nonfinite = ~(stats.logits_finite & self._all_finite(out_TH))
        out_TH = self._account(out_TH, stats, tokens_per_expert_E, kept_E)
        return self._to_positions(out_TH, tokens, shuffle_state, shape).to(hidden_BSH.dtype).reshape(shape)

    def _route_and_run(
        self,
        x_TH: torch.Tensor,
        tokens: LayerTokens,
        z_weight_T: torch.Tensor | None,
        draw_id: int,
        shuffle_state: ShufflePlan | None,
        shape: torch.Size,
    ) -> tuple[torch.Tensor, torch.Tensor | None, RouterStats, torch.Tensor, torch.Tensor]:
        """The routed output, the shared experts' (or ``None``), the routing's statistics, the tokens
        per expert and the pairs each expert kept. ``graphs.GraphedLayer`` runs in its place under CUDA graphs."""
        expert_ids_TK, weights_TK, stats = self._route_tokens(x_TH, tokens, z_weight_T, shuffle_state, shape)
        out_TH, shared_TH, counts_E, kept_E = self._dispatch_and_combine(
            x_TH, expert_ids_TK, weights_TK, draw_id, tokens
        )
        return out_TH, shared_TH, stats, counts_E, kept_E

    def _route_tokens(
        self,
        x_TH: torch.Tensor,
        tokens: LayerTokens,
        z_weight_T: torch.Tensor | None,
        shuffle_state: ShufflePlan | None,
        shape: torch.Size,
    ) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """The experts chosen, their weights and the routing's statistics (the logits to ``router_logits``)."""
        expert_ids_TK, weights_TK, stats = self._route(self.gate, x_TH, self.check_finite, tokens.valid_T, z_weight_T)
        if self.router_logits.active():
            self.router_logits(self._to_positions(stats.logits_TE, tokens, shuffle_state, shape))
        return expert_ids_TK, weights_TK, stats

    def _draw_id(self) -> int:
        """The id of this training forward's random draws (``rng.DrawCounter``), ``-1`` in eval. A
        traced forward (``torch.compile``) keeps no count: a Python counter would be a constant of the
        graph, recompiled at every step. It then needs no draw at all (one process: no token shuffle;
        compiled code recomputes without re-running this one), unless the router jitters.
        """
        if not self.training:
            return -1
        if torch.compiler.is_compiling():
            if self.jitter_noise > 0:
                raise RuntimeError(
                    f"MoELayer {self.layer_index}: router jitter (router_jitter_noise={self.jitter_noise}) draws from "
                    "lightning_ep's seeded per-step streams, which torch.compile cannot trace; train the model eagerly "
                    "(ExpertParallelStrategy(execution=Execution(compile=False))), or set router_jitter_noise=0."
                )
            return -1
        return self._draws.next_id()

    def _to_positions(
        self, x_TX: torch.Tensor, tokens: LayerTokens, shuffle_state: ShufflePlan | None, shape: torch.Size
    ) -> torch.Tensor:
        """Rows per token back on this rank's own tokens, one per input position (zeros at padded ones)."""
        if self.shuffle is not None and shuffle_state is not None:
            x_TX = self.shuffle.unshuffle(x_TX, shuffle_state)
        if tokens.real_N is not None:
            x_TX = x_TX.new_zeros((math.prod(shape[:-1]), x_TX.shape[1])).index_copy(0, tokens.real_N, x_TX)
        return x_TX

    def _token_batch_of(self, draw_id: int) -> TokenBatch | None:
        """The ``TokenBatch`` of this call: the model's current one, or in a recomputation the forward's."""
        if draw_id < 0:
            return self.token_batch
        if in_backward():
            return self._token_batches.recall(draw_id, self.token_batch)
        return self._token_batches.record(draw_id, self.token_batch)

    def _dispatch_and_combine(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        draw_id: int,
        tokens: LayerTokens,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``_route_and_run``'s outputs but for the routing statistics, eagerly."""
        if self.hf_experts is not None and self.hf_experts.active():  # transformers' own implementation
            self.hf_experts.check_runs_in(self)
            out_TH = self.hf_experts(self.experts, x_TH, expert_ids_TK, weights_TK)
            counts_E = count_ids(expert_ids_TK, self.num_experts, tokens.valid_T)
            return out_TH, self._shared(x_TH), counts_E, counts_E
        keep: KeptExchange | None = None
        if self.keep_all_to_all and draw_id >= 0 and torch.is_grad_enabled():  # training forwards only
            from lightning_ep.moe.dispatch.kept import exchange_to_keep

            keep = exchange_to_keep(self._kept, self.dispatcher, draw_id, in_backward())
        dispatched = self.dispatcher.dispatch(x_TH, expert_ids_TK, weights_TK, tokens, keep)
        if dispatched.tokens_dropped is not None:
            self.tokens_dropped = dispatched.tokens_dropped
        if self.overlap_shared:
            shared_TH = self._shared(x_TH)  # while the routed rows travel (all-to-all dispatch)
            x_MH = dispatched.x_MH
        else:
            x_MH = dispatched.x_MH
            shared_TH = self._shared(x_TH)
        y_MH = self.experts(x_MH, dispatched.counts_L, dispatched.counts_host)
        out_TH = self.dispatcher.combine(y_MH, weights_TK, dispatched)
        tokens_per_expert_E, kept_E = dispatched.tokens_per_expert_E, dispatched.kept_per_expert_E
        if tokens.valid_T is not None and kept_E is None:
            tokens_per_expert_E = count_ids(expert_ids_TK, self.num_experts, tokens.valid_T)  # real tokens only
        return out_TH, shared_TH, tokens_per_expert_E, kept_E if kept_E is not None else tokens_per_expert_E

    def _account(
        self, out_TH: torch.Tensor, stats: RouterStats, tokens_per_expert_E: torch.Tensor, kept_E: torch.Tensor
    ) -> torch.Tensor:
        """Keep the router losses and the counts, attach the weighted losses. ``kept_E``: the pairs each
        expert kept (below ``tokens_per_expert_E`` under a capacity), what ``"balanced"`` counts."""
        aux, zl, weights = stats.aux_loss, stats.z_loss, self.config.loss_weights(self.loss_scale)
        if torch.compiler.is_exporting():  # an exported program keeps no module state
            return attach_losses(out_TH, [aux, zl], weights) if self.training else out_TH
        self.aux_loss = aux.detach()
        self.z_loss = zl.detach()
        self.tokens_per_expert = tokens_per_expert_E.detach()
        self.router_entropy = stats.entropy
        self.selection_gap = stats.selection_gap.detach()
        if not self.training or self.gate.frozen:
            return out_TH
        if not in_backward():
            self.gate.record_load(kept_E)
        return attach_losses(out_TH, [aux, zl], weights)

    def _shared(self, x_TH: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output ``[T, H]`` (gated if there is a gate), or ``None``."""
        shared = self._modules.get(self.child_names["shared_experts"])
        if shared is None:
            return None
        y_TH = shared(x_TH)
        gate = self._modules.get(self.child_names["shared_experts_gate"])
        if gate is not None:
            y_TH = torch.sigmoid(gate(x_TH)) * y_TH
        return y_TH

    def _generator(self, draw_id: int, device: torch.device, *, shared: bool) -> torch.Generator:
        return layer_generator(self.config.random_seed, self.ep_rank, self.layer_index, draw_id, device, shared=shared)

    def extra_repr(self) -> str:
        return f"layer_index={self.layer_index}, dispatcher={type(self.dispatcher).__name__}"


# ``forward`` when the layer must run eagerly inside a compiled model (see ``MoELayer.forward``).
_eager_forward = torch.compiler.disable(MoELayer._forward)
