"""The Lightning side: ``ExpertParallelStrategy`` (``expert_parallel``) and what it needs around it.

Only this package, ``monitor`` and ``checkpoint`` import Lightning; ``ExpertParallelStrategy`` is
imported on first use, so ``import lightning_ep.strategy.registration`` stays light.
"""

from typing import Any

__all__ = ["ExpertParallelStrategy"]


def __getattr__(name: str) -> Any:
    if name == "ExpertParallelStrategy":
        from lightning_ep.strategy.expert_parallel import ExpertParallelStrategy

        return ExpertParallelStrategy
    raise AttributeError(f"module 'lightning_ep.strategy' has no attribute {name!r}")
