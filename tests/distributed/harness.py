"""Start ``world`` gloo processes on the CPU and run a worker function in each.

Workers are plain top-level functions ``fn(rank, world, *args)``; an exception in any of them fails
the test with the worker's traceback. A worker ends by itself when the test's process dies.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from processes import exit_when_parent_dies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, store: str, backend: str, fn: Callable[..., Any], args: tuple) -> None:
    exit_when_parent_dies()
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A file store, not a TCP port: no race with other tests or programs for a free port.
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # The worker passed. Leave without interpreter finalization: a gloo worker thread that still
    # holds a finished FSDP2 all-gather's tensors can try to take the GIL while Python finalizes and
    # abort the process (pytorch/pytorch#190489; seen here under activation checkpointing).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes joined by a process group (gloo on the
    CPU; ``backend="nccl"``: one GPU per rank).

    On the CPU the workers are forked from this process, which has imported torch and the test's
    modules already (a fresh interpreter per worker would import them again, seconds each). CUDA
    cannot be used in a child forked after it was initialised, so NCCL workers are spawned, and so
    are all workers once this process has used CUDA."""
    method = "spawn" if backend == "nccl" or torch.cuda.is_initialized() else "fork"
    with tempfile.TemporaryDirectory() as tmp:
        args_ = (world, os.path.join(tmp, "store"), backend, fn, args)
        mp.start_processes(_entry, args=args_, nprocs=world, join=True, start_method=method)
