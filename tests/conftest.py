"""Shared helpers for every test tier: the tiny Mixtral factory, a relative-error helper, a
counter of CUDA host syncs, and a one-process distributed environment for in-process Trainer runs.

Import them from a test module with ``from conftest import tiny_mixtral_config`` (pytest puts this
folder on ``sys.path``), or use the fixtures below. transformers is imported lazily so that
collecting a test that does not need it does not pay for (or depend on) the import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

TINY_MIXTRAL: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


def tiny_mixtral_config(**overrides: Any):
    """A ``transformers.MixtralConfig`` small enough for CPU unit tests (H=64, I=32, E=8, K=2)."""
    from transformers import MixtralConfig

    return MixtralConfig(**{**TINY_MIXTRAL, **overrides})


def tiny_mixtral(seed: int = 0, **overrides: Any):
    """A freshly initialised ``MixtralForCausalLM`` of ``tiny_mixtral_config(**overrides)``, in train mode.

    ``seed`` seeds the global torch RNG before construction, so equal seeds give equal weights.
    """
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(tiny_mixtral_config(**overrides)).train()


def count_syncs(fn: Callable[[], Any]) -> int:
    """Device-to-host syncs of one ``fn()`` in steady state (``torch.cuda.set_sync_debug_mode``).

    The first run under the sync debug mode in a process reports one sync that never recurs (seen
    on H200, torch 2.11: 12 later steps had none, in "warn" and in "error" mode), so a first run
    under the mode is discarded."""
    _count_syncs_once(fn)
    return _count_syncs_once(fn)


def _count_syncs_once(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``b`` is the reference)."""
    a64, b64 = a.detach().double(), b.detach().double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


@pytest.fixture
def tiny_config():
    """The tiny ``MixtralConfig`` with its defaults."""
    return tiny_mixtral_config()


@pytest.fixture
def tiny_model():
    """A tiny ``MixtralForCausalLM`` (seed 0), in train mode."""
    return tiny_mixtral()


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch):
    """A free ``MASTER_ADDR``/``MASTER_PORT`` for a Trainer run in this process (one rank, gloo);
    the default process group is destroyed afterwards."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
