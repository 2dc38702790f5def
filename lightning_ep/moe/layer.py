"""``MoELayer``: route -> dispatch -> experts -> combine, the drop-in for a Hugging Face MoE block.

Legend: B batch, S sequence, T = B * S tokens on this rank, H hidden size, E experts, K experts
per token, M rows received by the local experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch import Dispatcher, LocalDispatcher, count_ids
from lightning_ep.moe.dispatchers import make_dispatcher
from lightning_ep.moe.experts import RoutedExperts
from lightning_ep.moe.losses import attach_losses, load_balancing_loss, z_loss
from lightning_ep.moe.rng import DrawCounter, in_backward, make_generator
from lightning_ep.moe.router import TopKRouter
from lightning_ep.moe.tokens import TokenBatch, gather_counts, positions_in_sequence

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch_ep import KeptExchange, TokenShuffle
    from lightning_ep.moe.graphs import LayerGraphs

_JITTER_STREAM = 0
_SHUFFLE_STREAM = 1
_MAX_KEPT = 4  # KeptExchange entries per layer awaiting their recomputation
_MAX_TOKEN_BATCHES = 64  # token batches of training forwards awaiting their recomputation, as DrawCounter
# The layer's roles for its children; ``MoELayer(child_names=...)`` maps them to Hugging Face names.
_ROLES = {"gate": "gate", "shared_experts": "shared_experts", "shared_experts_gate": "shared_experts_gate"}


class RouterStats(NamedTuple):
    """What the layer keeps of one routing: the load-balancing and z-losses (0-dim, with grad), the
    router entropy (0-dim, detached), when checked whether every router logit is finite, and the router
    logits ``[T, E]`` themselves (with grad; see ``MoELayer.router_logits``)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor
    logits_finite: torch.Tensor | None
    logits_TE: torch.Tensor


class RouterLogits(nn.Module):
    """The identity on a layer's ``[T, E]`` router logits (one row per position of the layer's input,
    zeros at padded positions, the shuffle undone). The layer holds it outside its children (no state,
    and the children stay the Hugging Face block's) and calls it only while it has forward hooks:
    Hugging Face's ``output_router_logits`` records router logits with one (``models.hf_compat``)."""

    def __init__(self) -> None:
        super().__init__()
        #: Whether the hooks want this call's logits (``None``: always); set with the hooks.
        self.wanted: Any = None

    def forward(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE

    def active(self) -> bool:
        """Whether a call would be recorded: hooks are installed and they want it."""
        return bool(self._forward_hooks) and (self.wanted is None or self.wanted())


class LayerTokens(NamedTuple):
    """Which tokens one call of a layer routes, and what its dispatch needs to know of them.

    Attributes:
        real_N: int64 positions of the real tokens in the flattened input, when padding is left out
            of the call (eager: the rows are selected, the output scattered back); ``None``: all.
        valid_T: bool, ``False`` at padded tokens, when the call keeps its shapes instead (traced by
            ``torch.compile``); ``None`` otherwise.
        positions_T: each routed token's position in its sequence (the ``"position"`` drop policy).
        group_tokens: every expert-parallel rank's token count, when the dispatch or the token shuffle
            needs it (ranks may hold different numbers of tokens).
    """

    real_N: torch.Tensor | None
    valid_T: torch.Tensor | None
    positions_T: torch.Tensor | None
    group_tokens: list[int] | None


def route(
    gate: TopKRouter,
    x_TH: torch.Tensor,
    check_finite: bool,
    valid_T: torch.Tensor | None = None,
    z_weight_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
    """Route ``x_TH`` and compute the statistics kept of it, in one pure function (so that
    ``MoELayer.compile_routing`` compiles it whole).

    ``valid_T`` (bool, ``False`` at padded tokens, whose rows are zero): padded tokens take no part
    in the losses, the entropy and Sinkhorn, get combine weight 0, and are spread over the experts
    (token ``t``'s ``k``-th choice is expert ``(t * K + k) % E``, whatever its content), so that
    their content changes nothing and they load no expert more than another. ``z_weight_T``: each
    token's weight in the z-loss (see ``losses.z_loss``).

    Returns:
        ``expert_ids_TK`` (int64), ``weights_TK`` (router dtype) and the ``RouterStats``.
    """
    routing = gate(x_TH, valid_T)
    probs_TE, expert_ids_TK, weights_TK = routing.probs_TE, routing.expert_ids_TK, routing.weights_TK
    if valid_T is not None:
        num_tokens, top_k = expert_ids_TK.shape
        spread_TK = torch.arange(num_tokens * top_k, device=x_TH.device).view(num_tokens, top_k) % gate.num_experts
        expert_ids_TK = torch.where(valid_T[:, None], expert_ids_TK, spread_TK)
        weights_TK = torch.where(valid_T[:, None], weights_TK, 0.0)
    aux = load_balancing_loss(probs_TE, expert_ids_TK, valid_T)
    zl = z_loss(routing.logits_TE, valid_T, z_weight_T)
    entropy = mean_entropy(probs_TE.detach(), valid_T)
    finite = torch.isfinite(routing.logits_TE.detach()).all() if check_finite else None
    return expert_ids_TK, weights_TK, RouterStats(aux, zl, entropy, finite, routing.logits_TE)


def mean_entropy(probs_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim mean over (real, ``valid_T``) tokens of the entropy (nats) of each row of ``probs_TE``."""
    # entr(p) = -p log p with entr(0) = 0, and no NaN for a rank without tokens.
    entropy_T = torch.special.entr(probs_TE).sum(dim=-1)
    if valid_T is None:
        return entropy_T.sum() / max(probs_TE.shape[0], 1)
    return torch.where(valid_T, entropy_T, 0.0).sum() / valid_T.sum().clamp_min(1)


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool: no NaN or infinity in ``x``."""
    return torch.isfinite(x.detach()).all()


class MoELayer(nn.Module):
    """A sparse MoE block: a top-k router (``gate``), routed experts (``experts``), optional shared
    experts, and the dispatcher that moves tokens between them.

    The children carry the Hugging Face block's names (``child_names`` maps this layer's roles
    ``"gate"``, ``"shared_experts"`` and ``"shared_experts_gate"`` to them, e.g. GPT-OSS's router is
    ``router``, Qwen2-MoE's shared expert ``shared_expert``; ``layer.gate`` always reaches the
    router), and their parameters are the block's own ``Parameter`` objects, so state-dict keys,
    shapes and values are unchanged.

    Shared experts are ordinary dense modules applied to every token and added to the routed
    output, scaled by ``sigmoid(shared_experts_gate(x))`` when there is a gate (Qwen2-MoE); they are
    replicated under expert parallelism and FSDP2-sharded with the decoder layer, like dense
    weights. With ``overlap_shared`` (the default) they run between the launch of the all-to-all
    dispatch and the first use of its rows, so the exchange overlaps them in forward, and the
    reverse exchange overlaps their backward; ``False`` runs them after the rows arrived. Both
    compute the same numbers.

    ``keep_all_to_all`` (all-to-all dispatcher only; ``ExpertParallelStrategy(activation_checkpointing=
    "keep_all_to_all")`` sets it): each training forward keeps its dispatch plan and the rows both
    exchanges received (``KeptExchange``), and the activation-checkpointing recomputation of that
    forward reuses them instead of exchanging counts, reading split sizes back and exchanging rows
    again. Same numbers; ``M x H + N x H`` more elements held per layer until its recomputation.

    After each forward the layer holds, for logging and balancing:

    - ``aux_loss``: the load-balancing loss of this rank's tokens (0-dim, detached, unweighted);
    - ``z_loss``: the router z-loss (0-dim, detached, unweighted);
    - ``tokens_per_expert``: int64 ``[E]``, tokens this rank routed to each global expert;
    - ``router_entropy``: mean over this rank's tokens of the entropy (nats) of the router's
      softmax probabilities (0-dim, detached); ``log(E)`` for a uniform router, 0 for a one-hot one.

    The weighted losses reach the gradients by themselves (see ``losses.attach_losses``); their
    gradient is multiplied by ``loss_scale`` (set it to ``1 / accumulate_grad_batches`` under
    gradient accumulation, or to the loss scale of a ``GradScaler``).

    Args:
        gate: the router.
        experts: the routed experts (local shard under expert parallelism).
        config: balancing, seeds and coefficients.
        jitter_noise: multiplicative input jitter in training (Mixtral's ``router_jitter_noise``):
            ``x *= U(1 - j, 1 + j)``, applied to what the router and the experts see.
        layer_index: position among the model's MoE layers; separates the layers' random streams.
        shared_experts: the dense shared expert(s), ``[..., H] -> [..., H]``, or ``None``.
        shared_experts_gate: ``[..., H] -> [..., 1]`` logits of the shared experts' sigmoid gate, or ``None``.
        child_names: Hugging Face names of the children, by role (defaults: the role names).
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
        self._kept: dict[int, KeptExchange] = {}
        self.dispatcher: Dispatcher = make_dispatcher(config, gate.num_experts)
        # A TokenShuffle when global_token_shuffle is on under expert parallelism.
        self.shuffle: TokenShuffle | None = None
        self.ep_rank = 0
        self._draws = DrawCounter()
        self.aux_loss = torch.zeros(())
        self.z_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(gate.num_experts, dtype=torch.int64)
        # (token, expert) pairs dropped by the capacity limit in the latest forward (0: dropless).
        self.tokens_dropped = torch.zeros((), dtype=torch.int64)
        # With check_finite, ``nonfinite`` is a 0-dim bool set when the router logits or the
        # layer output of the latest forward held a NaN or an infinity.
        self.check_finite = False
        self.nonfinite = torch.zeros((), dtype=torch.bool)
        self.router_entropy = torch.zeros(())
        # Eager by default; ``compile_routing`` swaps in compiled versions of the same functions.
        self._route = route
        self._all_finite = all_finite
        self._layer_graphs: LayerGraphs | None = None
        # Not a registered child: the layer's children stay the Hugging Face block's.
        self.router_logits: RouterLogits
        object.__setattr__(self, "router_logits", RouterLogits())
        # From ``models.hf_compat``: transformers' experts implementation of the replaced block, run
        # as ``hf_experts(experts, x, ids, weights)`` while ``hf_experts.active()`` (the model's
        # ``config._experts_implementation`` names it); ``None``: always this library's experts.
        self.hf_experts: Any = None
        # The padding of the current model call, set by the model's forward pre-hook
        # (``lightning_ep.models.padding``); ``None``: every token is real.
        self.token_batch: TokenBatch | None = None
        self._token_batches: dict[int, TokenBatch | None] = {}

    def compile_routing(self, **compile_kwargs: Any) -> None:
        """Run the router with its losses and statistics (``route``) and the output's finiteness
        check through ``torch.compile``: a few fused kernels instead of some thirty small ones per
        layer, in forward and in backward; with the symmetric-memory dispatcher its plan too
        (``compile_plan``). The rest of the layer stays eager."""
        self._route = torch.compile(route, **compile_kwargs)
        self._all_finite = torch.compile(all_finite, **compile_kwargs)
        compile_plan = getattr(self.dispatcher, "compile_plan", None)
        if compile_plan is not None:  # the symmetric-memory dispatcher's index arithmetic
            compile_plan(**compile_kwargs)

    def release_graphs(self) -> None:
        """Drop this layer's CUDA graphs (``config.cuda_graphs``), e.g. before destroying the process
        group their NCCL exchange runs on; the next training calls warm up and capture anew."""
        if self._layer_graphs is not None:
            self._layer_graphs.release()
            self._layer_graphs = None

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
        ``torch.export``); under expert parallelism it runs eagerly inside a compiled model: the
        dispatch reads split sizes back to the host and the fast paths are Triton kernels behind
        custom autograd functions, so a compiled decoder layer breaks its graph here (see
        ``lightning_ep.parallel.compile``).
        """
        if self._traceable():
            return self._forward(hidden_BSH)
        return _eager_forward(self, hidden_BSH)

    def _traceable(self) -> bool:
        """Whether ``torch.compile`` may trace ``forward``: one process, no CUDA graphs."""
        one_process = isinstance(self.dispatcher, LocalDispatcher) or getattr(self.dispatcher, "group", 0) is None
        return one_process and self.shuffle is None and not self.config.cuda_graphs

    def _forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        shape = hidden_BSH.shape
        draw_id = self._draw_id()
        tokens = self._select_tokens(shape, draw_id, hidden_BSH.device)
        x_TH = hidden_BSH.reshape(-1, shape[-1])
        if tokens.real_N is not None:
            x_TH = x_TH.index_select(0, tokens.real_N)  # [N, H]: padded positions are left out
        elif tokens.valid_T is not None:
            x_TH = torch.where(tokens.valid_T[:, None], x_TH, 0)  # same shapes: padded rows zero
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * self._jitter(x_TH, draw_id)
        positions_T, shuffle_state, z_weight_T = tokens.positions_T, None, None
        if self.shuffle is not None:
            # The permutation is drawn on the CPU, so its split sizes need no device sync.
            generator = self._generator(draw_id, torch.device("cpu"), shared=True)
            x_TH, shuffle_state, positions_T = self.shuffle.shuffle(x_TH, generator, tokens.group_tokens, positions_T)
            z_weight_T = _origin_weights(shuffle_state["source_T"], tokens.group_tokens, x_TH.device)

        expert_ids_TK, weights_TK, stats = self._route(self.gate, x_TH, self.check_finite, tokens.valid_T, z_weight_T)
        if self.router_logits.active():
            self._emit_router_logits(stats.logits_TE, tokens, shuffle_state, shape)
        graphs = self._graphs()
        if graphs is not None and tokens.valid_T is None and graphs.applies(x_TH, expert_ids_TK, weights_TK):
            out_TH, tokens_per_expert_E = graphs(x_TH, expert_ids_TK, weights_TK)
            shared_TH, kept_E = self._shared(x_TH), tokens_per_expert_E
        else:
            out_TH, shared_TH, tokens_per_expert_E, kept_E = self._dispatch_and_combine(
                x_TH, expert_ids_TK, weights_TK, draw_id, tokens._replace(positions_T=positions_T)
            )
        if shared_TH is not None:
            out_TH = out_TH + shared_TH

        if self.check_finite:
            # A device-side flag, read by the caller once per step (no host sync here).
            assert stats.logits_finite is not None
            self.nonfinite = ~(stats.logits_finite & self._all_finite(out_TH))
        out_TH = self._account(out_TH, stats, tokens_per_expert_E, kept_E)
        if self.shuffle is not None and shuffle_state is not None:
            out_TH = self.shuffle.unshuffle(out_TH, shuffle_state)
        if tokens.real_N is not None:  # back to [T, H], zeros at padded positions
            out_TH = out_TH.new_zeros((hidden_BSH.numel() // shape[-1], shape[-1])).index_copy(0, tokens.real_N, out_TH)
        return out_TH.to(hidden_BSH.dtype).reshape(shape)

    def _draw_id(self) -> int:
        """The id of this training forward's random draws (``rng.DrawCounter``), ``-1`` in eval.

        A traced forward (``torch.compile``) keeps no count: a Python counter would be a constant
        of the graph, recompiled at every step. It then needs no draw at all (one process: no token
        shuffle; compiled code recomputes without re-running this one), unless the router jitters.
        """
        if not self.training:
            return -1
        if torch.compiler.is_compiling():
            if self.jitter_noise > 0:
                raise RuntimeError(
                    f"MoELayer {self.layer_index}: router jitter (router_jitter_noise={self.jitter_noise}) draws from "
                    "lightning_ep's seeded per-step streams, which torch.compile cannot trace; train this model "
                    "eagerly or with ExpertParallelStrategy(compile_layers=True), or set router_jitter_noise=0."
                )
            return -1
        return self._draws.next_id()

    def _emit_router_logits(
        self, logits_TE: torch.Tensor, tokens: LayerTokens, shuffle_state: dict | None, shape: torch.Size
    ) -> None:
        """Pass the router logits, one row per position of the input, through ``router_logits``."""
        if self.shuffle is not None and shuffle_state is not None:
            logits_TE = self.shuffle.unshuffle(logits_TE, shuffle_state)
        if tokens.real_N is not None:
            rows = math.prod(shape[:-1])
            logits_TE = logits_TE.new_zeros((rows, logits_TE.shape[1])).index_copy(0, tokens.real_N, logits_TE)
        self.router_logits(logits_TE)

    def _select_tokens(self, shape: torch.Size, draw_id: int, device: torch.device) -> LayerTokens:
        """Which tokens of an input of ``shape`` this call routes, and what the dispatch needs to know
        of them (see ``LayerTokens``)."""
        batch = self._token_batch_of(draw_id)
        real_N = valid_T = None
        if batch is not None:
            if torch.compiler.is_compiling():
                valid_T = batch.valid(shape)  # no data-dependent shapes in a traced graph
            else:
                real_N = batch.real_tokens(shape)
        positions_T = None
        if self.config.capacity_factor is not None and self.config.drop_policy == "position":
            positions_T = positions_in_sequence(shape, device)
            if real_N is not None:
                positions_T = positions_T.index_select(0, real_N)
        group_tokens = None
        group = self.shuffle.group if self.shuffle is not None else None
        if group is None and getattr(self.dispatcher, "needs_group_tokens", False):
            group = self.dispatcher.group  # type: ignore[attr-defined]
        if group is not None:
            count = real_N.numel() if real_N is not None else math.prod(shape[:-1])
            group_tokens = (
                batch.group_counts(count, group, device) if batch is not None else gather_counts(count, group, device)
            )
        return LayerTokens(real_N, valid_T, positions_T, group_tokens)

    def _token_batch_of(self, draw_id: int) -> TokenBatch | None:
        """The ``TokenBatch`` of this call: the model's current one, or, for an activation-checkpointing
        recomputation inside backward, the one its forward saw."""
        if draw_id < 0:
            return self.token_batch
        if in_backward():
            return self._token_batches.pop(draw_id, self.token_batch)
        self._token_batches[draw_id] = self.token_batch
        while len(self._token_batches) > _MAX_TOKEN_BATCHES:  # forwards that were never recomputed
            del self._token_batches[next(iter(self._token_batches))]
        return self.token_batch

    def _dispatch_and_combine(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        draw_id: int,
        tokens: LayerTokens,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The routed experts' output ``[T, H]``, the shared experts' (or ``None``), the tokens per
        expert and the (token, expert) pairs each expert kept, eagerly."""
        if self.hf_experts is not None and self.hf_experts.active():  # transformers' own implementation
            self._check_hf_experts()
            out_TH = self.hf_experts(self.experts, x_TH, expert_ids_TK, weights_TK)
            counts_E = count_ids(expert_ids_TK, self.num_experts, tokens.valid_T)
            return out_TH, self._shared(x_TH), counts_E, counts_E
        keep = self._exchange_to_keep(draw_id)
        dispatcher: Any = self.dispatcher
        if getattr(dispatcher, "takes_weights", False):  # capacity: "probs" ranks rows by weight
            dispatched = dispatcher.dispatch(
                x_TH,
                expert_ids_TK,
                weights_TK,
                positions_T=tokens.positions_T,
                valid_T=tokens.valid_T,
                group_tokens=tokens.group_tokens,
            )
        elif getattr(dispatcher, "needs_group_tokens", False):
            dispatched = dispatcher.dispatch(x_TH, expert_ids_TK, group_tokens=tokens.group_tokens)
        elif keep is not None:
            dispatched = dispatcher.dispatch(x_TH, expert_ids_TK, keep=keep)
        else:
            dispatched = dispatcher.dispatch(x_TH, expert_ids_TK)
        if "tokens_dropped" in dispatched.state:
            self.tokens_dropped = dispatched.state["tokens_dropped"]
        if self.overlap_shared:
            shared_TH = self._shared(x_TH)  # while the routed rows travel (all-to-all dispatch)
            x_MH = dispatched.x_MH
        else:
            x_MH = dispatched.x_MH
            shared_TH = self._shared(x_TH)
        y_MH = self.experts(x_MH, dispatched.counts_L, dispatched.counts_host)
        out_TH = self.dispatcher.combine(y_MH, weights_TK, dispatched)
        tokens_per_expert_E = dispatched.tokens_per_expert_E
        if tokens.valid_T is not None and "kept_per_expert_E" not in dispatched.state:
            tokens_per_expert_E = count_ids(expert_ids_TK, self.num_experts, tokens.valid_T)  # real tokens only
        return out_TH, shared_TH, tokens_per_expert_E, dispatched.state.get("kept_per_expert_E", tokens_per_expert_E)

    def _check_hf_experts(self) -> None:
        """transformers' experts implementations are dropless and hold every expert: refuse them here
        when the layer splits its experts across ranks or bounds them by a capacity, and on experts
        with LoRA adapters, which they would leave out."""
        if getattr(self.experts, "lora_scaling", None):
            raise ValueError(
                f"MoE layer {self.layer_index}: the model's config._experts_implementation is "
                f"{self.hf_experts.implementation!r}, one of transformers' implementations, which would compute the "
                "experts without their LoRA adapters. Call model.set_experts_implementation('lightning_ep') to use "
                "lightning_ep's experts."
            )
        if isinstance(self.dispatcher, LocalDispatcher):
            return
        raise ValueError(
            f"MoE layer {self.layer_index}: the model's config._experts_implementation is "
            f"{self.hf_experts.implementation!r}, one of transformers' implementations, which compute every expert "
            f"on one process without a capacity; this layer's dispatch is {type(self.dispatcher).__name__}. Call "
            "model.set_experts_implementation('lightning_ep') to use lightning_ep's experts."
        )

    def _graphs(self) -> LayerGraphs | None:
        """With ``config.cuda_graphs``, the CUDA graphs of this layer's dispatcher (made on first use;
        ``None`` for a dispatcher without a static plan: one process)."""
        if not self.config.cuda_graphs or not hasattr(self.dispatcher, "dispatch_static"):
            return None
        if self._layer_graphs is None or self._layer_graphs.dispatcher is not self.dispatcher:
            from lightning_ep.moe.graphs import LayerGraphs

            self._layer_graphs = LayerGraphs(self.dispatcher, self.experts)
        return self._layer_graphs

    def _account(
        self, out_TH: torch.Tensor, stats: RouterStats, tokens_per_expert_E: torch.Tensor, kept_E: torch.Tensor
    ) -> torch.Tensor:
        """Keep the router losses and the counts, attach the weighted losses. ``kept_E``: the pairs each
        expert kept (below ``tokens_per_expert_E`` under a capacity), what ``"balanced"`` counts."""
        aux, zl = stats.aux_loss, stats.z_loss
        if torch.compiler.is_exporting():  # an exported program keeps no module state
            return attach_losses(out_TH, [aux, zl], self._loss_weights()) if self.training else out_TH
        self.aux_loss = aux.detach()
        self.z_loss = zl.detach()
        self.tokens_per_expert = tokens_per_expert_E.detach()
        self.router_entropy = stats.entropy
        if self.training and not in_backward():
            self.gate.record_load(kept_E)
        if not self.training:
            return out_TH
        return attach_losses(out_TH, [aux, zl], self._loss_weights())

    def _loss_weights(self) -> list[float]:
        """The weights of ``[aux_loss, z_loss]`` in the gradients (0 for a loss that is off)."""
        aux_weight = self.config.moe_aux_loss_coeff * self.loss_scale if self.config.aux_loss_active else 0.0
        z_weight = self.config.moe_z_loss_coeff * self.loss_scale if self.config.z_loss_active else 0.0
        return [aux_weight, z_weight]

    def _exchange_to_keep(self, draw_id: int) -> KeptExchange | None:
        """With ``keep_all_to_all``: a new ``KeptExchange`` for a training forward, the one it
        recorded for that forward's activation-checkpointing recomputation (inside backward)."""
        if not (self.keep_all_to_all and draw_id >= 0 and torch.is_grad_enabled()):
            return None
        if isinstance(self.dispatcher, LocalDispatcher):
            return None  # one process: nothing is exchanged
        if not getattr(self.dispatcher, "keeps_exchanges", False):
            raise ValueError(
                f"MoELayer.keep_all_to_all needs the all-to-all dispatcher, got {type(self.dispatcher).__name__}; "
                "set MoEConfig(moe_all_to_all_dispatcher=True, capacity_factor=None, symmetric_memory_dispatch=False) "
                "or keep_all_to_all=False."
            )
        if in_backward():
            return self._kept.pop(draw_id, None)
        from lightning_ep.moe.dispatch_ep import KeptExchange

        keep = self._kept[draw_id] = KeptExchange()
        while len(self._kept) > _MAX_KEPT:  # forwards that were never recomputed
            del self._kept[next(iter(self._kept))]
        return keep

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
        seed = self.config.random_seed + (0 if shared else self.ep_rank)
        stream = _SHUFFLE_STREAM if shared else _JITTER_STREAM
        return make_generator(seed, (draw_id * 1024 + self.layer_index) * 4 + stream, device)

    def _jitter(self, x_TH: torch.Tensor, draw_id: int) -> torch.Tensor:
        noise = torch.empty(x_TH.shape, dtype=torch.float32, device=x_TH.device)
        noise.uniform_(
            1.0 - self.jitter_noise,
            1.0 + self.jitter_noise,
            generator=self._generator(draw_id, x_TH.device, shared=False),
        )
        return noise.to(x_TH.dtype)

    def extra_repr(self) -> str:
        return f"layer_index={self.layer_index}, dispatcher={type(self.dispatcher).__name__}"


def _origin_weights(
    source_T: torch.Tensor, group_tokens: list[int] | None, device: torch.device
) -> torch.Tensor | None:
    """After the token shuffle, each token's weight ``T / T_source`` in this rank's mean over its
    ``T`` tokens, so that a per-token loss weighs every token as data parallelism does (by ``1 / T_s``
    on its own rank ``s``); ``None`` when every rank holds as many tokens (all weights 1)."""
    if group_tokens is None or len(set(group_tokens)) == 1:
        return None
    counts = torch.tensor(group_tokens, dtype=torch.float64)
    return (source_T.numel() / counts[source_T]).to(device=device)


# ``forward`` when the layer must run eagerly inside a compiled model (see ``MoELayer.forward``).
_eager_forward = torch.compiler.disable(MoELayer._forward)
