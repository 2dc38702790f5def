"""Register ``strategy="expert_parallel"`` with Lightning without importing Lightning eagerly.

``import lightning_ep`` must stay light (``lightning_ep.moe`` imports neither Lightning nor
transformers), yet ``Trainer(strategy="expert_parallel")`` must work after it. If Lightning's
strategy registry is already imported, register now; otherwise register the moment it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_REGISTRY_MODULE = "lightning.pytorch.strategies"
NAME = "expert_parallel"


def _make_strategy(**kwargs: Any) -> Any:
    # Imported on use: the registry may be filled while Lightning itself is still importing.
    from lightning_ep.strategy.expert_parallel import ExpertParallelStrategy

    return ExpertParallelStrategy(**kwargs)


def register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if NAME not in StrategyRegistry:
        StrategyRegistry.register(NAME, _make_strategy, description="Expert parallelism for MoE models (lightning_ep)")


class _RegisterOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps the loader of Lightning's strategies package to register right after it executes."""

    def __init__(self) -> None:
        self._inner: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._inner is not None
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._inner is not None
        self._inner.exec_module(module)
        register()


def register_when_lightning_loads() -> None:
    if _REGISTRY_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
