"""Shared helpers for every test tier: the tiny Mixtral factory, a relative-error helper, a
counter of CUDA host syncs, a runner for Triton's CPU interpreter, and a one-process distributed
environment for in-process Trainer runs; and a check after every test that it left no process
behind (``tests/processes.py``).

Import them from a test module with ``from conftest import tiny_mixtral_config`` (pytest puts this
folder on ``sys.path``), or use the fixtures below. transformers is imported lazily so that
collecting a test that does not need it does not pay for (or depend on) the import.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from processes import MARKER, kill_tree, leftovers, start_time, wait_for_exit

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


def run_in_triton_interpreter(*args: str, timeout: int = 300) -> None:
    """Run ``python *args`` (``-c CODE`` or a script) under Triton's CPU interpreter, a fresh process
    since the flag is read at import, and fail unless it exits 0 and its output ends with ``ok``.
    Skips the test where Triton is not installed (the kernels then run on CUDA only)."""
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (the kernels run on CUDA only)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


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
    the default process group is destroyed afterwards, and the variables Lightning's launcher sets
    in this process are removed (a later ``LOCAL_RANK`` made a CLI run that pytest starts think it
    was a launched rank and wait for the others)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    launcher_env = {name: os.environ.get(name) for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in launcher_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# Started after this many clock ticks since boot: the processes this pytest run may have started.
_RUN_START = 0
# How long a test's processes may take to end after it returns (a killed torchrun's workers notice
# within half a second, see processes.exit_when_parent_dies).
_GRACE_S = 5.0


def pytest_configure(config: pytest.Config) -> None:
    """Mark this run's environment, which every process the tests start inherits."""
    global _RUN_START
    os.environ[MARKER] = str(os.getpid())
    _RUN_START = start_time(os.getpid())


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fail the test (at teardown) if a process it started still runs once it is done, and end
    that process: descendants of pytest, and processes adopted by init that carry the marker
    (torchrun workers whose torchrun was killed)."""
    yield
    found = leftovers(os.getpid(), _RUN_START)
    # Open MPI's singleton daemon, which Lightning's MPI environment detection starts through mpi4py on
    # images that ship it, lives as long as this pytest process and ends with it (its died-pipe).
    found = {pid: cmd for pid, cmd in found.items() if "--singleton-died-pipe" not in cmd}
    alive = wait_for_exit(found, _GRACE_S) if found else {}
    if alive:
        for pid in alive:
            kill_tree(pid)
        listing = "\n".join(f"  {pid}: {cmd[:200]}" for pid, cmd in alive.items())
        pytest.fail(f"{len(alive)} processes started by this test still ran {_GRACE_S:.0f} s after it:\n{listing}")
