"""``MoEConfig``: the SageMaker model-parallel v2 MoE configuration, plus a few options beyond it.

The parallel layout is not here but an argument of the strategy and of ``init_mesh``. Pure Python,
validated eagerly: a bad value fails when the config is built, before any process group or model exists.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

LoadBalancing = Literal["sinkhorn", "aux_loss", "balanced", "none"]
RouterDtype = Literal["float32", "float64"]
DropPolicy = Literal["probs", "position"]
_FLAGS = ("smp_moe", "global_token_shuffle", "moe_all_to_all_dispatcher")
#: Fields that ``lightning_ep.Execution`` holds now (an older checkpoint's record may still name them).
MOVED_TO_EXECUTION: tuple[str, ...] = ("token_dedup", "symmetric_memory_dispatch", "cuda_graphs")
_EXECUTION_SPELLING = {
    "token_dedup": "token_dedup=True",
    "symmetric_memory_dispatch": "exchange='symmetric_memory', row_budget=N",
    "cuda_graphs": "cuda_graphs=True",
}
# Fields that choose how the same math is carried out (which exchange, which guard on memory), not what
# is computed: they may differ between two configs that must agree (a checkpoint's and the run resuming
# it). Any other field, including one added later and not listed here, changes the math.
EXECUTION_FIELDS: tuple[str, ...] = ("moe_all_to_all_dispatcher", "max_tokens_per_rank", *MOVED_TO_EXECUTION)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """How the MoE layers route, balance and exchange tokens.

    The first seven fields mirror ``smp.nn.moe.MoEConfig`` of SageMaker model parallelism v2, with its
    defaults; the rest are this library's. How a step runs is ``lightning_ep.Execution``'s.

    Args:
        smp_moe: replace the model's MoE blocks with ``MoELayer``; ``False`` leaves the model untouched.
        random_seed: seed of every random choice inside MoE layers (never the global torch RNG): the token
            shuffle's is shared by an expert-parallel group, a rank's own (router jitter) adds ``ep_rank``.
        moe_load_balancing: ``"sinkhorn"``, ``"aux_loss"`` (the Switch/GShard load-balancing loss),
            ``"balanced"`` (DeepSeek-V3's auxiliary-loss-free bias) or ``"none"`` (``routing.router``).
        global_token_shuffle: permute tokens across the ranks of an expert-parallel group before routing
            (drawn from ``random_seed``) and restore the order after; the z-loss weighs each token as on
            its own rank, whose token count may differ (one small all-gather per model call).
        moe_all_to_all_dispatcher: ``True`` exchanges tokens with all-to-all; ``False`` gathers
            every token of the group on every rank and reduce-scatters the outputs.
        moe_aux_loss_coeff: weight of the load-balancing loss (used with ``"aux_loss"``), SMP v2's and
            Megatron-Core's ``E * sum_i f_i * P_i`` per layer (``routing.losses.load_balancing_loss``).
        moe_z_loss_coeff: weight of the router z-loss ``mean(logsumexp(logits)^2)``, in every
            balancing mode; 0 disables it.
        router_dtype: dtype of the router's logits, softmax and Sinkhorn (never lower than fp32).
        sinkhorn_iterations: fixed number of Sinkhorn iterations (fixed, so no host sync).
        balance_update_rate: step size of the ``"balanced"`` bias update.
        capacity_factor: ``None`` is dropless. Otherwise each expert takes at most
            ``ceil((T * top_k / num_experts) * capacity_factor)`` rows from each rank (``T`` its real
            tokens; Megatron-Core's ``get_capacity``); the rest are dropped (they pass through the
            residual path), counted in ``MoELayer.tokens_dropped``, and no split size is read back.
            Needs the all-to-all dispatcher (one small all-gather per model call of the ranks' tokens).
        drop_policy: which rows an over-capacity expert keeps: ``"probs"`` the highest routing weights,
            ``"position"`` the tokens earliest in their sequence (ties: the earlier sequence), as
            Megatron-Core's ``[S, B]`` token order does.
        max_tokens_per_rank: dropless all-to-all only: fail fast, instead of running out of memory, when
            more rows arrive at one rank's experts in a layer (a static plan's is ``Execution(row_budget=...)``).
    """

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: LoadBalancing = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    router_dtype: RouterDtype = "float32"
    sinkhorn_iterations: int = 30
    balance_update_rate: float = 0.001
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    max_tokens_per_rank: int | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> MoEConfig:
        for name in MOVED_TO_EXECUTION:
            if name in kwargs:
                raise TypeError(
                    f"MoEConfig({name}=...) moved to lightning_ep.Execution, which holds every choice of how a step "
                    f"runs: pass ExpertParallelStrategy(execution=Execution({_EXECUTION_SPELLING[name]})) "
                    "(or transform(..., execution=LayerExecution(...)))."
                )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"MoEConfig.{name} must be a bool, got {value!r} ({type(value).__name__}).")
        _check_int("random_seed", self.random_seed, minimum=0)
        _check_int("sinkhorn_iterations", self.sinkhorn_iterations, minimum=1)
        _check_choice("moe_load_balancing", self.moe_load_balancing, get_args(LoadBalancing))
        _check_choice("router_dtype", self.router_dtype, get_args(RouterDtype))
        _check_choice("drop_policy", self.drop_policy, get_args(DropPolicy))
        if self.capacity_factor is not None:
            _check_float("capacity_factor", self.capacity_factor)
            if self.capacity_factor <= 0:
                raise ValueError(
                    f"MoEConfig.capacity_factor must be > 0, got {self.capacity_factor!r}; "
                    "use None for dropless routing."
                )
            if not self.moe_all_to_all_dispatcher:
                raise ValueError(
                    "MoEConfig.capacity_factor needs the all-to-all dispatcher, but moe_all_to_all_dispatcher=False; "
                    "set moe_all_to_all_dispatcher=True or capacity_factor=None."
                )
        if self.max_tokens_per_rank is not None:
            _check_int("max_tokens_per_rank", self.max_tokens_per_rank, minimum=1)
            if self.capacity_factor is not None or not self.moe_all_to_all_dispatcher:
                raise ValueError(
                    f"MoEConfig.max_tokens_per_rank={self.max_tokens_per_rank} guards dropless all-to-all dispatch; "
                    "with a capacity_factor the load is bounded already, and the all-gather dispatcher does not "
                    "check it: drop one of them."
                )
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "balance_update_rate"):
            _check_float(name, getattr(self, name))

    def loss_weights(self, loss_scale: float = 1.0) -> list[float]:
        """The weights of ``[aux_loss, z_loss]`` in the gradients, times ``loss_scale`` (0 for a loss that is off)."""
        aux_weight = self.moe_aux_loss_coeff * loss_scale if self.aux_loss_active else 0.0
        z_weight = self.moe_z_loss_coeff * loss_scale if self.z_loss_active else 0.0
        return [aux_weight, z_weight]

    @property
    def aux_loss_active(self) -> bool:
        """Whether the load-balancing loss reaches the gradients."""
        return self.moe_load_balancing == "aux_loss" and self.moe_aux_loss_coeff > 0

    @property
    def z_loss_active(self) -> bool:
        """Whether the router z-loss reaches the gradients."""
        return self.moe_z_loss_coeff > 0


# ``__new__`` only refuses the moved fields: LightningCLI reads the dataclass's fields by ``inspect.signature``.
MoEConfig.__new__.__signature__ = inspect.signature(MoEConfig.__init__)  # type: ignore[attr-defined]


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"MoEConfig.{name} must be an int, got {value!r} ({type(value).__name__}); "
            f"pass a whole number >= {minimum}."
        )
    if value < minimum:
        raise ValueError(f"MoEConfig.{name} must be >= {minimum}, got {value}.")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"MoEConfig.{name}={value!r} is not supported; choose one of {list(allowed)}.")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"MoEConfig.{name} must be a float, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"MoEConfig.{name} must be a finite number >= 0, got {value!r}.")


class _Absent:
    """The value of a field one side of ``config_differences`` does not have."""

    def __repr__(self) -> str:
        return "<no such field>"


ABSENT: Any = _Absent()


def config_differences(
    old: MoEConfig | Mapping[str, Any], new: MoEConfig, *, math_only: bool = False
) -> dict[str, tuple[Any, Any]]:
    """The fields whose values differ between ``old`` and ``new``, as ``{name: (old, new)}``.

    ``old``: a ``MoEConfig`` or its ``dataclasses.asdict`` record (e.g. from a checkpoint), whose
    missing fields (written before they existed) take their defaults, and whose fields ``MoEConfig``
    no longer has differ from ``ABSENT``. ``math_only``: leave out ``EXECUTION_FIELDS``.
    """
    old_values = dict(old) if isinstance(old, Mapping) else asdict(old)
    new_values = asdict(new)
    defaults = {f.name: f.default for f in fields(MoEConfig)}
    names = [*new_values, *(name for name in old_values if name not in new_values)]
    if math_only:
        names = [name for name in names if name not in EXECUTION_FIELDS]
    pairs = {name: (old_values.get(name, defaults.get(name, ABSENT)), new_values.get(name, ABSENT)) for name in names}
    return {name: (before, after) for name, (before, after) in pairs.items() if before != after}
