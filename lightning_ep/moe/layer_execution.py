"""``LayerExecution``: how the MoE layers carry out their dispatch, experts and combine, never what
they compute; one frozen record that ``transform`` and ``make_dispatcher`` take (``lightning_ep.Execution``
resolves to one, ``Resolved.layers``; a model transformed by hand takes one directly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_ep.moe.config import MoEConfig

LayerExchange = Literal["collective", "symmetric_memory"]


@dataclass(frozen=True, kw_only=True)
class LayerExecution:
    """The concrete choices the MoE layers are built with (``lightning_ep.execution.choices`` says what
    each does): ``cuda_graphs`` (``moe.graphs``), ``exchange`` (``"collective"`` or
    ``"symmetric_memory"``: ``dispatch.static.symmetric``), ``token_dedup`` (``dispatch.dedup``) and
    ``row_budget`` (an int, ``"auto"`` for the padded all-to-all, ``None``: the dynamic plan).
    ``check`` refuses choices that cannot apply to a ``MoEConfig`` at a degree, naming the fix.
    """

    cuda_graphs: bool = False
    exchange: LayerExchange = "collective"
    token_dedup: bool = False
    row_budget: int | Literal["auto"] | None = None

    def __post_init__(self) -> None:
        for name in ("cuda_graphs", "token_dedup"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LayerExecution({name}={getattr(self, name)!r}): pass True or False.")
        if self.exchange not in ("collective", "symmetric_memory"):
            raise ValueError(f"LayerExecution(exchange={self.exchange!r}): pass 'collective' or 'symmetric_memory'.")
        budget = self.row_budget
        number = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
        if budget is not None and budget != "auto" and not number:
            raise ValueError(f"LayerExecution(row_budget={budget!r}): pass an int >= 1, 'auto' or None.")
        symmetric = self.exchange == "symmetric_memory"
        if symmetric and budget == "auto":
            raise ValueError(
                "row_budget='auto' sizes the padded all-to-all; the symmetric-memory exchange takes an int."
            )
        if self.token_dedup and (symmetric or budget is not None):
            raise ValueError(
                f"token_dedup=True deduplicates the dynamic collective all-to-all, but exchange={self.exchange!r}, "
                f"row_budget={budget!r}; pass one of them."
            )

    def check(self, config: MoEConfig, degree: int) -> None:
        """Refuse choices that cannot apply to ``config``'s layers at expert-parallel ``degree``."""
        dropless_a2a = config.capacity_factor is None and config.moe_all_to_all_dispatcher
        exchange_choices = self.exchange != "collective" or self.token_dedup or self.row_budget is not None
        if exchange_choices and (degree == 1 or not dropless_a2a):
            raise ValueError(
                f"Execution(exchange={self.exchange!r}, token_dedup={self.token_dedup}, "
                f"row_budget={self.row_budget!r}) changes the dropless all-to-all between expert-parallel ranks, "
                f"but degree={degree}, capacity_factor={config.capacity_factor}, moe_all_to_all_dispatcher="
                f"{config.moe_all_to_all_dispatcher}; leave them at their defaults here."
            )
        if self.cuda_graphs:
            static = self.exchange == "symmetric_memory" and isinstance(self.row_budget, int)
            blocker = graphs_blocker(config, degree, static_plan=static)
            if blocker is not None:
                raise ValueError(
                    f"Execution(cuda_graphs=True) needs {blocker}, but capacity_factor={config.capacity_factor}, "
                    f"degree={degree}, exchange={self.exchange!r}, row_budget={self.row_budget!r}; "
                    "set cuda_graphs=False, or what it needs."
                )


def graphs_blocker(
    config: MoEConfig,
    degree: int,
    *,
    static_plan: bool,
    world_size: int | None = None,
    cuda_triton: bool = True,
    precision: str | None = None,
    activation_checkpointing: bool | str = False,
    lora_ranks: tuple[int, ...] = (),
    frozen_experts: str | None = None,
) -> str | None:
    """What keeps CUDA graphs (``LayerExecution.cuda_graphs``) from applying, in words, or ``None``: the
    one place their preconditions are decided. ``static_plan``: the dispatch above degree 1 is the
    symmetric-memory exchange with an int row budget; the other arguments as far as known."""
    if not cuda_triton:
        return "CUDA with Triton"
    if precision is not None and precision not in ("bf16-mixed", "bf16-true"):
        return f"bf16 experts (precision is {precision})"
    if activation_checkpointing:
        return "no activation checkpointing"
    if frozen_experts is not None:  # dequantized in saved-tensor hooks, which no capture has been shown to replay
        return f"expert weights in the compute dtype (frozen_experts={frozen_experts!r})"
    if config.capacity_factor is not None:
        return "a dropless dispatch (capacity_factor is set)"
    unaligned = sorted({r for r in lora_ranks if r % 8})
    if unaligned:  # the adapters' grouped GEMMs need 16-byte rows; the per-expert loop reads counts on the host
        return f"expert LoRA ranks that are multiples of 8 for the grouped GEMM (ranks {unaligned})"
    if world_size is not None and degree != world_size:
        return f"expert weights that stay in place (degree {degree} = world size {world_size})"
    if degree > 1 and not static_plan:
        return "a static plan above degree 1 (exchange='symmetric_memory' with an int row_budget)"
    return None
