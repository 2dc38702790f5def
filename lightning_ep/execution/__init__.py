"""How a training step runs, never what it computes: ``Execution``'s choices and their resolution
(``choices``), what the strategy shows ``resolve`` (``environment``), and the report of which AdamW
kernels step the optimizers (``adamw``). The MoE layers take the resolved choices as one frozen
``lightning_ep.LayerExecution`` (``Resolved.layers``)."""

from lightning_ep.execution.choices import (
    EXCHANGES,
    LARGE_EXPERT_ELEMENTS,
    Choice,
    Environment,
    Execution,
    Resolved,
    resolve,
    with_optimizers,
)

__all__ = [
    "EXCHANGES",
    "LARGE_EXPERT_ELEMENTS",
    "Choice",
    "Environment",
    "Execution",
    "Resolved",
    "resolve",
    "with_optimizers",
]
